"""The causal stream against Self-Forcing's own inference loop (tests/reference/self_forcing: its code,
run in torch float32 on the same tiny random weights saved in its checkpoint layout)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipelines.parallel.plan import ParallelPlan
from pipelines.wan.causal import CacheWindow, CausalStream, ChunkSchedule, chunk_noise
from pipelines.wan.pretrained import layouts
from pipelines.wan.transformer import WanTransformerConfig, load_transformer_state
from tests.harness import child_env
from tests.numerics import assert_psnr_at_least

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2

REFERENCE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "reference", "self_forcing", "run.py")
# CausalWanModel's arguments of the tiny model, and ours.
TINY = dict(model_type="t2v", patch_size=[1, 2, 2], text_len=8, in_dim=4, dim=32, ffn_dim=64, freq_dim=16,
            text_dim=24, out_dim=4, num_heads=2, num_layers=2, qk_norm=True, cross_attn_norm=True, eps=1e-6)
CONFIG = WanTransformerConfig(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                              out_channels=4, text_dim=24, freq_dim=16, ffn_dim=64, num_layers=2, eps=1e-6)
LATENT = (8, 8)  # 16 tokens a frame
# Two fp32 implementations of the same few forwards (each within ~1e-5 of its output's scale,
# tests/pipelines/wan/transformer/test_model.py): their latents agree to ~1e-5 of the latents' range,
# 100 dB; 90 dB (the acceptance) keeps a 3x margin. A wrong cache (a frame too many or too few, a
# RoPE offset) moves them by far more (the positive controls below: 46-57 dB measured).
MIN_DB = 90.0


def _reference(tmp_path, window: CacheWindow, schedule: ChunkSchedule, num_chunks: int, batch: int = 1,
               seed: int = 0, initial: np.ndarray | None = None):
  """(checkpoint path, the reference's latents [B, C, F, Hl, Wl] (after the `initial` [B, C, F0, Hl,
  Wl] frames it continues, if any), text states, noise key)."""
  key = jax.random.key(seed)
  c, steps = window.chunk_frames, len(schedule.denoising_step_list)
  shape = (batch, TINY["in_dim"], c, *LATENT)
  to_ref = lambda x: np.asarray(x).transpose(0, 2, 1, 3, 4)  # [B, C, c, H, W] -> [B, c, C, H, W]
  noise = np.concatenate([to_ref(chunk_noise(key, k, 0, shape)) for k in range(num_chunks)], axis=1)
  renoise = np.stack([to_ref(chunk_noise(key, k, i, shape)) for k in range(num_chunks) for i in range(1, steps)])
  text = np.random.default_rng(seed).standard_normal((batch, TINY["text_len"], TINY["text_dim"])).astype(np.float32)
  extra = {} if initial is None else {"initial_latent": initial.transpose(0, 2, 1, 3, 4)}
  np.savez(tmp_path / "inputs.npz", noise=noise, prompt_embeds=text, renoise=renoise, **extra)
  spec = {"checkpoint": str(tmp_path / "generator.pt"), "inputs": str(tmp_path / "inputs.npz"), "seed": seed,
          "model": {**TINY, "local_attn_size": window.window_frames or -1, "sink_size": window.sink_frames},
          "args": {"denoising_step_list": list(schedule.denoising_step_list),
                   "warp_denoising_step": schedule.warp_denoising_step, "num_frame_per_block": c,
                   "context_noise": schedule.context_noise, "timestep_shift": schedule.shift}}
  (tmp_path / "spec.json").write_text(json.dumps(spec))
  subprocess.run([sys.executable, REFERENCE, str(tmp_path / "spec.json"), str(tmp_path / "out.npy")], check=True,
                 env=child_env(), capture_output=True)
  made = np.load(tmp_path / "out.npy").transpose(0, 2, 1, 3, 4)
  return spec["checkpoint"], made[:, :, 0 if initial is None else initial.shape[2]:], text, key


def _ours(checkpoint: str, window, schedule, num_chunks, text, key, plan=None, initial=None) -> np.ndarray:
  file = layouts.read_component(checkpoint, "transformer")
  model = load_transformer_state(CONFIG, file.tensors, checkpoint)
  stream = CausalStream(model, window, schedule, plan)
  chunks = stream.latents(jnp.asarray(text), num_chunks=num_chunks, latent_size=LATENT, key=key,
                          initial_latents=None if initial is None else jnp.asarray(initial))
  return np.concatenate([np.asarray(x) for x in chunks], axis=2)


def _check(ours, reference, name):
  lo, span = reference.min(), np.ptp(reference)
  assert_psnr_at_least((ours - lo) / span, (reference - lo) / span, MIN_DB, name=name)


@pytest.mark.parametrize("window", [CacheWindow(3, None, 0), CacheWindow(3, 6, 0), CacheWindow(3, 9, 3)],
                         ids=["global", "window6", "window9-sink3"])
def test_stream_equals_self_forcing_past_its_window(tmp_path, window):
  """Four chunks of three frames (12 frames, more than a window of 6 or 9 holds): every latent
  equals the reference loop's, with the reference's schedule (warped 1000/750/500/250, shift 5)."""
  schedule = ChunkSchedule()
  checkpoint, reference, text, key = _reference(tmp_path, window, schedule, num_chunks=4)
  _check(_ours(checkpoint, window, schedule, 4, text, key), reference, f"stream vs Self-Forcing ({window})")


def test_positive_controls_another_window_or_sink_differs(tmp_path):
  """The same weights, noise and text with a window one chunk wider, or sink frames the checkpoint
  does not have: the latents differ from the reference's (so the equality above is not vacuous)."""
  window, schedule = CacheWindow(3, 6, 0), ChunkSchedule()
  checkpoint, reference, text, key = _reference(tmp_path, window, schedule, num_chunks=4)
  for other in (CacheWindow(3, 9, 0), CacheWindow(3, 6, 3)):
    ours = _ours(checkpoint, other, schedule, 4, text, key)
    with pytest.raises(AssertionError, match="PSNR"):
      _check(ours, reference, f"{other} vs the reference's {window}")


