"""Spatial-parallel VAE decode (`vae.decode_parallel`): the height split over 2, 4 and 8 devices equals
one-device `decode`, and its compiled chunk program moves only halo rows and the attention's bands.

The reference is our one-device `decode` (itself diffusers-parity-tested in tests/pipelines/wan/vae/test_model.py), with the
same random weights. Compiling dominates the cost, so the cases share shapes: the tiny VAE always
decodes 5 x 4 latents (the 1- and 21-frame videos run the same two programs on 2 devices).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from end_to_end.aot.collectives import hlo_collectives
from tests.numerics import FP32_VIDEO_PSNR_DB, assert_psnr_at_least
from pipelines.wan import vae as V
from pipelines.wan.vae import effort as vae_effort, layers as L, model as vae_model

pytestmark = pytest.mark.numerics

BASE8 = V.WanVAEConfig(base_dim=8)  # the Wan 2.1 topology (dims 8..32, 2 res blocks), tiny widths
# bf16: both decodes round every activation to bf16 (unit roundoff 2^-9 = 2e-3), but in places in
# a different order (the ring attention's partial sums and its normalisation after the value
# product; the convs' band shapes change XLA's blocking). A flipped rounding is ~2e-3 of the value
# and ~30 layers in series add such differences as independent terms, ~sqrt(30) * 2e-3 = 1e-2 of
# the video's range: 40 dB, the acceptance bound (measured 68 dB).
BF16_VIDEO_PSNR_DB = 40.0


@pytest.fixture(scope="module")
def vaes():
  return {"tiny": V.init_vae(V.VAE_PRESETS["tiny"], jax.random.key(0)),
          "base8": V.init_vae(BASE8, jax.random.key(0))}


def _mesh(devices):
  # A 2-D (ring, ulysses)-style mesh where possible: decode_parallel flattens every axis.
  shape = (2, devices // 2) if devices % 2 == 0 else (devices,)
  return jax.make_mesh(shape, ("ring", "ulysses")[-len(shape):])


def _unit(video):
  return (np.asarray(video, np.float64) + 1) / 2


# (config, devices, frames, Hl, Wl). Hl = 5 splits evenly over none of 2, 4, 8 (over 8, three bands
# are all padding); the base8 case (the real layer sequence) splits Hl = 4 evenly. All tiny cases
# share one shape, so each program is compiled once per device count.
CASES = [
    ("tiny", 2, 21, 5, 4),
    ("tiny", 2, 1, 5, 4),
    ("tiny", 4, 1, 5, 4),  # its later-chunk program is compiled by the collectives test
    ("tiny", 8, 2, 5, 4),
    ("base8", 2, 2, 4, 4),
]


@pytest.mark.parametrize("name,devices,frames,hl,wl", CASES)
def test_parallel_decode_equals_one_device(vaes, name, devices, frames, hl, wl):
  vae = vaes[name]
  z = jax.random.normal(jax.random.key(frames * 100 + hl), (1, 16, frames, hl, wl))
  want = V.decode(vae, z)
  got = V.decode_parallel(vae, z, _mesh(devices))
  assert got.shape == want.shape == (1, 3, 1 + 4 * (frames - 1), 8 * hl, 8 * wl)
  assert float(jnp.std(want)) > 1e-2, "reference (nearly) constant: the comparison would be weak"
  # fp32: two runs that differ only in summation order (the attention's ring, conv blocking):
  # FP32_VIDEO_PSNR_DB (80 dB, above the 60 dB acceptance); measured 133-156 dB.
  assert_psnr_at_least(_unit(got), _unit(want), FP32_VIDEO_PSNR_DB,
                       name=f"{name} {devices} devices {frames} frames {hl}x{wl}")


def test_parallel_decode_bf16(vaes):
  # One latent frame (the first-chunk programs only: XLA:CPU compiles bf16 convs slowly), 4 devices.
  vae = jax.tree.map(lambda p: p.astype(jnp.bfloat16), vaes["tiny"])
  z = jax.random.normal(jax.random.key(7), (1, 16, 1, 5, 4))
  want = V.decode(vae, z)
  got = V.decode_parallel(vae, z, _mesh(4))
  assert got.dtype == want.dtype == jnp.bfloat16
  assert_psnr_at_least(_unit(got.astype(jnp.float32)), _unit(want.astype(jnp.float32)), BF16_VIDEO_PSNR_DB,
                       name="bf16 tiny 4 devices")


def test_layouts_and_errors(vaes):
  vae = vaes["tiny"]
  z = jax.random.normal(jax.random.key(1), (1, 16, 1, 5, 4))  # the tiny cases' (compiled) shapes
  mesh = _mesh(2)
  bcfhw = V.decode_parallel(vae, z, mesh)
  np.testing.assert_array_equal(np.asarray(V.decode_parallel(vae, z, mesh, video_layout="BFHWC")),
                                np.asarray(bcfhw).transpose(0, 2, 3, 4, 1))  # the same programs
  with pytest.raises(ValueError, match="video_layout"):
    V.decode_parallel(vae, z, mesh, video_layout="BHWC")
  with pytest.raises(ValueError, match="C=4 channels"):
    V.decode_parallel(vae, jnp.zeros((1, 4, 2, 2, 3)), mesh)
  with pytest.raises(ValueError, match="jax.sharding.Mesh"):
    V.decode_parallel(vae, z, "U=2")


def _expected_permutes(config, devices, band, B, Wl, itemsize):
  """(count, bytes) of the later-chunk program's collective-permutes, from the layer sequence: two
  one-row halos per 3x3 conv (at the conv's input frames, width and channels), and D - 1 steps of
  the band's packed keys and values per attention block."""
  T, W, count, nbytes = 1, Wl, 0, 0

  def halo(channels):
    nonlocal count, nbytes
    count, nbytes = count + 2, nbytes + 2 * B * T * W * channels * itemsize

  for layer in config.decoder_layers():
    match layer:
      case L.CausalConv(_, in_dim, _, 3):
        halo(in_dim)
      case L.ResBlock(_, in_dim, out_dim):
        halo(in_dim)
        halo(out_dim)
      case L.AttnBlock(_, dim):
        count += devices - 1
        nbytes += (devices - 1) * 2 * B * T * band * W * dim * itemsize
      case L.Resample(_, mode, dim, _):
        T *= 2 if mode == "upsample3d" else 1
        halo(dim)
        W *= 2
  return count, nbytes


def test_collectives_are_halos_and_attention_ring(vaes):
  # The tiny VAE's later-chunk program on 4 devices, Hl = 5 (padded): every layer kind.
  name, devices, hl, wl = "tiny", 4, 5, 4
  vae = vaes[name]
  rmesh = V.row_mesh(_mesh(devices))
  rows = V.row_split(devices, hl)
  z = jax.ShapeDtypeStruct((1, 1, devices * rows.band, wl, 16), jnp.float32)
  programs = vae_model._chunk_programs(vae_effort.decode_compile_effort("cpu"))
  _, cache = programs.first_rows.eval_shape(vae, z, mesh=rmesh, rows=rows)
  hlo = programs.later_rows.lower(vae, cache, z, mesh=rmesh, rows=rows).compile().as_text()
  table = hlo_collectives(hlo)
  count, nbytes = _expected_permutes(vae.config, devices, rows.band, 1, wl, 4)
  assert table["collective-permute"] == {"count": count, "bytes": nbytes}, table
  for op in ("all-gather", "all-reduce", "all-to-all"):
    assert table[op]["count"] == 0, (op, table)
