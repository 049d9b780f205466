"""The layer-streamed decode (`pipelines/wan/vae/streamed.py`) equals `decode`; its memory is below it.

Latents of 3 frames (so the causal caches carry between chunks: chunk 2's programs read what chunk
1's wrote, and within a later chunk each frame's programs read what the previous frame's wrote),
Hl, Wl = 6, 5, for both topologies: "tiny" (Wan 2.1) and "tiny-ti2v" (Wan 2.2: residual groups,
whose inputs are held for their shortcuts, a time-repeating `dup_up` among them).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelines.wan import vae as V
from pipelines.wan.vae import streamed
from pipelines.wan.vae.topology import param_shapes
from tests.numerics import EPS_BF16, assert_close_scaled, within

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2

FRAMES, HL, WL = 3, 6, 5
# fp32, in units of the video's scale (max |video| ~ 1). Both decodes run the same layer functions on
# the same values; fp32 intermediates keep their values whether a program boundary stores them or a
# fusion keeps them in registers, so only how XLA contracts (FMA) or orders sums inside a fusion can
# differ: up to ~4 roundings of u = 2^-24 per layer (the norm's sum and scale, the bias and residual
# adds), ~30 layers in series with gains ~2 (each RMS norm renormalises): 30 * 4 * 2 u = 1.4e-5.
# Frame by frame the convs also run on 1 frame instead of 4 (another batch for XLA:CPU's conv, which
# may block and sum in another order: the same bound). Measured max |diff| on XLA:CPU: whole inputs
# 0 (bit-equal) for both topologies; frame by frame 3.0e-7 (tiny), 0 (tiny-ti2v).
TOL_F32 = 2e-5


@pytest.mark.parametrize("preset", ["tiny", "tiny-ti2v"])
def test_streamed_decode_equals_decode(preset, monkeypatch):
  """Every decode check of one topology in ONE test, so that one xdist worker compiles its programs
  (its fp32 `decode` reference and per-frame programs serve every check; the file stays < 60 s)."""
  cfg = V.VAE_PRESETS[preset]
  z = jax.random.normal(jax.random.key(1), (1, cfg.z_dim, FRAMES, HL, WL))
  vae = V.init_vae(cfg, jax.random.key(0))
  reference = np.asarray(V.decode(vae, z, video_layout="BFHWC"))  # [1, 9, 6 s, 5 s, 3]
  video = _check_fp32_and_the_cache_between_chunks(vae, z, reference)
  _check_the_cache_between_frames(vae, z, reference, video, monkeypatch)
  if cfg.is_residual:  # tiny-ti2v's layers are a superset of tiny's but for Wan 2.1's upsampler (~10 s)
    video = V.decode_streamed(vae, z, frames_at_once=True)  # the whole-input programs, kept to compare
    assert_close_scaled(video, reference, rel=TOL_F32, name="streamed (whole inputs) vs decode, fp32")
  _check_bf16(cfg, z, reference)


def _check_fp32_and_the_cache_between_chunks(vae, z, reference):
  video = V.decode_streamed(vae, z)  # frame by frame
  s = vae.config.spatial_factor
  assert isinstance(video, np.ndarray) and video.shape == reference.shape == (1, 9, s * HL, s * WL, 3)
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
  return video


def _check_the_cache_between_frames(vae, z, reference, video, monkeypatch):
  # Positive control for the per-frame cache roll: every frame after a step's first gets the cache
  # the chunk brought (as if the roll were dropped): chunk 2's frames 2-4 move far beyond TOL_F32
  # (measured max 0.80 / 1.69 for tiny / tiny-ti2v), while the frames before the first roll (0, and
  # 1: chunk 2's first) stay as they are.
  run, stale = streamed._run_call, {}

  def without_carry(programs, call):
    if call.program.startswith("layer"):
      layer = call.label.split(" frame ")[0]
      if call.frame == 0:
        stale[layer] = jax.tree.map(jnp.copy, call.arrays[2])  # copied before the call donates it
      else:
        call = call._replace(arrays=(*call.arrays[:2], jax.tree.map(jnp.copy, stale[layer])))
    return run(programs, call)

  with monkeypatch.context() as m:
    m.setattr(streamed, "_run_call", without_carry)
    broken = V.decode_streamed(vae, z)
  np.testing.assert_array_equal(broken[:, :2], video[:, :2])
  assert np.abs(broken[:, 2:5] - reference[:, 2:5]).max() > 1e-2


def _check_bf16(cfg, z, reference):
  # bf16: the streamed decode rounds every program's output to bf16, while XLA may keep a fused
  # whole-chunk program's intermediates in fp32 (xla_allow_excess_precision), so the two bf16 decodes
  # differ by bf16 rounding noise (measured max 0.17 on a video of scale 1), not bit for bit. The
  # property: its distance from the fp32 decode is that of a few bf16 roundings, as `decode`'s own
  # bf16 one is (RMS, frame by frame measured 0.0062 / 0.0066 for tiny / tiny-ti2v; `decode` in bf16: 0.0067 /
  # 0.0065), bound 4 eps_bf16 = 0.031 (~4.7x margin). Coarse: a wrong cache moves the later frames by
  # RMS 0.02 (tiny) to 0.3 (tiny-ti2v), so the fp32 checks are the ones that check the cache.
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
  # The real Wan 2.1 VAE at 30 x 52 latents (240 x 416), abstract: nothing is allocated; ~20 s of
  # compiles. Measured on XLA:CPU: streamed frame by frame 1.97 GB (weights 0.51, cache 0.96, the
  # last up block's resnet on one frame beside its other frames 0.50) vs `decode`'s later-chunk
  # program 2.66 GB.
  cfg = V.VAE_PRESETS["wan2.1"]
  parts = V.streamed_memory(cfg, 1, 30, 52)
  whole = V.decode_memory(cfg, 1, 30, 52)
  assert V.streamed_decode_memory(cfg, 1, 30, 52) == parts.total < whole
  assert parts.weights == sum(np.prod(s) for s in cfg.param_shapes().values()) * 4
  _, cache = jax.eval_shape(lambda v, z: V.decode_chunk(v, None, z), V.abstract_vae(cfg),
                            jax.ShapeDtypeStruct((1, 1, 30, 52, cfg.z_dim), jnp.float32))
  assert parts.cache == streamed.tree_bytes(cache)
  assert 0 < parts.largest_call < whole - parts.weights - parts.cache, parts
  # Frame by frame (the default) vs whole inputs: measured 1.97 vs 2.40 GB (no program holds 4
  # full-resolution frames; the held frame lists count).
  at_once = V.streamed_memory(cfg, 1, 30, 52, frames_at_once=True)
  assert (at_once.weights, at_once.cache) == (parts.weights, parts.cache)
  assert parts.total < at_once.total < whole, (parts, at_once)
