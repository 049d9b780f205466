"""Latents to the VAE's input (`pipelines/pipeline/run/decoding.py`'s `vae_latents`): WanPipeline's
`latents.to(vae.dtype) / latents_std + latents_mean` (its `latents_std` is `1.0 / std` taken after the
cast to the latents' dtype) as torch computes it, bit for bit, in fp32 and bf16."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.pipeline.run.decoding import vae_latents
from pipelines.wan import vae as wan_vae


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vae_latents_round_as_diffusers(dtype):
  torch = pytest.importorskip("torch")
  import jax.numpy as jnp

  config = wan_vae.VAE_PRESETS["wan2.1"]
  latents = np.random.default_rng(0).standard_normal((1, config.z_dim, 6, 40, 25)).astype(np.float32) * 3
  ours = vae_latents(config, latents, jnp.dtype(dtype))
  assert ours.dtype == jnp.dtype(dtype) and ours.shape == latents.shape
  t = torch.from_numpy(latents).to(getattr(torch, dtype))  # diffusers' WanPipeline, its decode
  mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(t.device, t.dtype)
  inv_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(t.device, t.dtype)  # as written
  reference = (t / inv_std + mean).float().numpy()
  np.testing.assert_array_equal(ours.astype(np.float32), reference)
  assert not np.array_equal(ours.astype(np.float32), latents.astype(jnp.dtype(dtype)).astype(np.float32))  # it moved


def test_the_statistics_are_formed_as_diffusers_forms_them():
  """`vae.latent_stats` against WanPipeline's own expression in bf16 (the reciprocal after the cast),
  for every VAE preset; positive control: the reciprocal taken in fp32 before the cast, as this
  module did before, differs in some of Wan 2.1's channels, so the comparison can fail."""
  torch = pytest.importorskip("torch")
  import jax.numpy as jnp

  for name, config in wan_vae.VAE_PRESETS.items():
    for dtype in ("float32", "bfloat16"):
      mean, inv_std = wan_vae.latent_stats(config, jnp.dtype(dtype))
      t_dtype = getattr(torch, dtype)
      want_mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(t_dtype)
      want_inv = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(t_dtype)
      assert mean.dtype == inv_std.dtype == jnp.dtype(dtype) and mean.shape == (1, config.z_dim, 1, 1, 1)
      np.testing.assert_array_equal(mean.astype(np.float32), want_mean.float().numpy(), err_msg=name)
      np.testing.assert_array_equal(inv_std.astype(np.float32), want_inv.float().numpy(), err_msg=f"{name} {dtype}")
  config = wan_vae.VAE_PRESETS["wan2.1"]
  before = (1.0 / torch.tensor(config.latents_std)).to(torch.bfloat16).float().numpy()
  assert (before != wan_vae.latent_stats(config, jnp.bfloat16)[1].astype(np.float32).ravel()).sum() == 6
