"""Wan causal video VAE in JAX: config, loader, random init, chunked decode (the encode: `encoding`).

Numerical reference: diffusers `AutoencoderKLWan`: the Wan 2.1 VAE (`is_residual=False`, used by
Wan 2.1 and Wan 2.2 A14B) and the Wan 2.2 VAE of TI2V-5B (`is_residual=True`, z_dim 48, 2x2
patches: 16x spatial); the layers live in `layers.py` (the Wan 2.2 shortcuts and patching in
`residual.py`), the config and presets in `config.py` (the `vae` package names them all). Public layouts
follow diffusers: latents `[B, C, F, Hl, Wl]`, video `[B, 3, frames, height, width]` in [-1, 1],
with frames = 1 + 4(F - 1) and height, width = sHl, sWl (s = `config.spatial_factor`: 8 for Wan
2.1, 16 for Wan 2.2) (`decode(..., video_layout="BFHWC")` returns the pipeline's
`[B, frames, height, width, 3]` directly). Internally everything is channels-last.

Both directions run causally over time, one chunk at a time, exactly as diffusers does: the decoder
takes one latent frame per chunk (the first gives 1 video frame, each later one 4), the encoder takes
the first video frame, then 4 frames per chunk. The per-conv feature cache is a dict pytree carried
from chunk to chunk; the first chunk and the later chunks are two jitted programs, compiled once per
(config, batch, spatial size, dtype) whatever the number of frames.

`decode_parallel` runs the same decoder split along height over every device of a mesh (DESIGN.md
section 8): one-row halo exchanges per spatial conv, the mid-block attention ring-style, padded
heights masked. Encoding runs on one device.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pipelines.storage.weights import CheckpointError, HostLeaf, check_state_dict, read_config, read_safetensors_folder
from pipelines.parallel.distributed import put_host_leaves
from pipelines.wan.vae import layers as L, residual as vae_residual
from pipelines.wan.vae.effort import check_compile_effort
from pipelines.wan.vae.config import WanVAEConfig
from pipelines.wan.vae.topology import to_jax_layout

ENCODER_CHUNK = 4  # video frames per encoder chunk after the first frame (diffusers `_encode`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WanVAE:
  """Config (static) + parameters (diffusers key -> JAX-layout array, see `layers`)."""
  config: WanVAEConfig = dataclasses.field(metadata=dict(static=True))
  params: dict[str, jax.Array]

  @property
  def dtype(self) -> jnp.dtype:
    return self.params["post_quant_conv.weight"].dtype


class LatentDistribution(NamedTuple):
  """diffusers' DiagonalGaussianDistribution parameters, each [B, C, F, Hl, Wl]; logvar in [-30, 20]."""
  mean: jax.Array
  logvar: jax.Array


# ----------------------------------------------------------------------------------------------
# Loading and init


def load_vae(folder: str, *, dtype: jnp.dtype = jnp.float32, progress: bool | None = None) -> WanVAE:
  """Loads a diffusers `vae/` folder (config.json + safetensors, diffusers key names).

  Args:
    folder: the `vae/` folder of a diffusers Wan checkpoint.
    dtype: parameter dtype (fp32 for parity tests, bf16 for inference).
    progress: a progress bar (None: for large VAEs only). The files are memory-mapped and each
      weight is laid out, cast and placed on the default device in one copy.

  Raises:
    CheckpointError: folder/config/safetensors problems (see `pipelines.storage.weights`), an invalid or
      unsupported config, or one error listing every missing, unexpected and mis-shaped key.
  """
  try:
    config = WanVAEConfig.from_diffusers(read_config(folder))
  except CheckpointError:
    raise
  except (ValueError, TypeError) as e:
    raise CheckpointError(f"{folder!r}: unsupported or invalid AutoencoderKLWan config: {e}") from e
  return vae_from_state(config, read_safetensors_folder(folder), folder, dtype=dtype, progress=progress)


