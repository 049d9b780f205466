"""Banded decode and encode (`pipelines/wan/vae/bands.py`) equal the whole-frame ones to fp32 rounding.

Latents of Hl = 40 rows and 3 frames (so the causal caches carry between chunks): with the tiny
presets' radii (11 decoder rows, 7 encoder rows), bands of 3 rows run in windows of 25 (decoder)
and 17 (encoder) rows, 6 and 9 of them, the inner ones cut on both sides; bands of 7 rows do not
divide 40 either. Wl = 3 keeps every program small; the positive controls run with a margin of 1
row on the same windows (band_rows 2r + 1), so they compile nothing new.
"""

import jax
import numpy as np
import pytest

from pipelines.wan import vae as V
from pipelines.wan.vae import bands
from pipelines.wan.vae.topology import AttnBlock, ResBlock
from tests.numerics import FP32_VIDEO_PSNR_DB, assert_close_scaled, assert_psnr_at_least

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2

HL, WL, FRAMES = 40, 3, 3
# fp32, in units of the output's scale (video in [-1, 1]: 1; encoder mean / logvar: their max). The
# banded and whole-frame programs compute the same products from the same values; only XLA's
# blocking of the sums differs with the shapes. Bound as tests/pipelines/wan/vae/test_model.py's:
# ~30 convs in series, each a sum of up to 27 * C <= 864 products, rounding errors growing like
# sqrt(864) = 29 eps each: 30 * 29 eps = 1e-4 (PSNR >= 86 dB of the range). Measured <= 1.4e-6.
TOL = 1e-4


@pytest.fixture(scope="module", params=["tiny", "tiny-ti2v"])
def decoded(request):
  """(vae, latents [1, C, 3, 40, 3], `decode`'s video [1, 9, 40 s, 3 s, 3]) for one topology."""
  cfg = V.VAE_PRESETS[request.param]
  vae = V.init_vae(cfg, jax.random.key(0))
  z = jax.random.normal(jax.random.key(1), (1, cfg.z_dim, FRAMES, HL, WL))
  return vae, z, np.asarray(V.decode(vae, z, video_layout="BFHWC"))


def test_radius_hand_count():
  # The tiny decoder's tail (num_res_blocks 1: 2 resnets per up block), spoiled rows at each level:
  # mid resnet 2; up 0: +4 = 6, upsample 2 * 6 + 1 = 13; up 1: 17 -> 35; up 2: 39 -> 79; up 3: 83;
  # conv_out 84 rows at 8 per latent row: 10.5 -> 11.
  assert bands.edge_rows(bands.decoder_split(V.VAE_PRESETS["tiny"])[1]) == (84, 8)
  assert V.tail_radius(V.VAE_PRESETS["tiny"]) == 11
  # tiny-ti2v: the same count through DupUp3D (2e <= 2e + 1), then unpatchify: 168 of 16 per row.
  assert V.tail_radius(V.VAE_PRESETS["tiny-ti2v"]) == 11
  # Wan 2.1 / 2.2 (3 resnets per up block): 2, 8 -> 17, 23 -> 47, 53 -> 107, 113, 114 of 8: 15.
  assert V.tail_radius(V.VAE_PRESETS["wan2.1"]) == V.tail_radius(V.VAE_PRESETS["wan2.2"]) == 15
  # The tiny encoder's head: conv_in 1, resnet 3, down 3 // 2 + 1 = 2, 4 -> 3, 5 -> 3, 5, mid 7.
  assert V.encoder_radius(V.VAE_PRESETS["tiny"]) == 7
  assert V.encoder_radius(V.VAE_PRESETS["wan2.1"]) == V.encoder_radius(V.VAE_PRESETS["wan2.2"]) == 11


@pytest.mark.parametrize("preset", ["tiny", "tiny-ti2v", "wan2.1", "wan2.2"])
def test_splits_cut_at_the_mid_attention(preset):
  cfg = V.VAE_PRESETS[preset]
  head, tail = V.decoder_split(cfg)
  assert head[0].name == "post_quant_conv" and head[-1] == AttnBlock("decoder.mid_block.attentions.0", head[-1].dim)
  assert isinstance(tail[0], ResBlock) and tail[0].name == "decoder.mid_block.resnets.1"
  assert (*head, *tail) == cfg.decode_layers()
  head, tail = V.encoder_split(cfg)
  assert tail[0].name == "encoder.mid_block.attentions.0" and tail[-1].name == "quant_conv"


