"""Latents to video frames with the Wan VAE, on one device or split along height over a mesh, and
the decoder's programs lowered as that decode calls them (to compile them ahead)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from pipelines.pipeline.load.placement import PlacedWeights
from pipelines.pipeline.run.precision import matmul_precision
from pipelines.wan import vae as wan_vae


@jax.jit
def to_unit_range(video: jax.Array) -> jax.Array:
  """[-1, 1] -> [0, 1] as diffusers' `VaeImageProcessor.denormalize`, in the video dtype, then fp32."""
  return jnp.clip(video * 0.5 + 0.5, 0, 1).astype(jnp.float32)


def vae_latents(config: wan_vae.WanVAEConfig, latents: Any, dtype: Any) -> np.ndarray:
  """Diffusion latents [B, C, F, Hl, Wl] -> the VAE's, on the host in the VAE's `dtype`: WanPipeline's
  `latents.to(vae.dtype) / latents_std + latents_mean` with its statistics (`vae.latent_stats`), each
  operation rounded once as torch's CPU kernels round it (numpy's IEEE division; XLA:CPU's vectorised
  one is off by 1 ulp for ~15 % of the elements, and by more when fused), and no compiled program
  (`vae.denormalize_latents` eagerly is five, each traced and looked up by every process)."""
  mean, inv_std = wan_vae.latent_stats(config, dtype)
  return np.asarray(latents).astype(dtype) / inv_std + mean


def _unit_range_host(video: np.ndarray) -> np.ndarray:
  """`to_unit_range` of a host video, the same operations in its dtype (float32 on return)."""
  half = np.asarray(0.5, video.dtype)
  return np.clip(video * half + half, 0, 1).astype(np.float32)


def decode_videos(weights: PlacedWeights, latents: np.ndarray, mesh: Mesh | None = None, *,
                  compile_effort: float | None = None, band_rows: int | None = None,
                  streamed: bool = False) -> np.ndarray:
  """Diffusion latents float32 [B, C, F, Hl, Wl] -> float32 numpy [B, frames, H, W, 3] in [0, 1].

  One video at a time (the VAE treats videos independently): the decoder compiles once per spatial
  size whatever B, and only one video's activations are live. With a `mesh`, each video is decoded
  split along height over the mesh's devices (`vae.decode_parallel`; in a multi-process run, this
  process's devices), each time chunk copied to the host as it is done. `compile_effort`: XLA's
  optimization effort for the decoder's programs (None: the platform's, `vae.decode_compile_effort`).
  `band_rows`: on one device, decode in bands of that many latent rows (`vae.decode_banded`: the
  same video to fp32 rounding, in bounded memory; a memory plan's `decode_band_rows`); `streamed`:
  on one device, one program per decoder layer (`vae.decode_streamed`: the same video, less memory).
  Runs under the VAE dtype's matmul precision (`precision.matmul_precision`: "highest" for fp32).
  """
  with matmul_precision(weights.vae.dtype):  # as `lower_decoder`, so its compiled programs serve this
    return _decode_videos(weights, latents, _split_mesh(mesh), compile_effort, band_rows, streamed)


def _decode_videos(weights: PlacedWeights, latents: np.ndarray, mesh: Mesh | None,
                   compile_effort: float | None, band_rows: int | None, streamed: bool) -> np.ndarray:
  """`decode_videos` on its split mesh (None: one device), in the caller's matmul precision."""
  vae = weights.vae
  videos = []
  height = latents.shape[3] * vae.config.spatial_factor
  for one in np.asarray(latents)[:, None]:
    z = vae_latents(vae.config, one, vae.dtype)
    if mesh is None and band_rows is not None:
      videos.append(_unit_range_host(wan_vae.decode_banded(vae, z, band_rows=band_rows, video_layout="BFHWC",
                                                           compile_effort=compile_effort)))
      continue
    if mesh is None and streamed:
      videos.append(_unit_range_host(wan_vae.decode_streamed(vae, z, video_layout="BFHWC",
                                                             compile_effort=compile_effort)))
      continue
    if mesh is None:
      videos.append(np.asarray(to_unit_range(wan_vae.decode(vae, z, video_layout="BFHWC",
                                                             compile_effort=compile_effort))))
      continue
    chunks = [np.asarray(to_unit_range(c))[:, :, :height]
              for c in wan_vae.decode_parallel_chunks(weights.vae_on(mesh), z, mesh, compile_effort=compile_effort)]
    videos.append(np.concatenate(chunks, axis=1))
  return np.concatenate(videos)


