"""Latents to the VAE's input (`pipelines/pipeline/run/decoding.py`'s `vae_latents`): WanPipeline's
`latents.to(vae.dtype) / (1 / std) + mean` as torch computes it, bit for bit, in fp32 and bf16."""

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
  inv_std = (1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1)).to(t.device, t.dtype)
  reference = (t / inv_std + mean).float().numpy()
  np.testing.assert_array_equal(ours.astype(np.float32), reference)
  assert not np.array_equal(ours.astype(np.float32), latents.astype(jnp.dtype(dtype)).astype(np.float32))  # it moved
