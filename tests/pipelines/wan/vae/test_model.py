"""Wan VAE parity with diffusers' AutoencoderKLWan: saved with save_pretrained, loaded by load_vae.

Small spatial sizes (latents 4 x 6, video 32 x 48) keep the file fast; the two topologies are the
tiny test config (every layer kind, 3 channels) and the real Wan 2.1 topology at base_dim 8. (The
released config is read in test_config.py, the conv form per platform checked in test_layers.py.)
"""

import json
import os

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pipelines.storage.weights import CheckpointError
from tests.numerics import EPS_F32, assert_close_scaled
from pipelines.wan import vae as V
from pipelines.wan.vae import effort as vae_effort, model as vae_model

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2

CONFIGS = {
    "tiny": dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                 temperal_downsample=[False, True, True]),
    "base8": dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                  temperal_downsample=[False, True, True]),
}
# fp32, in units of the output's scale (decoded video in [-1, 1]: 1; encoded mean / logvar: their
# max): ~30 conv layers in series, each summing up to 27 * C <= 864 products, whose rounding errors
# grow like sqrt(864) = 29 eps: 30 * 29 eps = 1e-4 (issue 6's acceptance). Measured <= 4.5e-6 under
# three ISA settings.
TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
  """(diffusers model, our loaded model, folder) for one config, random weights incl. gammas."""
  torch.manual_seed(0)
  ref = diffusers.AutoencoderKLWan(**CONFIGS[request.param]).eval()
  with torch.no_grad():
    for name, p in ref.named_parameters():
      if name.endswith("gamma"):  # default gammas are 1: perturb them so the loader's layout is tested
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
  folder = str(tmp_path_factory.mktemp(f"vae_{request.param}"))
  ref.save_pretrained(folder, safe_serialization=True)
  return ref, V.load_vae(folder), folder


@pytest.mark.parametrize("frames", [1, 2, 3])
def test_decode_parity(models, frames):
  ref, vae, _ = models
  batch = 2 if vae.config.base_dim == 3 else 1  # batch 2 where it is cheap
  z = torch.randn(batch, 16, frames, 4, 6, generator=torch.Generator().manual_seed(frames))
  with torch.no_grad():
    want = ref.decode(z).sample.numpy()
  got = np.asarray(V.decode(vae, jnp.asarray(z.numpy())))
  assert got.shape == want.shape == (batch, 3, 1 + 4 * (frames - 1), 32, 48)
  assert np.mean(np.abs(want) < 1.0) > 0.5, "reference mostly clamped: the comparison would be weak"
  assert_close_scaled(got, want, rel=TOL, scale=1.0, name=f"decode {frames} frames")
  if frames == 3:
    channels_last = np.asarray(V.decode(vae, jnp.asarray(z.numpy()), video_layout="BFHWC"))
    # Bit-exact: the same compiled chunk programs; the layouts differ by a final transpose only.
    np.testing.assert_array_equal(channels_last, got.transpose(0, 2, 3, 4, 1))


