"""The VAE's architecture as data: `decode_flops` against the matmuls XLA compiles for the decode."""

import jax
import pytest

from end_to_end.aot import hlo_ops
from pipelines.wan import vae as wan_vae


def _compiled_matmul_flops(lowered) -> float:
  module = hlo_ops.parse_module(lowered.compile().as_text())
  return sum(hlo_ops.instruction_flops(op, module.symbols(name)) for name, ops in module.computations.items()
             for op in ops)


@pytest.mark.parametrize("preset", ["tiny", "tiny-ti2v"])  # Wan 2.1's layout; Wan 2.2's residual groups
def test_decode_flops_against_the_compiled_decode(preset):
  """The chunk programs' convolutions and dots as XLA:CPU compiles them (`hlo_ops` counts only the
  kernel taps that meet real input), the first chunk once and the later one per further latent
  frame. The model counts every tap of the zero-padded borders too: a 3 x 3 window over an r x r
  grid meets ((3 r - 2) / (3 r))^2 of its taps' real pixels, least at the latents' r, so
  model x that <= compiled <= model."""
  config = wan_vae.VAE_PRESETS[preset]
  F, H, W = 3, 24, 24
  vae = wan_vae.init_vae(config, jax.random.key(0))
  programs = wan_vae.lower_decode_programs(vae, batch=1, latent_height=H, latent_width=W, devices=None, split=False)
  compiled = _compiled_matmul_flops(programs["first"]) + (F - 1) * _compiled_matmul_flops(programs["later"])
  model = wan_vae.decode_flops(config.decode_layers(), F, H, W)
  border = ((3 * H - 2) / (3 * H)) ** 2
  assert model * border <= compiled <= model, (compiled / model, border)
  one_less = wan_vae.decode_flops(config.decode_layers()[:-1], F, H, W)
  assert not one_less * border <= compiled <= one_less  # positive control: the output conv counts


def test_decode_flops_at_real_sizes_and_refuses_an_encoder():
  wan21 = wan_vae.VAE_PRESETS["wan2.1"]
  flops = wan_vae.decode_flops(wan21.decode_layers(), 21, 60, 104)
  assert 2.5e14 < flops < 3.0e14  # 480 x 832 x 81: ~275 TFLOP (1.4 s at a v5e's 197 TFLOP/s)
  with pytest.raises(ValueError, match="counts a decoder"):
    wan_vae.decode_flops(wan21.encoder_layers(), 21, 60, 104)