def vae_from_state(config: WanVAEConfig, state: Any, where: str, *, dtype: jnp.dtype = jnp.float32,
                   progress: bool | None = None, scales: Mapping[str, np.ndarray] | None = None) -> WanVAE:
  """`load_vae` from tensors named as diffusers names them (a folder's, or a single file's renamed by
  `wan.pretrained.layouts`; a scaled-fp8 weight is q * its `scales`), memory-mapped: checked, laid out, cast, placed.

  Raises:
    CheckpointError: one error listing every missing, unexpected and mis-shaped key.
  """
  check_state_dict(state, config.param_shapes(), where=where)
  scaled = {k: to_jax_layout(k, s) for k, s in (scales or {}).items()}  # laid out as their weights
  leaves = {k: HostLeaf.of(to_jax_layout(k, np.asarray(v)), dtype, scaled.get(k)) for k, v in state.items()}
  params = put_host_leaves(leaves, None, progress=progress, desc="loading the VAE")
  return WanVAE(config, params)


def init_vae(config: WanVAEConfig, key: jax.Array, *, dtype: jnp.dtype = jnp.float32) -> WanVAE:
  """Random weights: PyTorch's default conv init, U(+-1/sqrt(fan_in)) for weights and biases; gammas 1.

  One `jax.random.uniform` call for all parameters, sliced on the host (per-tensor random calls
  would compile one tiny program per distinct shape).
  """
  shapes = sorted(config.param_shapes().items())
  sizes = [int(np.prod(s)) for _, s in shapes]
  u = np.asarray(jax.random.uniform(key, (sum(sizes),), jnp.float32, -1.0, 1.0))
  offsets = np.cumsum([0, *sizes])
  weight_shapes = dict(shapes)
  params = {}
  for (name, shape), start, size in zip(shapes, offsets, sizes):
    if name.endswith(".gamma"):
      value = np.ones(shape, np.float32)
    else:
      fan_in = int(np.prod(weight_shapes[name.rsplit(".", 1)[0] + ".weight"][1:]))
      value = u[start:start + size].reshape(shape) * np.float32(fan_in ** -0.5)
    params[name] = jnp.asarray(to_jax_layout(name, value), dtype)
  return WanVAE(config, params)


# ----------------------------------------------------------------------------------------------
# Latent normalisation (as WanPipeline applies it)