@pytest.mark.parametrize("frames", [1, 5, 9])
def test_encode_parity(models, frames):
  ref, vae, _ = models
  x = torch.rand(1, 3, frames, 32, 48, generator=torch.Generator().manual_seed(frames)) * 2 - 1
  with torch.no_grad():
    want = ref.encode(x).latent_dist
  got = V.encode(vae, jnp.asarray(x.numpy()))
  assert got.mean.shape == tuple(want.mean.shape) == (1, 16, 1 + (frames - 1) // 4, 4, 6)
  for name in ("mean", "logvar"):
    assert_close_scaled(getattr(got, name), getattr(want, name).numpy(), rel=TOL,
                        name=f"encode {frames} frames: {name}")


@pytest.mark.parametrize("models", ["tiny"], indirect=True)
def test_later_chunks_share_one_program(models):
  # F latent frames must not compile F programs: frames 2.. reuse the same next-chunk executable.
  _, vae, _ = models
  z = jax.random.normal(jax.random.key(0), (2, 16, 2, 4, 6))  # the parity tests' shapes
  V.decode(vae, z)
  later = vae_model._chunk_programs(vae_effort.decode_compile_effort("cpu")).later
  size = later._cache_size()
  video = V.decode(vae, jnp.concatenate([z] * 3, axis=2))
  assert video.shape == (2, 3, 21, 32, 48)
  assert later._cache_size() == size, "a longer video compiled a new chunk program"


@pytest.mark.parametrize("models", ["tiny"], indirect=True)
def test_decode_compile_effort_changes_the_program_not_the_video(models, monkeypatch):
  """On TPU the decoder compiles at a lower XLA optimization effort (a faster compile); the programs
  built that way must decode the same video. On CPU the effort is XLA's default."""
  assert vae_effort.decode_compile_effort("tpu") == vae_effort.TPU_DECODE_COMPILE_EFFORT < 0
  assert vae_effort.decode_compile_effort("cpu") is None and vae_effort.decode_compile_effort("gpu") is None  # JAX's own
  _, vae, _ = models
  z = jax.random.normal(jax.random.key(1), (1, 16, 2, 4, 6))
  default = np.asarray(V.decode(vae, z))
  monkeypatch.setattr(vae_effort, "decode_compile_effort", lambda platform: -0.5)
  lowered = vae_model._chunk_programs(-0.5).later
  before = lowered._cache_size()
  low_effort = np.asarray(V.decode(vae, z))
  assert lowered._cache_size() == before + 1  # the -0.5 programs ran (positive control)
  np.testing.assert_allclose(low_effort, default, rtol=0, atol=1e-5)  # fp32, values in [-1, 1]


@pytest.mark.parametrize("models", ["tiny"], indirect=True)
def test_loader_reports_shape_mismatch(models, tmp_path):
  _, _, folder = models
  state = load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
  state["decoder.conv_out.bias"] = torch.zeros(7)
  del state["quant_conv.bias"]
  save_file(state, str(tmp_path / "diffusion_pytorch_model.safetensors"))
  with open(os.path.join(folder, "config.json")) as f:
    (tmp_path / "config.json").write_text(f.read())
  with pytest.raises(CheckpointError, match=r"decoder\.conv_out\.bias: checkpoint \(7,\) vs model \(3,\)") as e:
    V.load_vae(str(tmp_path))
  assert "quant_conv.bias" in str(e.value)


def test_loader_rejects_unsupported_config(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan", "z_dim": 48,
                                                    "is_residual": True, "patch_size": 2}))
  with pytest.raises(CheckpointError, match="in_channels=3 must be a multiple of patch_size"):
    V.load_vae(str(tmp_path))


@pytest.mark.parametrize("models", ["tiny"], indirect=True)
def test_bad_inputs_raise(models):
  _, vae, _ = models
  with pytest.raises(ValueError, match="C=4 channels"):
    V.decode(vae, jnp.zeros((1, 4, 2, 4, 6)))
  with pytest.raises(ValueError, match="zero frames"):
    V.decode(vae, jnp.zeros((1, 16, 0, 4, 6)))
  with pytest.raises(ValueError, match="video_layout"):
    V.decode(vae, jnp.zeros((1, 16, 1, 4, 6)), video_layout="BHWC")
  with pytest.raises(ValueError, match="frames=6 must be 1 \\+ 4k"):
    V.encode(vae, jnp.zeros((1, 3, 6, 32, 48)))
  with pytest.raises(ValueError, match="height=30"):
    V.encode(vae, jnp.zeros((1, 3, 1, 30, 48)))