@pytest.mark.parametrize("height", [1, 7, 24, 40])
@pytest.mark.parametrize("band_rows", [1, 3, 7, 50])
@pytest.mark.parametrize("margin", [0, 1, 11])
def test_band_plan_keeps_every_row_once_away_from_cuts(height, band_rows, margin):
  plan = V.band_plan(height, band_rows, margin)
  kept = [row for b in plan for row in range(b.keep_start, b.keep_stop)]
  assert kept == list(range(height))
  assert {b.stop - b.start for b in plan} == {min(band_rows + 2 * margin, height)}
  for b in plan:
    assert 0 <= b.start <= b.keep_start < b.keep_stop <= b.stop <= height
    assert b.start == 0 or b.keep_start - b.start >= margin
    assert b.stop == height or b.stop - b.keep_stop >= margin


def test_band_plan_rejects_empty_bands():
  with pytest.raises(ValueError, match="band_rows=0"):
    V.band_plan(40, 0, 11)


@pytest.mark.parametrize("decoded, band_rows", [("tiny", 3), ("tiny", 7), ("tiny-ti2v", 3)],
                         indirect=["decoded"])
def test_decode_banded_equals_decode(decoded, band_rows):
  vae, z, want = decoded
  assert len(V.band_plan(HL, band_rows, V.tail_radius(vae.config))) >= 3
  got = V.decode_banded(vae, z, band_rows=band_rows)
  assert isinstance(got, np.ndarray) and got.shape == want.shape == (1, 9, HL * vae.config.spatial_factor,
                                                                      WL * vae.config.spatial_factor, 3)
  assert_close_scaled(got, want, rel=TOL, scale=1.0, name=f"banded decode, {band_rows} rows")
  assert_psnr_at_least((got + 1) / 2, (want + 1) / 2, FP32_VIDEO_PSNR_DB, name="banded decode PSNR")
  if band_rows == 7:  # one more band height, compiled for one topology only (the test's time)
    diffusers_layout = V.decode_banded(vae, z, band_rows=band_rows, video_layout="BCFHW")
    np.testing.assert_array_equal(diffusers_layout, got.transpose(0, 4, 1, 2, 3))  # the same programs


def test_decode_banded_with_a_short_margin_differs(decoded):
  # Positive control: a margin of 1 row lets the cut's zero padding into the kept rows. (At r - 1
  # the difference is below fp32 rounding: only the one path along every kernel's edge reaches that
  # far, and its weights' product vanishes; the radius is the worst case.)
  vae, z, want = decoded
  r = V.tail_radius(vae.config)
  got = V.decode_banded(vae, z, band_rows=1 + 2 * r, margin=1)  # windows of 3 + 2r rows, as band_rows=3
  assert np.max(np.abs(got - want)) > 100 * TOL


@pytest.mark.parametrize("preset", ["tiny", "tiny-ti2v"])
def test_encode_banded_equals_encode(preset):
  cfg = V.VAE_PRESETS[preset]
  vae = V.init_vae(cfg, jax.random.key(0))
  s = cfg.spatial_factor
  x = jax.random.uniform(jax.random.key(2), (1, 3, 9, HL * s, WL * s), minval=-1.0, maxval=1.0)
  want = V.encode(vae, x)
  got = V.encode_banded(vae, x, band_rows=3)
  assert got.mean.shape == want.mean.shape == (1, cfg.z_dim, FRAMES, HL, WL)
  for name in ("mean", "logvar"):
    assert_close_scaled(getattr(got, name), getattr(want, name), rel=TOL, name=f"banded encode: {name}")
  # Positive control, as for the decoder (windows of 3 + 2r rows again).
  short = V.encode_banded(vae, x, band_rows=1 + 2 * V.encoder_radius(cfg), margin=1)
  assert np.max(np.abs(np.asarray(short.mean) - np.asarray(want.mean))) > 100 * TOL * np.max(np.abs(want.mean))
