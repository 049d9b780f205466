"""The Wan 2.2 (TI2V-5B) VAE: residual blocks, AvgDown3D / DupUp3D shortcuts, 2x2 patches, 16x.

Parity with diffusers' `AutoencoderKLWan(is_residual=True, patch_size=2)` on a tiny random config
saved with save_pretrained and loaded by `load_vae` (fp32): encode, decode, and the height-split
decode on a mesh whose device count does not divide the latent height.
"""

import dataclasses

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.numerics import assert_close_scaled
from pipelines.wan import vae as V

pytestmark = pytest.mark.numerics

# The tiny Wan 2.2 topology (VAE_PRESETS["tiny-ti2v"]) as diffusers' keyword arguments.
TINY_TI2V = {k: list(v) if isinstance(v, tuple) else v
             for k, v in dataclasses.asdict(V.VAE_PRESETS["tiny-ti2v"]).items()}
# As tests/pipelines/wan/vae/test_model.py: ~30 layers in series of fp32 convs, 1e-4 of the output's scale (measured 1.8e-6
# for the decode and 3e-7 for the encode).
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  torch.manual_seed(0)
  ref = diffusers.AutoencoderKLWan(**TINY_TI2V).eval()
  with torch.no_grad():
    for name, p in ref.named_parameters():
      if name.endswith("gamma"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
  folder = str(tmp_path_factory.mktemp("vae_ti2v"))
  ref.save_pretrained(folder, safe_serialization=True)
  return ref, V.load_vae(folder)


def test_parallel_decode_parity(models):
  # The one-device decode is compared with diffusers through the whole pipeline
  # (tests/pipelines/wan/conditioning/test_ti2v.py); here the height split, whose bands carry the shortcuts and patches.
  ref, vae = models
  assert (vae.config.spatial_factor, vae.config.video_channels) == (16, 3)
  z = torch.randn(1, 8, 2, 3, 2, generator=torch.Generator().manual_seed(0))  # Hl = 3: padded over 2
  with torch.no_grad():
    want = ref.decode(z).sample.numpy()
  assert want.shape == (1, 3, 5, 48, 32)
  assert np.mean(np.abs(want) < 1.0) > 0.5, "reference mostly clamped: the comparison would be weak"
  parallel = np.asarray(V.decode_parallel(vae, z.numpy(), jax.make_mesh((2,), ("ring",))))
  assert_close_scaled(parallel, want, rel=TOL, scale=1.0, name="TI2V decode split over 2 devices")


def test_encode_parity(models):
  ref, vae = models
  x = torch.rand(1, 3, 5, 48, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
  with torch.no_grad():
    want = ref.encode(x).latent_dist
  got = V.encode(vae, jnp.asarray(x.numpy()))
  assert got.mean.shape == tuple(want.mean.shape) == (1, 8, 2, 3, 2)
  for name in ("mean", "logvar"):
    ref_value = getattr(want, name).numpy()
    assert_close_scaled(getattr(got, name), ref_value, rel=TOL, scale=np.abs(ref_value).max(),
                        name=f"TI2V encode: {name}")
  with pytest.raises(ValueError, match="height=40 and width=32 must be positive multiples of 16"):
    V.encode(vae, jnp.zeros((1, 3, 1, 40, 32)))


def test_released_wan22_config_shapes():
  cfg = V.VAE_PRESETS["wan2.2"]
  raw = {"_class_name": "AutoencoderKLWan", "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48,
         "is_residual": True, "in_channels": 12, "out_channels": 12, "patch_size": 2,
         "scale_factor_temporal": 4, "scale_factor_spatial": 16, "clip_output": False,
         "latents_mean": list(V.WAN22_LATENTS_MEAN), "latents_std": list(V.WAN22_LATENTS_STD)}
  assert V.WanVAEConfig.from_diffusers(raw) == cfg
  assert (cfg.spatial_factor, cfg.temporal_factor) == (16, 4)
  with torch.device("meta"):
    ref = diffusers.AutoencoderKLWan(**{k: v for k, v in raw.items() if k != "clip_output" and k[0] != "_"})
  assert cfg.param_shapes() == {k: tuple(v.shape) for k, v in ref.state_dict().items()}
  with pytest.raises(ValueError, match="in_channels=3 must be a multiple of patch_size"):
    V.WanVAEConfig.from_diffusers({**raw, "in_channels": 3})
