"""Latents to video frames with the Wan VAE, on one device or split along height over a mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from pipelines.pipeline.placement import PlacedWeights
from pipelines.wan import vae as wan_vae


@jax.jit
def _to_unit_range(video: jax.Array) -> jax.Array:
  """[-1, 1] -> [0, 1] as diffusers' `VaeImageProcessor.denormalize`, in the video dtype, then fp32."""
  return jnp.clip(video * 0.5 + 0.5, 0, 1).astype(jnp.float32)


def decode_videos(weights: PlacedWeights, latents: np.ndarray, mesh: Mesh | None = None, *,
                  compile_effort: float | None = None) -> np.ndarray:
  """Diffusion latents float32 [B, C, F, Hl, Wl] -> float32 numpy [B, frames, H, W, 3] in [0, 1].

  One video at a time (the VAE treats videos independently): the decoder compiles once per spatial
  size whatever B, and only one video's activations are live. With a `mesh`, each video is decoded
  split along height over the mesh's devices (`vae.decode_parallel`; in a multi-process run, this
  process's devices), each time chunk copied to the host as it is done. `compile_effort`: XLA's
  optimization effort for the decoder's programs (None: the platform's, `vae.decode_compile_effort`).
  """
  vae = weights.vae
  videos = []
  height = latents.shape[3] * vae.config.spatial_factor
  if mesh is not None and wan_vae.row_mesh(mesh).size == 1:
    mesh = None  # one device either way: the unsplit programs
  for one in np.asarray(latents)[:, None]:
    z = wan_vae.denormalize_latents(vae.config, jnp.asarray(one).astype(vae.dtype))
    if mesh is None:
      videos.append(np.asarray(_to_unit_range(wan_vae.decode(vae, z, video_layout="BFHWC",
                                                             compile_effort=compile_effort))))
      continue
    chunks = [np.asarray(_to_unit_range(c))[:, :, :height]
              for c in wan_vae.decode_parallel_chunks(weights.vae_on(mesh), z, mesh, compile_effort=compile_effort)]
    videos.append(np.concatenate(chunks, axis=1))
  return np.concatenate(videos)