def test_stream_on_a_mesh_equals_self_forcing(tmp_path):
  """U=2,R=2 (the chunk's 48 tokens sequence-sharded, the cache's keys attended through USP):
  the reference's latents, past the window and with sink frames."""
  window, schedule = CacheWindow(3, 9, 3), ChunkSchedule()
  checkpoint, reference, text, key = _reference(tmp_path, window, schedule, num_chunks=4, batch=2)
  plan = ParallelPlan.build("U=2,R=2", heads=CONFIG.num_attention_heads)
  _check(_ours(checkpoint, window, schedule, 4, text, key, plan), reference, "stream on U=2,R=2 vs Self-Forcing")


def test_given_frames_fill_the_cache_as_the_reference_does(tmp_path):
  """Video extension: six given latent frames (two chunks) run once at the context timestep into
  the cache, then three chunks are made, with CausVid's unwarped schedule (1000, 757, 522, shift 8):
  the reference's latents after the given frames."""
  window, schedule = CacheWindow(3, 6, 0), ChunkSchedule((1000, 757, 522), warp_denoising_step=False, shift=8.0)
  initial = np.random.default_rng(1).standard_normal((1, 4, 6, *LATENT)).astype(np.float32)
  checkpoint, reference, text, key = _reference(tmp_path, window, schedule, num_chunks=3, initial=initial)
  _check(_ours(checkpoint, window, schedule, 3, text, key, initial=initial), reference,
         "continued stream vs Self-Forcing's initial_latent")


def test_bad_requests_are_refused_before_any_compute():
  model = load_transformer_state(CONFIG, _random_state(), "random")
  stream = CausalStream(model, CacheWindow(3, 6, 0))
  text, key = jnp.zeros((1, 8, 24)), jax.random.key(0)
  with pytest.raises(ValueError, match="num_chunks"):
    next(stream.latents(text, num_chunks=0, latent_size=LATENT, key=key))
  with pytest.raises(ValueError, match="multiple of the chunk"):
    next(stream.latents(text, num_chunks=1, latent_size=LATENT, key=key, initial_latents=jnp.zeros((1, 4, 4, 8, 8))))
  with pytest.raises(ValueError, match="RoPE reaches"):
    next(stream.latents(text, num_chunks=2000, latent_size=LATENT, key=key))
  with pytest.raises(ValueError, match="split evenly"):
    plan = ParallelPlan.build("U=2,R=2", heads=2)
    next(CausalStream(model, CacheWindow(1, 2, 0), plan=plan).latents(text, num_chunks=1, latent_size=(2, 6), key=key))


def _random_state():
  from pipelines.wan.transformer import checkpoint_layout
  rng = np.random.default_rng(0)
  return {key: rng.standard_normal(shape).astype(np.float32) * 0.1 for key, shape, *_ in checkpoint_layout(CONFIG)}


def test_the_cache_is_split_over_the_sequence_devices_as_usp_splits_tokens():
  """On U=2,R=2 a cache of 96 tokens lives as 24 tokens a device (keys and values); one that does not
  divide evenly is replicated; on one device it is that device's."""
  from pipelines.wan.causal.stream import cache_sharding

  plan = ParallelPlan.build("U=2,R=2", heads=2)
  split = cache_sharding(plan, 96)
  assert split.k_ZBSNH.shard_shape((2, 1, 96, 2, 16)) == (2, 1, 24, 2, 16) == split.v_ZBSNH.shard_shape(
      (2, 1, 96, 2, 16))
  assert cache_sharding(plan, 90).k_ZBSNH.is_fully_replicated
  assert cache_sharding(None, 96).k_ZBSNH == ParallelPlan.single().replicated


def test_the_device_holds_one_cache_a_step_returns_none_and_a_write_updates_it_in_place():
  """A denoising step's outputs hold no cache (an output cache is a second copy: on a v5e at 480p 4.8
  GiB more, out of memory) and the cache write gives its input cache's buffers to its output (donated:
  the caller's old cache is consumed). Positive control: the write does return a cache, of the same bytes."""
  from pipelines.wan.causal.cache import KVCache
  from pipelines.wan.causal.stream import _chunk_step
  from pipelines.wan.transformer import text_kv

  model = load_transformer_state(CONFIG, _random_state(), "random")
  window = CacheWindow(3, 9, 0)
  cache = KVCache.empty(layers=2, batch=1, capacity=window.capacity(12), tokens_per_frame=16, heads=2, head_dim=16,
                        dtype=jnp.float32)
  cache_bytes = cache.k_ZBSNH.nbytes + cache.v_ZBSNH.nbytes
  latents, kv = jnp.zeros((1, 4, 3, *LATENT)), text_kv(model, jnp.zeros((1, 8, 24)), None)
  graphdef, params = nnx.split(model)
  where = ParallelPlan.single().replicated
  step = lambda write, c: _chunk_step(graphdef, params, latents, 500.0, 0.5, kv, c, window=window, tokens_per_frame=16,
                                      plan=None, where=where, cache_where=None, write=write)
  x0 = step(False, cache)
  assert isinstance(x0, jax.Array) and x0.shape == latents.shape and not cache.k_ZBSNH.is_deleted()
  x0, written = step(True, cache)
  assert written.k_ZBSNH.nbytes + written.v_ZBSNH.nbytes == cache_bytes and int(written.frames) == 3
  assert cache.k_ZBSNH.is_deleted() and cache.v_ZBSNH.is_deleted()
