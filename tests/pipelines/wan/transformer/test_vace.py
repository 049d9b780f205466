"""Tests for pipelines/wan/transformer/vace.py: a VACE transformer equals diffusers'
`WanVACETransformer3DModel` (random weights, saved with `save_pretrained` and read by our loader) on
one device and sequence-parallel, with per-layer scales, in bf16, quantized, and refuses a missing
or misshaped context.

Tolerances: as test_model.py (FP32_REL: a few blocks of matmul chains of length <= 48; the VACE
branch adds at most as many blocks again, so twice that), bf16 as there.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import attention
from pipelines.parallel.plan import ParallelPlan
from pipelines.wan.transformer import forward, load_transformer, quantize_transformer, WanTransformerConfig
from pipelines.wan.transformer.vace import hint_slots
from tests.numerics import EPS_F32, assert_close_scaled
from tests.pipelines.wan.transformer.test_model import _collective_counts
from tests.torch_weights import randomize

diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.numerics

CONFIG = dict(num_attention_heads=4, attention_head_dim=12, num_layers=4, in_channels=4, out_channels=4, text_dim=20,
              freq_dim=256, ffn_dim=40, vace_layers=[0, 2], vace_in_channels=10)
GRID = (3, 6, 10)  # 45 tokens: padded to 48 on U x R = 4 or 8 devices
BATCH = 2
FP32_REL = 2 * 4 * 4 * math.sqrt(48) * EPS_F32  # (4 blocks + 2 VACE blocks) x 4 sums of length <= 48, rounded up
BF16_REL = 3e-2

forward_jit = jax.jit(forward, static_argnames=("plan",))



@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  model = diffusers.WanVACETransformer3DModel(**CONFIG)
  randomize(model, seed=7, spread=1.6)
  path = str(tmp_path_factory.mktemp("vace") / "transformer")
  model.save_pretrained(path, safe_serialization=True)
  return path


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  latents = rng.standard_normal((BATCH, 4, *GRID), dtype=np.float32)
  control = rng.standard_normal((BATCH, CONFIG["vace_in_channels"], *GRID), dtype=np.float32)
  return latents, np.array([981.0, 37.5], np.float32), rng.standard_normal((BATCH, 9, 20), dtype=np.float32), control


def _torch(folder, dtype, latents, timestep, text, control, scale=None):
  model = diffusers.WanVACETransformer3DModel.from_pretrained(folder, torch_dtype=dtype).eval()
  with torch.no_grad():
    out = model(torch.from_numpy(latents).to(dtype), torch.from_numpy(timestep), torch.from_numpy(text).to(dtype),
                control_hidden_states=torch.from_numpy(control).to(dtype),
                control_hidden_states_scale=None if scale is None else torch.tensor(scale, dtype=dtype),
                return_dict=False)[0]
  return out.float().numpy()


def test_config_reads_diffusers_and_places_hints(folder):
  model = load_transformer(folder, jnp.float32)
  assert model.config.vace_layers == (0, 2) and model.config.has_vace
  assert model.vace_blocks.proj_out.kernel.shape == (2, 48, 48)
  assert list(hint_slots(model.config)) == [0, -1, 1, -1]
  assert WanTransformerConfig.from_dict(model.config.to_dict()) == model.config
  assert "vace_layers" not in WanTransformerConfig().to_dict()  # a plain config stays diffusers' WanTransformer3DModel


@pytest.mark.parametrize("scale", [None, [0.7, -1.3]])
def test_matches_diffusers_fp32(folder, scale):
  latents, timestep, text, control = _inputs()
  ref = _torch(folder, torch.float32, latents, timestep, text, control, scale)
  model = load_transformer(folder, jnp.float32)
  out = forward_jit(model, latents, timestep, text, control_hidden_states=control,
                    control_hidden_states_scale=None if scale is None else np.float32(scale))
  assert_close_scaled(out, ref, rel=FP32_REL, name=f"VACE scale={scale} vs diffusers")
  # Positive control: the context reaches the output (another context, another prediction).
  other = forward_jit(model, latents, timestep, text, control_hidden_states=control[::-1].copy())
  assert np.max(np.abs(np.asarray(other) - ref)) > 100 * FP32_REL * np.max(np.abs(ref))


@pytest.mark.parametrize("ring,ulysses,shard", [(2, 2, False), (1, 4, True)])
def test_sequence_parallel_equals_one_device(folder, ring, ulysses, shard):
  latents, timestep, text, control = _inputs(1)
  model = load_transformer(folder, jnp.float32)
  single = forward_jit(model, latents, timestep, text, control_hidden_states=control)
  plan = ParallelPlan.build(attention.make_mesh(ulysses=ulysses, ring=ring), heads=4, shard_weights=shard)
  compiled = forward_jit.lower(model, latents, timestep, text, plan, control_hidden_states=control).compile()
  sharded = compiled(model, latents, timestep, text, control_hidden_states=control)
  assert_close_scaled(sharded, single, rel=FP32_REL, name=f"VACE R={ring} U={ulysses} shard={shard} vs one device")
  if not shard:  # the VACE scan's block body has the main one's collectives (DESIGN.md section 3), nothing more
    want = {"all-gather": 2 + 1, "all-to-all": 2 * 2, "collective-permute": 2 * (ring - 1), "all-reduce": 2}
    assert _collective_counts(compiled.as_text()) == want


@pytest.mark.large
def test_real_size_sequence_parallel_equals_one_device(tmp_path):
  """480x832 x 81 frames: 21 x 60 x 104 latents, 32,760 tokens (no multiple of any attention block),
  a VACE context of the same grid; U=2,R=2 equals one device within the fp32 bar at that length."""
  config = dict(CONFIG, num_layers=2, vace_layers=[0])
  model = diffusers.WanVACETransformer3DModel(**config)
  randomize(model, seed=8, spread=1.6)
  model.save_pretrained(str(tmp_path / "transformer"), safe_serialization=True)
  ours = load_transformer(str(tmp_path / "transformer"), jnp.float32)
  rng = np.random.default_rng(3)
  latents = rng.standard_normal((1, 4, 21, 60, 104), dtype=np.float32)
  control = rng.standard_normal((1, CONFIG["vace_in_channels"], 21, 60, 104), dtype=np.float32)
  timestep, text = np.array([500.0], np.float32), rng.standard_normal((1, 9, 20), dtype=np.float32)
  single = forward_jit(ours, latents, timestep, text, control_hidden_states=control)
  plan = ParallelPlan.build(attention.make_mesh(ulysses=2, ring=2), heads=4)
  sharded = forward_jit(ours, latents, timestep, text, plan, control_hidden_states=control)
  rel = 2 * 3 * 4 * math.sqrt(32760) * EPS_F32  # 3 blocks x 4 sums of length <= 32,760, as FP32_REL
  assert_close_scaled(sharded, single, rel=rel, name="VACE 32,760 tokens U=2,R=2 vs one device")


def test_matches_diffusers_bf16(folder):
  latents, timestep, text, control = _inputs(2)
  ref = _torch(folder, torch.bfloat16, latents, timestep, text, control, [0.5, 1.5])
  model = load_transformer(folder, jnp.bfloat16)
  assert model.vace_blocks.scale_shift_table.dtype == jnp.float32
  assert model.vace_blocks.attn1.to_q.kernel.dtype == jnp.bfloat16
  out = forward_jit(model, latents, timestep, text, control_hidden_states=control,
                    control_hidden_states_scale=np.float32([0.5, 1.5]))
  assert_close_scaled(out, ref, rel=BF16_REL, name="VACE bf16 vs diffusers bf16")


def test_quantized_vace_blocks(folder):
  """int8 weights on the VACE blocks too, within int8's error of the full-precision forward."""
  latents, timestep, text, control = _inputs(3)
  full = forward_jit(load_transformer(folder, jnp.float32), latents, timestep, text, control_hidden_states=control)
  model = load_transformer(folder, jnp.float32, quantize="int8")
  assert type(model.vace_blocks.attn1.to_q.kernel.get_value()).__name__ == "QArray"
  assert type(quantize_transformer(load_transformer(folder, jnp.float32), "int8")
              .vace_blocks.ffn.proj_in.kernel.get_value()).__name__ == "QArray"
  out = forward_jit(model, latents, timestep, text, control_hidden_states=control)
  # int8 per-channel weights: relative error ~ 2^-8 per matmul over ~6 chained blocks
  assert_close_scaled(out, full, rel=0.1, name="int8 VACE vs fp32")
  assert not np.array_equal(np.asarray(out), np.asarray(full))


def test_refusals(folder):
  latents, timestep, text, control = _inputs()
  model = load_transformer(folder, jnp.float32)
  with pytest.raises(ValueError, match=r"needs control_hidden_states \[2, 10, 3, 6, 10\]"):
    forward(model, latents, timestep, text)
  with pytest.raises(ValueError, match=r"needs control_hidden_states .* got \[2, 10, 2, 6, 10\]"):
    forward(model, latents, timestep, text, control_hidden_states=control[:, :, :2])
  with pytest.raises(ValueError, match=r"control_hidden_states_scale must be \[2\]"):
    forward(model, latents, timestep, text, control_hidden_states=control,
            control_hidden_states_scale=np.ones(3, np.float32))
  with pytest.raises(ValueError, match="vace_layers=\\[1, 2\\] must be increasing block indices from 0"):
    WanTransformerConfig(num_layers=4, vace_layers=(1, 2))
  with pytest.raises(ValueError, match="vace_layers=\\[0, 4\\]"):
    WanTransformerConfig(num_layers=4, vace_layers=(0, 4))