def latent_stats(config: WanVAEConfig, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
  """(mean, 1 / std) of the config's latent statistics, each numpy [1, z_dim, 1, 1, 1] in `dtype`, formed
  as diffusers' Wan pipelines form them: `torch.tensor(latents_std).view(...).to(dtype)`, then `1.0 /`
  that in `dtype` (precedence: the cast comes first). A bf16 quotient is computed in fp32 and rounded
  once, as torch does; numpy's IEEE division where XLA:CPU's vectorised one can be 1 ulp off. Taking
  the reciprocal in fp32 before the cast instead differs in 6 of Wan 2.1's 16 bf16 channels."""
  shape = (1, config.z_dim, 1, 1, 1)
  mean = np.asarray(config.latents_mean, np.float32).reshape(shape).astype(dtype)
  std = np.asarray(config.latents_std, np.float32).reshape(shape).astype(dtype)
  return mean, (np.float32(1) / std.astype(np.float32)).astype(dtype)


def denormalize_latents(config: WanVAEConfig, latents: jax.Array) -> jax.Array:
  """Diffusion-space latents [B, C, F, Hl, Wl] -> VAE-space: `latents / (1 / std) + mean` in the latents'
  dtype, as WanPipeline writes it (`latent_stats`). Traced by XLA, the division can be 1 ulp off
  torch's and a fused divide-add skips the intermediate rounding; `decoding.vae_latents` is the
  host form that rounds as torch does."""
  mean, inv_std = latent_stats(config, latents.dtype)
  return latents / inv_std + mean


def normalize_latents(config: WanVAEConfig, latents: jax.Array) -> jax.Array:
  """VAE-space latents [B, C, F, Hl, Wl] -> diffusion space: `(latents - mean) * (1 / std)` in the
  latents' dtype (`latent_stats`), as diffusers' Wan image-to-video pipelines write it."""
  mean, inv_std = latent_stats(config, latents.dtype)
  return (latents - mean) * inv_std


# ----------------------------------------------------------------------------------------------
# Decode


def decode_chunk(vae: WanVAE, cache: L.Cache | None, z_BTHWC: jax.Array,
                 rows: L.RowShards | None = None) -> tuple[jax.Array, L.Cache]:
  """One causal decoder chunk: latents z [B, 1, Hl, Wl, z_dim] (one latent frame, denormalized as
  `decode` takes them) -> (video [B, T, 8Hl, 8Wl, 3] in [-1, 1], T = 1 on the first chunk (cache None), else 4; the
  feature cache for the next chunk). `rows`: the height split inside `shard_map`, or None."""
  cfg = vae.config
  post_quant = cfg.quant_layers()[1]
  x, _ = L.run_layers(vae.params, (post_quant,), z_BTHWC, None, first_chunk=cache is None)
  x, cache = L.run_layers(vae.params, cfg.decoder_layers(), x, cache, first_chunk=cache is None, rows=rows)
  return jnp.clip(vae_residual.unpatchify(x, cfg.patch), -1.0, 1.0), cache


class _ChunkPrograms(NamedTuple):  # first: (vae, z) -> (chunk, cache); later: (vae, cache, z), cache donated
  first: Any
  later: Any
  first_rows: Any  # as first and later, split along height: (..., *, mesh, rows)
  later_rows: Any


@functools.cache
def _chunk_programs(effort: float | None) -> _ChunkPrograms:
  """The decode's jitted chunk programs at XLA optimization `effort` (None: JAX's global setting)."""
  options = None if effort is None else {"exec_time_optimization_effort": effort}
  rows_jit = functools.partial(jax.jit, static_argnames=("mesh", "rows"), compiler_options=options)
  # The cache is donated: its buffers are reused for the new cache instead of holding two copies.
  return _ChunkPrograms(jax.jit(lambda vae, z: decode_chunk(vae, None, z), compiler_options=options),
                        jax.jit(decode_chunk, donate_argnums=1, compiler_options=options),
                        rows_jit(_first_chunk_rows), rows_jit(_later_chunk_rows, donate_argnums=1))


def platform_of(tree: Any) -> str:  # of the first array of `tree` (the default backend's for host arrays)
  leaf = jax.tree.leaves(tree)[0]
  return next(iter(leaf.devices())).platform if isinstance(leaf, jax.Array) else jax.default_backend()


def check_latents(config: WanVAEConfig, latents: jax.Array) -> None:
  if latents.ndim != 5:
    raise ValueError(f"latents must be [B, C, F, Hl, Wl], got {latents.shape=}")
  B, C, F, Hl, Wl = latents.shape
  if C != config.z_dim:
    raise ValueError(f"latents have {C=} channels but the VAE has {config.z_dim=}")
  if min(B, F, Hl, Wl) < 1:
    raise ValueError(f"latents {latents.shape=} have an empty axis (zero frames?)")


def decode(vae: WanVAE, latents: jax.Array, *, video_layout: str = "BCFHW",
           compile_effort: float | None = None) -> jax.Array:
  """Decodes VAE-space latents into a video in [-1, 1] (diffusers `AutoencoderKLWan.decode`).

  Apply `denormalize_latents` first to latents coming from the diffusion model, as WanPipeline does.

  Args:
    vae: the model; latents are cast to its dtype, and the video comes back in it.
    latents: [B, C, F, Hl, Wl] with C == config.z_dim.
    video_layout: "BCFHW" (diffusers' decoder output [B, 3, frames, sHl, sWl], s =
      `config.spatial_factor`) or "BFHWC" (the pipeline's [B, frames, sHl, sWl, 3], the internal
      layout: no transpose).
    compile_effort: XLA's optimization effort in [-1, 1] for the chunk programs; None: the
      platform's (`effort.decode_compile_effort`: -0.5 on TPU, JAX's own setting elsewhere).

  Returns:
    The video, frames = 1 + 4(F - 1) (temporal factor 4), clamped to [-1, 1].

  Raises:
    ValueError: latents not 5-D, wrong channel count, an empty axis, an unknown `video_layout`, or
      a `compile_effort` outside [-1, 1].

  Time chunking (`decode_continued`): latent frame 0 goes through the first-chunk program (no cache;
  upsample3d's time conv skipped: 1 frame), frames 1..F-1 each through the later-chunk program (4
  frames), carrying the cache; both compiled once per (config, B, Hl, Wl, dtype, effort). Only one
  chunk's activations plus the cache are live at a time. Call it outside `jit` (the frame loop
  would be unrolled).

  Memory (`band_memory.decode_step_memory_analysis`): weights and cache plus one chunk's temporaries
  (the new cache aliases the donated one). TPU v5e, JAX 0.10.2, libtpu 0.0.42.1 (2026-12-05), arguments /
  temporaries GiB: Wan 2.1 480p fp32 4.01 / 9.15, bf16 2.00 / 5.78, 720p bf16 4.23 / 9.50; the Wan 2.2
  VAE at 704x1280 needs 64.5 (fp32) / 32.2 (bf16) GiB of temporaries. `bands.decode_banded` bounds it.
  """
  if video_layout not in ("BCFHW", "BFHWC"):
    raise ValueError(f"unknown {video_layout=}; use 'BCFHW' (diffusers) or 'BFHWC' (pipeline)")
  video_BFHWC, _ = decode_continued(vae, latents, compile_effort=compile_effort)
  return video_BFHWC if video_layout == "BFHWC" else jnp.transpose(video_BFHWC, (0, 4, 1, 2, 3))


@functools.partial(jax.jit, static_argnums=1)
def _frames_last(latents: jax.Array, dtype: jnp.dtype) -> jax.Array:
  """[B, C, F, Hl, Wl] -> [B, F, Hl, Wl, C] in `dtype`: one program (eagerly, the cast and the
  transpose are two, each traced, lowered and looked up in the compile cache by every process)."""
  return jnp.transpose(latents.astype(dtype), (0, 2, 3, 4, 1))


def decode_continued(vae: WanVAE, latents: jax.Array, cache: L.Cache | None = None, *,
                     compile_effort: float | None = None) -> tuple[jax.Array, L.Cache]:
  """`decode`'s time chunks carried on from an earlier call's causal cache, so a stream decodes its
  latents chunk by chunk: the same frames as one `decode` of them all.

  Args:
    latents: [B, C, F, Hl, Wl] (denormalized, as `decode` takes them), the F latent frames after
      those `cache` has seen.
    cache: the cache an earlier call returned (donated: not usable after), or None from frame 0.

  Returns:
    (video [B, T, sHl, sWl, 3] in [-1, 1], T = 4F, or 1 + 4(F - 1) from frame 0; the cache after them).

  Raises:
    ValueError: as `decode`.
  """
  check_latents(vae.config, latents)
  programs = _chunk_programs(check_compile_effort(compile_effort, platform_of(vae.params)))
  z_BFHWC = _frames_last(latents, vae.dtype)
  chunks = []
  for i in range(z_BFHWC.shape[1]):
    if cache is None:
      chunk, cache = programs.first(vae, z_BFHWC[:, i:i + 1])
    else:
      chunk, cache = programs.later(vae, cache, z_BFHWC[:, i:i + 1])
    chunks.append(chunk)
  return jnp.concatenate(chunks, axis=1), cache


# ----------------------------------------------------------------------------------------------
# Decode split along height over a mesh

ROWS_AXIS = "rows"  # the one axis of the decode's mesh: every device of the caller's mesh, in order
_ROWS_SPEC = P(None, None, ROWS_AXIS)  # [B, T, H, W, C] arrays and every cache entry: H split


def row_mesh(mesh: Mesh) -> Mesh:
  """The 1-D `(ROWS_AXIS,)` mesh over `mesh`'s devices, flattened in its order (every axis it has).

  In a multi-process run only this process's devices are used, so each process can decode on its
  own (the pipeline decodes on the process that writes the video).

  Raises:
    ValueError: `mesh` is not a `jax.sharding.Mesh`, or holds none of this process's devices.
  """
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  if not devices:
    raise ValueError(f"the mesh holds none of process {jax.process_index()}'s devices")
  return Mesh(np.array(devices, dtype=object), (ROWS_AXIS,))


def row_split(devices: int, latent_height: int) -> L.RowShards:
  """The height split of Hl latent rows over D devices: bands of ceil(Hl / D) rows, the rest padding."""
  return L.RowShards(ROWS_AXIS, devices, -(-latent_height // devices), latent_height)


def _sharded(fn, mesh: Mesh, n_in: int):
  return jax.shard_map(fn, mesh=mesh, in_specs=(P(),) + (_ROWS_SPEC,) * n_in,
                       out_specs=(_ROWS_SPEC, _ROWS_SPEC), check_vma=False)


def _first_chunk_rows(vae: WanVAE, z_BTHWC: jax.Array, *, mesh: Mesh,
                      rows: L.RowShards) -> tuple[jax.Array, L.Cache]:
  return _sharded(lambda v, z: decode_chunk(v, None, z, rows), mesh, 1)(vae, z_BTHWC)


def _later_chunk_rows(vae: WanVAE, cache: L.Cache, z_BTHWC: jax.Array, *, mesh: Mesh,
                      rows: L.RowShards) -> tuple[jax.Array, L.Cache]:
  return _sharded(lambda v, c, z: decode_chunk(v, c, z, rows), mesh, 2)(vae, cache, z_BTHWC)


def decode_parallel_chunks(vae: WanVAE, latents: Any, mesh: Mesh, *,
                           compile_effort: float | None = None) -> Iterator[jax.Array]:
  """`decode_parallel`'s time chunks as they are computed, still split along height.

  Yields [B, T, 8 * Hp, 8Wl, 3] in the VAE's dtype, clamped to [-1, 1] (T = 1 for the first
  latent frame, 4 for each later one), sharded along height over `row_mesh(mesh)`; Hp = D *
  ceil(Hl / D) >= Hl, and the rows from 8 * Hl on are padding for the caller to drop.
  `compile_effort` as in `decode`. Raises as `decode_parallel` does, before any compute.
  """
  check_latents(vae.config, latents)
  rmesh = row_mesh(mesh)
  programs = _chunk_programs(check_compile_effort(compile_effort, rmesh.devices.flat[0].platform))
  B, C, F, Hl, Wl = latents.shape
  rows = row_split(rmesh.size, Hl)
  sharding = NamedSharding(rmesh, _ROWS_SPEC)
  vae = jax.device_put(vae, NamedSharding(rmesh, P()))  # a no-op when already placed so
  z = np.asarray(jax.device_get(latents)).astype(vae.dtype).transpose(0, 2, 3, 4, 1)  # [B, F, Hl, Wl, C]
  z = np.pad(z, ((0, 0), (0, 0), (0, rows.devices * rows.band - Hl), (0, 0), (0, 0)))
  chunk, cache = programs.first_rows(vae, jax.device_put(z[:, :1], sharding), mesh=rmesh, rows=rows)
  yield chunk
  for i in range(1, F):
    chunk, cache = programs.later_rows(vae, cache, jax.device_put(z[:, i:i + 1], sharding),
                                       mesh=rmesh, rows=rows)
    yield chunk


def decode_parallel(vae: WanVAE, latents: Any, mesh: Mesh, *, video_layout: str = "BCFHW",
                    compile_effort: float | None = None) -> jax.Array:
  """`decode` with the latents split along height over every device of `mesh` (spatial parallelism).

  Same math as `decode` (diffusers `AutoencoderKLWan.decode`), the same time chunks and causal
  cache, but each of the mesh's D devices (all axes flattened, `row_mesh`) holds a band of
  ceil(Hl / D) latent rows and the matching rows at every level up to the video, and keeps its own
  part of the cache. Per chunk program the communication is (`layers.RowShards`): for every
  3x3 spatial conv, two `ppermute`s of one row (the halo above and below); for the mid-block
  attention, D - 1 `ppermute`s of the band's keys and values (ring-style); no all-gather. A height
  that D does not divide is padded to D * ceil(Hl / D) latent rows, zeroed before every conv and
  masked in the attention, so the result equals one-device decoding up to fp32 rounding (the
  attention sums in another order).

  Args:
    vae: the model; latents are cast to its dtype, and the video comes back in it.
    latents: [B, C, F, Hl, Wl] with C == config.z_dim (numpy or a JAX array).
    mesh: any `jax.sharding.Mesh`; its devices decode, in its device order.
    video_layout: "BCFHW" (diffusers) or "BFHWC" (the pipeline's), as in `decode`.
    compile_effort: as in `decode`.

  Returns:
    The video [B, 3, frames, 8Hl, 8Wl] (or BFHWC), frames = 1 + 4(F - 1), in [-1, 1]; sharded
    along height over the mesh's devices when D divides Hl.

  Raises:
    ValueError: as `decode` (latents' rank, channels, empty axes, layout, effort), or `mesh` not a Mesh.

  Memory per device: the cache and every activation are 1/D of `decode`'s plus one row above and
  below per conv input (a band of h rows costs (h + 2) / h); the attention scores are [h Wl, h Wl]
  fp32 per step instead of [Hl Wl, Hl Wl].
  """
  if video_layout not in ("BCFHW", "BFHWC"):
    raise ValueError(f"unknown {video_layout=}; use 'BCFHW' (diffusers) or 'BFHWC' (pipeline)")
  chunks = list(decode_parallel_chunks(vae, latents, mesh, compile_effort=compile_effort))
  video_BFHWC = jnp.concatenate(chunks, axis=1)
  height = latents.shape[3] * vae.config.spatial_factor
  if video_BFHWC.shape[2] != height:
    video_BFHWC = video_BFHWC[:, :, :height]
  if video_layout == "BFHWC":
    return video_BFHWC
  return jnp.transpose(video_BFHWC, (0, 4, 1, 2, 3))


def lower_decode_programs(vae: WanVAE, *, batch: int, latent_height: int, latent_width: int,
                          devices: list[Any] | None, split: bool,
                          compile_effort: float | None = None) -> dict[str, Any]:
  """The decode's two chunk programs lowered (not compiled) for abstract latents; nothing runs.

  Args:
    vae: the model; its leaves may be `jax.ShapeDtypeStruct`s (they are placed like the programs').
    batch, latent_height, latent_width: B, Hl, Wl of the latents.
    devices: where the programs run: the first one (`decode`), or with `split` all of them that
      belong to this process (`decode_parallel`, `row_mesh`: the latent rows padded to D * ceil(Hl /
      D) and split; a TPU host of a v6e:2x4 slice holds 4 of its 8 chips). None: as `decode` runs
      on host latents and `vae` as it is placed (its committed leaves where they are, the rest on
      the default device), so that compiling them compiles what that decode will call.
    split: the height split over every device of `devices`.
    compile_effort: XLA's optimization effort the programs compile at; None: the one `decode`
      uses on the devices' platform (`effort.decode_compile_effort`).

  Returns:
    {"first": the lowered first-chunk program, "later": the lowered later-chunk program} (the
    later one for the cache the first returns). `end_to_end/aot/vae.py` compiles them for a TPU.

  Raises:
    ValueError: `split` without `devices`, or a `compile_effort` outside [-1, 1].
  """
  if split and not devices:
    raise ValueError("a split decode needs its devices")
  platform = platform_of(vae.params) if devices is None else devices[0].platform
  programs = _chunk_programs(check_compile_effort(compile_effort, platform))

  def placed(tree, sharding):
    def one(x):
      where = sharding(x) if callable(sharding) else sharding
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where)
    return jax.tree.map(one, tree)

  if not split:
    if devices is None:  # jit's placement of `decode`'s arguments: committed leaves stay, the rest follow
      replicated = None
      vae = WanVAE(vae.config, placed(vae.params, lambda x: x.sharding if getattr(x, "committed", False) else None))
    else:
      replicated = NamedSharding(Mesh(np.array(devices[:1], dtype=object), ("all",)), P())
      vae = WanVAE(vae.config, placed(vae.params, replicated))
    z = placed(jax.ShapeDtypeStruct((batch, 1, latent_height, latent_width, vae.config.z_dim), vae.dtype), replicated)
    _, cache = programs.first.eval_shape(vae, z)
    # jit returns the cache committed where the committed weights are (uncommitted when none is)
    out = replicated or next((x.sharding for x in jax.tree.leaves(vae.params) if x.sharding is not None), None)
    return {"first": programs.first.lower(vae, z), "later": programs.later.lower(vae, placed(cache, out), z)}
  mesh = row_mesh(Mesh(np.array(devices, dtype=object), ("all",)))  # as `decode_parallel`: this process's
  vae = WanVAE(vae.config, placed(vae.params, NamedSharding(mesh, P())))
  rows = row_split(mesh.size, latent_height)
  sharding = NamedSharding(mesh, _ROWS_SPEC)
  z = placed(jax.ShapeDtypeStruct((batch, 1, rows.devices * rows.band, latent_width, vae.config.z_dim), vae.dtype),
             sharding)
  _, cache = programs.first_rows.eval_shape(vae, z, mesh=mesh, rows=rows)
  return {"first": programs.first_rows.lower(vae, z, mesh=mesh, rows=rows),
          "later": programs.later_rows.lower(vae, placed(cache, sharding), z, mesh=mesh, rows=rows)}


def abstract_vae(config: WanVAEConfig, dtype: jnp.dtype = jnp.float32) -> WanVAE:
  """The model with `jax.ShapeDtypeStruct` parameters (JAX layout, `dtype`): for lowering only."""
  return WanVAE(config, {k: jax.ShapeDtypeStruct(to_jax_layout(k, np.empty(s, np.bool_)).shape, dtype)
                         for k, s in config.param_shapes().items()})