def test_denormalize_matches_wan_pipeline():
  cfg = V.VAE_PRESETS["wan2.1"]
  z = torch.randn(1, 16, 2, 3, 4, generator=torch.Generator().manual_seed(0))
  # WanPipeline.__call__, verbatim apart from the device moves.
  mean = torch.tensor(cfg.latents_mean).view(1, 16, 1, 1, 1)
  inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, 16, 1, 1, 1)
  want = (z / inv_std + mean).numpy()
  got = np.asarray(V.denormalize_latents(cfg, jnp.asarray(z.numpy())))
  # A division and an addition on each side, half an ulp each, and up to 2 ulps more where
  # XLA:CPU's vectorised division is not correctly rounded: ~4 eps of the larger term (the sum
  # cancels where the mean is near -z * std). 16 eps; measured 1.8 eps.
  terms = np.maximum(np.abs((z / inv_std).numpy()), np.abs(mean.numpy()))
  assert_close_scaled(got, want, rel=16 * EPS_F32, scale=terms, name="denormalize")
  # And back: the same roundings again, through the 1 / std factor.
  back = np.asarray(V.normalize_latents(cfg, jnp.asarray(got)))
  assert_close_scaled(back, z.numpy(), rel=32 * EPS_F32, scale=terms * inv_std.numpy(),
                      name="normalize round trip")


def test_init_decodes_and_bf16_keeps_dtype():
  cfg = V.VAE_PRESETS["tiny"]
  vae = V.init_vae(cfg, jax.random.key(0))
  assert {k: v.shape for k, v in vae.params.items()} == {
      k: V.to_jax_layout(k, np.empty(s)).shape for k, s in cfg.param_shapes().items()}
  z = jax.random.normal(jax.random.key(1), (2, 16, 2, 4, 6))  # the parity tests' (compiled) shapes
  video = V.decode(vae, z)
  assert video.shape == (2, 3, 5, 32, 48) and video.dtype == jnp.float32
  assert float(jnp.std(video)) > 1e-2, "random-init decoder output is (nearly) constant"
  # bf16 inference: every activation and cache entry stays bf16 (abstract trace: no compile).
  vae16 = V.init_vae(cfg, jax.random.key(0), dtype=jnp.bfloat16)
  z16 = jax.ShapeDtypeStruct((1, 2, 4, 6, 16), jnp.bfloat16)
  programs = vae_model._chunk_programs(vae_effort.decode_compile_effort("cpu"))
  out, cache = jax.eval_shape(programs.first, vae16, z16)
  out, cache = jax.eval_shape(programs.later, vae16, cache, z16)
  assert out.shape == (1, 8, 32, 48, 3)
  assert {x.dtype for x in (out, *cache.values())} == {jnp.dtype(jnp.bfloat16)}


def test_memory_analysis_of_chunk_step():
  # The decode docstring's estimate comes from this helper; check it on a small config that the
  # donated cache is aliased (the step does not hold two caches).
  stats = V.decode_step_memory_analysis(V.VAE_PRESETS["tiny"], 1, 4, 6)
  assert stats.alias_size_in_bytes > 0
  assert stats.temp_size_in_bytes > 0



def test_decoding_in_pieces_carries_the_cache_as_one_decode():
  """A stream's decode: 3 latent frames, then 3 more with the returned cache, are the frames of one
  decode of all 6 (the same programs on the same values: equal bit for bit); 1 + 4 * 2 frames,
  then 4 * 3. Positive control: the second piece without the cache (from frame 0) differs."""
  cfg = V.VAE_PRESETS["tiny"]
  vae = V.init_vae(cfg, jax.random.key(0))
  z = jax.random.normal(jax.random.key(1), (1, cfg.z_dim, 6, 4, 6))
  whole = V.decode(vae, z, video_layout="BFHWC")
  first, cache = V.decode_continued(vae, z[:, :, :3])
  second, _ = V.decode_continued(vae, z[:, :, 3:], cache)
  assert (first.shape[1], second.shape[1]) == (9, 12)
  np.testing.assert_array_equal(np.concatenate([first, second], axis=1), np.asarray(whole))
  fresh, _ = V.decode_continued(vae, z[:, :, 3:])
  assert float(jnp.max(jnp.abs(fresh[:, 1:] - second[:, 4:]))) > 1e-3
