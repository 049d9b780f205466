"""The layer-streamed decode (`pipelines/wan/vae/streamed.py`) equals `decode`; its memory is below it.

Latents of 3 frames (so the causal caches carry between chunks: chunk 2's programs read what chunk
1's wrote), Hl, Wl = 6, 5, for both topologies: "tiny" (Wan 2.1) and "tiny-ti2v" (Wan 2.2: residual
groups, whose inputs are held for their shortcuts).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelines.wan import vae as V
from pipelines.wan.vae import streamed
from pipelines.wan.vae.topology import param_shapes
from tests.numerics import EPS_BF16, assert_close_scaled, within

FRAMES, HL, WL = 3, 6, 5
# fp32, in units of the video's scale (max |video| ~ 1). Both decodes run the same layer functions on
# the same values; fp32 intermediates keep their values whether a program boundary stores them or a
# fusion keeps them in registers, so only how XLA contracts (FMA) or orders sums inside a fusion can
# differ: up to ~4 roundings of u = 2^-24 per layer (the norm's sum and scale, the bias and residual
# adds), ~30 layers in series with gains ~2 (each RMS norm renormalises): 30 * 4 * 2 u = 1.4e-5.
# Measured: 0 (bit-equal) for both topologies on XLA:CPU.
TOL_F32 = 2e-5


@pytest.fixture(scope="module", params=["tiny", "tiny-ti2v"])
def setup(request):
  """(config, latents [1, C, 3, 6, 5], fp32 `decode` video [1, 9, 6 s, 5 s, 3]) for one topology."""
  cfg = V.VAE_PRESETS[request.param]
  z = jax.random.normal(jax.random.key(1), (1, cfg.z_dim, FRAMES, HL, WL))
  vae = V.init_vae(cfg, jax.random.key(0))
  return cfg, z, np.asarray(V.decode(vae, z, video_layout="BFHWC"))


def test_fp32_equals_decode_and_carries_the_cache(setup):
  cfg, z, reference = setup
  vae = V.init_vae(cfg, jax.random.key(0))
  video = V.decode_streamed(vae, z)
  assert isinstance(video, np.ndarray) and video.shape == reference.shape == (1, 9, *(cfg.spatial_factor * np.array((HL, WL))), 3)
  assert_close_scaled(video, reference, rel=TOL_F32, name="streamed vs decode, fp32")
  # diffusers' layout as `decode` gives it
  np.testing.assert_array_equal(V.decode_streamed(vae, z, video_layout="BCFHW"), video.transpose(0, 4, 1, 2, 3))
  # Positive control: a different latent frame 1 leaves frame 0 alone and changes the frames of
  # chunk 2 (latent frame 2 is the same): through the cache only, so a decode that dropped or
  # misplaced the cache between chunks would fail the comparison above.
  z1 = z.at[:, :, 1].set(-z[:, :, 1])
  other = V.decode_streamed(vae, z1)
  np.testing.assert_array_equal(other[:, :1], video[:, :1])
  assert np.abs(other[:, 5:] - video[:, 5:]).max() > 1e-2


def test_bf16_is_as_close_to_fp32_as_decode(setup):
  # bf16: the streamed decode rounds every program's output to bf16, while XLA may keep a fused
  # whole-chunk program's intermediates in fp32 (xla_allow_excess_precision), so the two bf16 decodes
  # differ by bf16 rounding noise (measured max 0.17 on a video of scale 1), not bit for bit. The
  # property: its distance from the fp32 decode is that of a few bf16 roundings, as `decode`'s own
  # bf16 one is (RMS, measured 0.0060 / 0.0065 for tiny / tiny-ti2v; `decode` in bf16: 0.0067 /
  # 0.0065), bound 4 eps_bf16 = 0.031 (~4.7x margin). Coarse: a wrong cache moves the later frames by
  # RMS 0.02 (tiny) to 0.3 (tiny-ti2v), so the fp32 test above is the one that checks the cache.
  cfg, z, reference = setup
  vae = V.init_vae(cfg, jax.random.key(0), dtype=jnp.bfloat16)
  video = V.decode_streamed(vae, z)
  assert video.dtype == jnp.bfloat16
  rms = float(np.sqrt(np.mean((np.asarray(video, np.float64) - reference) ** 2)))
  within(rms, 4 * EPS_BF16, "streamed bf16 vs decode fp32 (RMS, video scale 1)")


@pytest.mark.parametrize("preset", ["tiny", "tiny-ti2v", "wan2.1", "wan2.2"])
def test_plan_covers_the_decoder_once(preset):
  cfg = V.VAE_PRESETS[preset]
  plan = streamed.decode_plan(cfg)
  steps = [s for s in plan if isinstance(s, streamed.LayerStep)]
  owned = [s.name + k[len(streamed.LOCAL):] for s in steps for k in param_shapes((s.layer,))]
  decoder = {k for k in cfg.param_shapes() if k.startswith(("decoder.", "post_quant_conv."))}
  assert sorted(owned) == sorted(decoder)  # every decoder parameter in exactly one step
  shortcuts = sum(isinstance(s, streamed.ShortcutStep) for s in plan)
  assert shortcuts == sum(s.holds for s in steps) == (3 if cfg.is_residual else 0)
  assert isinstance(plan[-1], streamed.OutputStep) and plan[-1].patch == cfg.patch
  assert len({s.layer for s in steps}) < len(steps)  # equal layers share a program


def test_streamed_memory_is_below_the_whole_chunk_programs():
  # The real Wan 2.1 VAE at 30 x 52 latents (240 x 416), abstract: nothing is allocated; ~10 s of
  # compiles. Measured on XLA:CPU: streamed 2.40 GB (weights 0.51, cache 0.96, the last up block's
  # resnet 0.93) vs `decode`'s later-chunk program 2.66 GB.
  cfg = V.VAE_PRESETS["wan2.1"]
  parts = V.streamed_memory(cfg, 1, 30, 52)
  whole = V.decode_memory(cfg, 1, 30, 52)
  assert V.streamed_decode_memory(cfg, 1, 30, 52) == parts.total < whole
  assert parts.weights == sum(np.prod(s) for s in cfg.param_shapes().values()) * 4
  _, cache = jax.eval_shape(lambda v, z: V.decode_chunk(v, None, z), V.abstract_vae(cfg),
                            jax.ShapeDtypeStruct((1, 1, 30, 52, cfg.z_dim), jnp.float32))
  assert parts.cache == streamed.tree_bytes(cache)
  assert 0 < parts.largest_call < whole - parts.weights - parts.cache, parts