def _split_mesh(mesh: Mesh | None) -> Mesh | None:
  """The mesh a decode splits over, None for one device (a mesh of one decoding device included)."""
  return None if mesh is None or wan_vae.row_mesh(mesh).size == 1 else mesh


def lower_decoder(weights: PlacedWeights, latents_shape: tuple[int, ...], mesh: Mesh | None = None, *,
                  compile_effort: float | None = None) -> dict[str, Any]:
  """The VAE programs `decode_videos(weights, latents, mesh, compile_effort=...)` runs for latents of
  `latents_shape` [B, C, F, Hl, Wl], lowered for the arguments as it places them (`vae.
  lower_decode_programs`), so that compiling them compiles what that decode calls: JAX's in-memory
  executable cache serves the decode (both lowered under the VAE dtype's matmul precision). Nothing
  is placed or run. Raises ValueError for a bad effort."""
  _, _, _, latent_height, latent_width = latents_shape
  mesh = _split_mesh(mesh)
  devices = None if mesh is None else list(wan_vae.row_mesh(mesh).devices.flat)
  with matmul_precision(weights.vae.dtype):
    return wan_vae.lower_decode_programs(weights.vae, batch=1, latent_height=latent_height,
                                         latent_width=latent_width, devices=devices, split=mesh is not None,
                                         compile_effort=compile_effort)



def decode_work_bytes(weights: PlacedWeights, latents_shape: tuple[int, ...], mesh: Mesh | None,
                      decoder: dict[str, Any] | None = None) -> int | None:
  """Device bytes of one video's whole-frame decode beyond the VAE's weights (its feature cache, one
  chunk's temporaries and output, from the compiled programs' memory analysis), for latents of
  `latents_shape` [B, C, F, Hl, Wl]; None for a decode split over a mesh (not planned).

  `decoder`: the programs `lower_decoder` lowered for this decode, on the device planned for: their
  analysis (`vae.program_peak`), so that one lowering and one compile serve the plan and the decode
  (the compile-ahead then finds them compiled). None: `vae.decode_memory`'s own lowering."""
  if _split_mesh(mesh) is not None:
    return None
  if decoder is not None:
    return max(wan_vae.program_peak(program) for program in decoder.values()) - weights.bytes_of()["vae"]
  _, _, _, latent_height, latent_width = latents_shape
  return wan_vae.decode_memory(weights.vae, 1, latent_height, latent_width) - weights.bytes_of()["vae"]


def streamed_work_bytes(weights: PlacedWeights, latents_shape: tuple[int, ...]) -> int:
  """`decode_work_bytes` of the layer-streamed decode (`vae.streamed_decode_memory`) on one device."""
  _, _, _, latent_height, latent_width = latents_shape
  return wan_vae.streamed_decode_memory(weights.vae, 1, latent_height, latent_width) - weights.bytes_of()["vae"]


def band_rows_for(weights: PlacedWeights, latents_shape: tuple[int, ...], work: int | None = None):
  """A function (bytes available to the decode beyond the VAE's weights) -> None when whole frames
  fit, else the latent rows of the bands that do (`vae.choose_band_rows`); it raises ValueError when
  no band fits. `work`: the whole-frame decode's `decode_work_bytes` where known (not analysed again)."""
  _, _, _, latent_height, latent_width = latents_shape
  vae_bytes = weights.bytes_of()["vae"]
  vae = weights.vae
  whole = None if work is None else work + vae_bytes
  return lambda available: wan_vae.choose_band_rows(vae.config, 1, latent_height, latent_width,
                                                    available + vae_bytes, dtype=vae.dtype, whole=whole)

