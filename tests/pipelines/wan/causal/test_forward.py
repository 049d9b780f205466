"""One chunk's forward against the plain transformer forward, and its refusals."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelines.parallel.plan import ParallelPlan
from pipelines.wan.causal import CacheWindow, KVCache, cache_bytes, chunk_forward, write_chunk
from pipelines.wan.transformer import WanTransformerConfig, forward, init_transformer
from tests.numerics import EPS_F32, within

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2

CONFIG = WanTransformerConfig(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                              text_dim=24, freq_dim=16, ffn_dim=64, num_layers=2)


def _setup(frames=3, batch=1):
  model = init_transformer(CONFIG, seed=0)
  rng = np.random.default_rng(0)
  latents = jnp.asarray(rng.standard_normal((batch, 4, frames, 8, 8)), jnp.float32)
  text = jnp.asarray(rng.standard_normal((batch, 8, 24)), jnp.float32)
  return model, latents, text


def _empty(model, capacity, batch=1):
  return KVCache.empty(layers=2, batch=batch, capacity=capacity, tokens_per_frame=16, heads=2, head_dim=16,
                       dtype=model.dtype)


def test_the_first_chunk_is_the_plain_forward_of_its_frames():
  """At frame 0 with an empty cache (every slot masked) a chunk sees itself only: the transformer's
  own forward of those frames. fp32, the same ops but for the masked keys' zero weights: within
  64 eps of the output's scale (two 2-layer forwards, ~10 roundings each, summed over <= 64 keys)."""
  model, latents, text = _setup()
  timestep = jnp.array([937.5])
  flow, k, v = jax.jit(chunk_forward)(model, latents, timestep, text, _empty(model, 6))
  plain = jax.jit(forward)(model, latents, timestep, text)
  scale = float(jnp.max(jnp.abs(plain)))
  within(float(jnp.max(jnp.abs(flow - plain))), 64 * EPS_F32 * scale, "first chunk vs forward")
  assert k.shape == v.shape == (2, 1, 48, 2, 16)


def test_a_filled_cache_changes_the_chunk_and_its_position_moves_its_rope():
  """Positive controls: the same chunk after a cache of other frames differs from the first chunk;
  and its values (no RoPE) do not depend on its position while its keys do."""
  model, latents, text = _setup()
  timestep = jnp.array([500.0])
  empty = _empty(model, 6)
  run = jax.jit(chunk_forward)
  flow0, k0, v0 = run(model, latents, timestep, text, empty)
  _, k_past, v_past = run(model, -latents, jnp.array([0.0]), text, empty)
  filled = write_chunk(empty, k_past, v_past, CacheWindow(3, 9, 0), 16)
  flow1, _, _ = run(model, latents, timestep, text, filled)
  assert float(jnp.max(jnp.abs(flow1 - flow0))) > 1e-3
  moved = dataclasses.replace(empty, frames=jnp.asarray(3, jnp.int32))
  _, k_moved, v_moved = run(model, latents, timestep, text, moved)
  np.testing.assert_array_equal(np.asarray(v_moved[0]), np.asarray(v0[0]))  # layer 0's values: no RoPE
  assert float(jnp.max(jnp.abs(k_moved[0] - k0[0]))) > 1e-3


def test_refusals_name_the_fix():
  model, latents, text = _setup(frames=1)
  plan = ParallelPlan.build("U=2,R=2", heads=2)
  odd = jnp.zeros((1, 4, 1, 2, 6))  # 3 tokens over 4 devices
  with pytest.raises(ValueError, match="U \\* R dividing 3"):
    chunk_forward(model, odd, jnp.array([1.0]), text, _empty(model, 0), plan)
  patched = init_transformer(dataclasses.replace(CONFIG, patch_size=(2, 2, 2)), seed=0)
  with pytest.raises(ValueError, match="temporal patch of 1"):
    chunk_forward(patched, jnp.zeros((1, 4, 2, 8, 8)), jnp.array([1.0]), text, _empty(model, 0))


def test_cache_bytes_counts_keys_and_values_of_every_layer():
  model, _, _ = _setup()
  assert cache_bytes(model, batch=1, capacity_frames=6, tokens_per_frame=16) == _empty(model, 6).nbytes()
  assert cache_bytes(model, batch=1, capacity_frames=6, tokens_per_frame=16) == 2 * 2 * 96 * 2 * 16 * 4


def test_empty_cache_slots_are_ignored_at_the_real_1_3b_480p_size():
  """At Wan 2.1 1.3B's width and 480p token counts (one block): a chunk of 3 latent frames (4,680
  queries) against a 21-frame window's cache (28,080 slots, 6 frames = 9,360 filled), the masked
  slots cannot reach the output, whatever they hold: garbage 30x the keys' scale there gives the
  same flow (the same ops on the same unmasked keys; only a masked key leaking, e.g. into a
  softmax bound, could change it). Positive control: garbage in a filled frame's keys changes it."""
  config = dataclasses.replace(WanTransformerConfig(), num_layers=1)  # heads 12 x 128, ffn 8960
  model = init_transformer(config, seed=0)
  rng = np.random.default_rng(0)
  latents = jnp.asarray(rng.standard_normal((1, 16, 3, 60, 104)), jnp.float32)
  text = jnp.asarray(rng.standard_normal((1, 64, config.text_dim)), jnp.float32)
  per_frame, capacity, filled = 1560, 18, 6
  shape = (1, 1, capacity * per_frame, 12, 128)
  k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
  garbage_k, garbage_v = k.copy(), v.copy()
  zeros_k, zeros_v = k.copy(), v.copy()
  past = filled * per_frame
  zeros_k[:, :, past:], zeros_v[:, :, past:] = 0, 0
  garbage_k[:, :, past:] *= 30
  garbage_v[:, :, past:] *= 30
  run = jax.jit(chunk_forward)
  timestep, frames = jnp.array([750.0]), jnp.asarray(filled, jnp.int32)
  clean, _, _ = run(model, latents, timestep, text, KVCache(jnp.asarray(zeros_k), jnp.asarray(zeros_v), frames))
  dirty, _, _ = run(model, latents, timestep, text, KVCache(jnp.asarray(garbage_k), jnp.asarray(garbage_v), frames))
  scale = float(jnp.max(jnp.abs(clean)))
  within(float(jnp.max(jnp.abs(dirty - clean))), 16 * EPS_F32 * scale, "masked garbage vs zeros")
  # Positive control: the same garbage in the last filled frame's slots (unmasked) changes the flow.
  garbage_k[:, :, past - per_frame:past] *= 30
  counted, _, _ = run(model, latents, timestep, text, KVCache(jnp.asarray(garbage_k), jnp.asarray(garbage_v), frames))
  assert float(jnp.max(jnp.abs(counted - dirty))) > 1e3 * EPS_F32 * scale
