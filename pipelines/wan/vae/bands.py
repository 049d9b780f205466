"""Wan VAE decode and encode in horizontal bands: device memory bounded at any frame size, exactly.

The decoder's only layer that sees a whole frame is its mid-block attention; every other layer is
local in space (3x3 convs, per-pixel RMS norms, 2x upsamplers, pixel-block reshapes). So the decoder
is cut there (`decoder_split`): a HEAD (post_quant_conv, conv_in, the mid block's first resnet and
its attention) runs on the whole frame at latent resolution, and a TAIL (everything after) runs per
band of latent rows. A band is computed on a window of rows that reaches `tail_radius` rows past it
on each side (fewer at the frame's true top and bottom, where the real zero padding applies); every
output row of the band then depends only on real input rows, so the banded decode equals `decode`
up to fp32 rounding (no blending). The encoder is cut before its mid attention the same way
(`encoder_split`): bands through its head, the whole frame through the rest.

Receptive radius (`edge_rows`): a false edge of a window (a cut, with zeros past it) spoils a few
rows next to it, and each layer widens that strip: a 3x3 conv by one row at its level, a nearest 2x
upsample followed by a 3x3 conv from e to 2e + 1 rows, the Wan 2.2 `DupUp3D` to 2e, a stride-2
downsample (zero-padded below) to e // 2 + 1, `AvgDown3D` to ceil(e / 2); the causal time caches do
not widen it (every frame's strip has the same rows). A margin of ceil(e / s) latent rows (e at the
output level, s its rows per latent row) keeps the spoiled rows out of the band. Wan 2.1 and 2.2:
15 latent rows for the decoder, 11 for the encoder's head; the tiny presets 11 and 7.

Windows (`band_plan`): all of one height, `band_rows + 2 * margin` rows (capped at the frame),
so every band of a decode runs the same two compiled programs: window k starts at k * band_rows
(the last one moved up to end at the frame's bottom) and keeps its rows from its margin on (all of
them at the frame's edges): the first and last bands keep up to band_rows + margin rows.

Order (band-major): the head runs over every latent frame first (its outputs, [B, F, Hl, Wl, C],
latent resolution, go to the host); then each band runs the tail over every time chunk with its own
causal cache, its rows copied to the host as each chunk finishes. Device memory peaks at one band's
window, cache and temporaries, or the head's whole-frame program (`band_memory` measures both).
The head's attention is not banded: its [Hl Wl, Hl Wl] fp32 scores per frame (0.83 GB at 720p)
bound the frame size that fits. Work: the tail runs on (bands x window) rows instead of Hl.

The radius is a worst case: only the one path along every kernel's edge reaches that far, and the
product of its weights fades with depth, so with a margin of r - 1 the tiny decoders still agree to
fp32 rounding (measured; the encoder's shorter head differs by ~1e-3 there). The tests' positive
controls use a margin of 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.wan.vae import layers as L, residual as vae_residual
from pipelines.wan.vae import encoding as vae_encoding, model as vae_model
from pipelines.wan.vae.config import WanVAEConfig
from pipelines.wan.vae.effort import check_compile_effort
from pipelines.wan.vae.topology import (AttnBlock, CausalConv, Layer, NormSiLU, Resample, ResBlock,
                                        ResidualGroup, Shortcut)

# ----------------------------------------------------------------------------------------------
# Where to cut, and how far a cut reaches


def _has_attention(layers: Sequence[Layer]) -> bool:
  return any(isinstance(x, AttnBlock) or (isinstance(x, ResidualGroup) and _has_attention(x.body))
             for x in layers)


def decoder_split(config: WanVAEConfig) -> tuple[tuple[Layer, ...], tuple[Layer, ...]]:
  """(head, tail) of the decoder: post_quant_conv + the decoder's layers up to and including its
  last attention block (run on whole frames), and the rest (run per band; `unpatchify` follows).

  Raises:
    ValueError: no top-level attention block, or one nested in a group (no clean cut).
  """
  layers = config.decode_layers()
  cut = max((i for i, x in enumerate(layers) if isinstance(x, AttnBlock)), default=None)
  if cut is None or _has_attention(layers[cut + 1:]):
    raise ValueError(f"the decoder of {config} has no top-level attention block after which every "
                     "layer is local in space; it cannot be cut into bands")
  return layers[:cut + 1], layers[cut + 1:]


def encoder_split(config: WanVAEConfig) -> tuple[tuple[Layer, ...], tuple[Layer, ...]]:
  """(head, tail) of the encoder: its layers before the first attention block (run per band, after
  `patchify`), and the rest + quant_conv (run on whole frames).

  Raises:
    ValueError: no top-level attention block, or one nested in a group before it.
  """
  layers = (*config.encoder_layers(), config.quant_layers()[0])
  cut = next((i for i, x in enumerate(layers) if isinstance(x, AttnBlock)), None)
  if cut is None or _has_attention(layers[:cut]):
    raise ValueError(f"the encoder of {config} has no top-level attention block before which every "
                     "layer is local in space; it cannot be cut into bands")
  return layers[:cut], layers[cut:]


def _shortcut_edge(s: Shortcut, rows: int) -> int:
  if s.kind == "dup_up":
    return rows * s.factor_s
  return -(-rows // s.factor_s)  # avg_down: blocks of factor_s rows, aligned with the window


def edge_rows(layers: Sequence[Layer], rows: int = 0) -> tuple[int, Fraction]:
  """How far a false window edge reaches through `layers` (the module docstring's counting).

  Args:
    layers: spatially local layers (no attention), as `layers.run_layers` runs them.
    rows: rows at the input's edge already spoiled.

  Returns:
    (rows spoiled at each edge of the output, output rows per input row).

  Raises:
    ValueError: an attention block (its reach is the whole frame) or an unknown layer.
  """
  scale = Fraction(1)
  for layer in layers:
    match layer:
      case CausalConv():
        rows += layer.kernel // 2
      case ResBlock():
        rows += 2  # conv1 and conv2, 3x3 in space; the shortcut is 1x1
      case NormSiLU():
        pass
      case Resample() if layer.mode.startswith("up"):
        rows, scale = 2 * rows + 1, scale * 2
      case Resample():
        rows, scale = rows // 2 + 1, scale / 2
      case ResidualGroup():
        body, body_scale = edge_rows(layer.body, rows)
        short = rows if layer.shortcut is None else _shortcut_edge(layer.shortcut, rows)
        rows, scale = max(body, short), scale * body_scale
      case AttnBlock():
        raise ValueError(f"{layer.name}: attention reaches the whole frame; a band cannot hold it")
      case _:
        raise ValueError(f"unknown layer {layer=}")
  return rows, scale


def tail_radius(config: WanVAEConfig) -> int:
  """Latent rows a band of the decoder's tail must see past each side to be exact: ceil(e / s) for
  e output rows spoiled by a false edge (`edge_rows`, through `unpatchify`'s p x p too) and s =
  `config.spatial_factor` output rows per latent row. 15 for Wan 2.1 and 2.2, 11 for "tiny"."""
  rows, scale = edge_rows(decoder_split(config)[1])
  return math.ceil(Fraction(rows * config.patch) / (scale * config.patch))


def encoder_radius(config: WanVAEConfig) -> int:
  """Latent rows a band of the encoder's head must see past each side to be exact: the rows its
  output (latent resolution) loses to a false edge of its window (`edge_rows`; windows start at
  multiples of `config.spatial_factor` pixels, so every downsample stays aligned)."""
  rows, scale = edge_rows(encoder_split(config)[0])
  assert scale * config.spatial_factor == config.patch, (scale, config)
  return rows


# ----------------------------------------------------------------------------------------------
# Bands


@dataclasses.dataclass(frozen=True)
class Band:
  """One band in latent rows: it is computed on rows [start, stop) and keeps rows [keep_start,
  keep_stop) (start <= keep_start < keep_stop <= stop)."""
  start: int
  stop: int
  keep_start: int
  keep_stop: int


def band_plan(height: int, band_rows: int, margin: int) -> tuple[Band, ...]:
  """Bands covering rows [0, height) once each, every window `min(band_rows + 2 margin, height)` rows,
  every kept row at least `margin` rows from a window edge that is not the frame's.

  Window k starts at min(k band_rows, height - window); the first band keeps rows [0, band_rows +
  margin), band k > 0 [k band_rows + margin, ...), the last one up to `height`.

  Raises:
    ValueError: band_rows < 1, margin < 0 or height < 1.
  """
  if band_rows < 1 or margin < 0 or height < 1:
    raise ValueError(f"{band_rows=} must be >= 1, {margin=} >= 0 and {height=} >= 1")
  window = min(band_rows + 2 * margin, height)
  bands, k = [], 0
  while not bands or bands[-1].stop < height:
    start = min(k * band_rows, height - window)
    keep_start = 0 if k == 0 else k * band_rows + margin
    keep_stop = height if start + window == height else (k + 1) * band_rows + margin
    bands.append(Band(start, start + window, keep_start, keep_stop))
    k += 1
  return tuple(bands)


# ----------------------------------------------------------------------------------------------
# Programs


def _decoder_head(vae: vae_model.WanVAE, cache: L.Cache | None, z_BTHWC: jax.Array):
  """[B, 1, Hl, Wl, z_dim] -> ([B, 1, Hl, Wl, C] after the mid attention, cache)."""
  head, _ = decoder_split(vae.config)
  return L.run_layers(vae.params, head, z_BTHWC, cache, first_chunk=cache is None)


def _decoder_tail(vae: vae_model.WanVAE, cache: L.Cache | None, x_BTHWC: jax.Array):
  """[B, 1, h, Wl, C] -> ([B, T, s h, s Wl, 3] in [-1, 1], cache); T = 1 on the first chunk, else 4."""
  cfg = vae.config
  y, cache = L.run_layers(vae.params, decoder_split(cfg)[1], x_BTHWC, cache, first_chunk=cache is None)
  return jnp.clip(vae_residual.unpatchify(y, cfg.patch), -1.0, 1.0), cache


def _encoder_head(vae: vae_model.WanVAE, cache: L.Cache | None, x_BTHWC: jax.Array):
  """Video [B, T, H, W, 3] -> ([B, 1, H / s, W / s, C] before the encoder's attention, cache)."""
  cfg = vae.config
  x = vae_residual.patchify(x_BTHWC, cfg.patch)
  return L.run_layers(vae.params, encoder_split(cfg)[0], x, cache, first_chunk=cache is None)


def _encoder_tail(vae: vae_model.WanVAE, cache: L.Cache | None, x_BTHWC: jax.Array):
  """[B, 1, Hl, Wl, C] -> ([B, 1, Hl, Wl, 2 z_dim] mean and log-variance, cache)."""
  return L.run_layers(vae.params, encoder_split(vae.config)[1], x_BTHWC, cache, first_chunk=cache is None)


@functools.cache
def chunk_programs(step: Callable, effort: float | None) -> tuple[Any, Any]:
  """(first, later) jitted chunk programs of a causal `step(vae, cache, x)`: first(vae, x) with no
  cache; later(vae, cache, x) with the cache donated (its buffers reused for the new one)."""
  options = None if effort is None else {"exec_time_optimization_effort": effort}
  return (jax.jit(lambda vae, x: step(vae, None, x), compiler_options=options),
          jax.jit(step, donate_argnums=1, compiler_options=options))


def _run_chunks(programs: tuple[Any, Any], vae: vae_model.WanVAE, inputs: Iterable[Any]) -> Iterator[np.ndarray]:
  """The outputs of a causal program pair over time chunks, on the host, in order; each chunk's copy
  to the host starts as soon as it is dispatched and is awaited only after the next is dispatched."""
  first, later = programs
  cache = pending = None
  for x in inputs:
    out, cache = first(vae, x) if pending is None else later(vae, cache, x)
    out.copy_to_host_async()
    if pending is not None:
      yield np.asarray(pending)
    pending = out
  if pending is not None:
    yield np.asarray(pending)


# ----------------------------------------------------------------------------------------------
# Decode


def decode_banded(vae: vae_model.WanVAE, latents: Any, *, band_rows: int, video_layout: str = "BFHWC",
                  compile_effort: float | None = None, margin: int | None = None) -> np.ndarray:
  """`decode` with the decoder's tail run per band of `band_rows` latent rows: bounded device memory.

  Args:
    vae: the model; latents are cast to its dtype, and the video comes back in it.
    latents: VAE-space latents [B, C, F, Hl, Wl] (numpy or JAX), C == config.z_dim.
    band_rows: latent rows each band keeps (>= 1); its window is band_rows + 2 margin rows (capped
      at Hl), the first and last bands keep up to band_rows + margin (`band_plan`).
    video_layout: "BFHWC" (the pipeline's [B, frames, sHl, sWl, 3]) or "BCFHW" (diffusers').
    compile_effort: as in `decode`.
    margin: rows past each side of a band; None: `tail_radius(config)`, which makes the result equal
      `decode`'s up to fp32 rounding. A smaller margin blends in the false edges' errors (tests).

  Returns:
    The video as a host numpy array, frames = 1 + 4(F - 1), in [-1, 1].

  Raises:
    ValueError: as `decode` (latents, layout, effort), band_rows < 1 or margin < 0.

  Programs: the head's and the tail's first- and later-chunk programs, compiled once per (config,
  B, Hl, Wl, window, dtype, effort): every band shares the tail's. Work: the tail runs on
  (number of bands) x window rows instead of Hl.
  """
  vae_model.check_latents(vae.config, latents)
  if video_layout not in ("BCFHW", "BFHWC"):
    raise ValueError(f"unknown {video_layout=}; use 'BFHWC' (pipeline) or 'BCFHW' (diffusers)")
  effort = check_compile_effort(compile_effort, vae_model.platform_of(vae.params))
  cfg = vae.config
  bands = band_plan(latents.shape[3], band_rows, tail_radius(cfg) if margin is None else margin)
  z = np.asarray(jax.device_get(latents)).astype(vae.dtype).transpose(0, 2, 3, 4, 1)  # [B, F, Hl, Wl, C]
  head = chunk_programs(_decoder_head, effort)
  h = np.concatenate(list(_run_chunks(head, vae, (z[:, i:i + 1] for i in range(z.shape[1])))), axis=1)
  B, F, Hl, Wl, _ = h.shape
  s = cfg.spatial_factor
  video = np.empty((B, 1 + cfg.temporal_factor * (F - 1), s * Hl, s * Wl, cfg.video_channels), h.dtype)
  tail = chunk_programs(_decoder_tail, effort)
  for band in bands:
    windows = (h[:, i:i + 1, band.start:band.stop] for i in range(F))
    frame = 0
    for chunk in _run_chunks(tail, vae, windows):
      keep = chunk[:, :, s * (band.keep_start - band.start):s * (band.keep_stop - band.start)]
      video[:, frame:frame + chunk.shape[1], s * band.keep_start:s * band.keep_stop] = keep
      frame += chunk.shape[1]
  return video if video_layout == "BFHWC" else video.transpose(0, 4, 1, 2, 3)


def lower_decode_band_programs(vae: vae_model.WanVAE, *, batch: int, latent_height: int, latent_width: int,
                               band_rows: int, compile_effort: float | None = None) -> dict[str, Any]:
  """`decode_banded`'s four chunk programs lowered (not compiled) for abstract latents on the default
  backend; nothing runs. `vae`'s leaves may be `jax.ShapeDtypeStruct`s (`model.abstract_vae`).

  Returns:
    {"head_first", "head_later"} (whole frames, Hl rows) and {"tail_first", "tail_later"} (one
    band's window, `band_plan`'s rows), each a `jax.stages.Lowered`; the later ones for the caches
    the first ones return.

  Raises:
    ValueError: band_rows < 1, or a `compile_effort` outside [-1, 1].
  """
  cfg = vae.config
  effort = check_compile_effort(compile_effort, jax.default_backend())
  band = band_plan(latent_height, band_rows, tail_radius(cfg))[0]
  z = jax.ShapeDtypeStruct((batch, 1, latent_height, latent_width, cfg.z_dim), vae.dtype)

  def lower(step, x):
    first, later = chunk_programs(step, effort)
    out, cache = first.eval_shape(vae, x)
    return out, first.lower(vae, x), later.lower(vae, cache, x)

  h, head_first, head_later = lower(_decoder_head, z)
  window = jax.ShapeDtypeStruct((batch, 1, band.stop - band.start, latent_width, h.shape[-1]), vae.dtype)
  _, tail_first, tail_later = lower(_decoder_tail, window)
  return {"head_first": head_first, "head_later": head_later, "tail_first": tail_first, "tail_later": tail_later}


# ----------------------------------------------------------------------------------------------
# Encode


def encode_banded(vae: vae_model.WanVAE, video: Any, *, band_rows: int,
                  margin: int | None = None) -> vae_model.LatentDistribution:
  """`encode` with the encoder's head (every layer before its mid attention) run per band of
  `band_rows` latent rows (s = `config.spatial_factor` video rows each): bounded device memory.

  Args:
    vae: the model; the video is cast to its dtype.
    video: [B, 3, frames, height, width] in [-1, 1] (numpy or JAX), as `encode` takes it.
    band_rows: latent rows each band keeps (>= 1); its window is band_rows + 2 margin latent rows
      (capped at height / s), as in `band_plan`.
    margin: latent rows past each side of a band; None: `encoder_radius(config)` (equal to
      `encode` up to fp32 rounding); smaller ones are approximate (tests).

  Returns:
    LatentDistribution(mean, logvar), each [B, C, 1 + (frames - 1) / 4, height / s, width / s].

  Raises:
    ValueError: as `encode` (the video's shape), band_rows < 1 or margin < 0.

  Band-major: each band runs the head over every time chunk (frame 0, then 4 frames at a time)
  with its own cache, its kept rows going to the host ([B, F, Hl, Wl, C], latent resolution);
  then the rest of the encoder runs on whole frames, chunk by chunk.
  """
  vae_encoding.check_video(vae.config, video)
  cfg, s = vae.config, vae.config.spatial_factor
  x = np.asarray(jax.device_get(video)).astype(vae.dtype).transpose(0, 2, 3, 4, 1)  # [B, frames, H, W, 3]
  step = vae_model.ENCODER_CHUNK
  times = [(0, 1)] + [(t, t + step) for t in range(1, x.shape[1], step)]
  bands = band_plan(x.shape[2] // s, band_rows, encoder_radius(cfg) if margin is None else margin)
  head = chunk_programs(_encoder_head, None)  # `encode`'s programs compile at JAX's effort too
  feats = None  # [B, F, Hl, Wl, C], on the host
  for band in bands:
    windows = (x[:, a:b, s * band.start:s * band.stop] for a, b in times)
    for i, out in enumerate(_run_chunks(head, vae, windows)):
      if feats is None:
        feats = np.empty((out.shape[0], len(times), x.shape[2] // s, *out.shape[3:]), out.dtype)
      feats[:, i:i + 1, band.keep_start:band.keep_stop] = out[:, :, band.keep_start - band.start:
                                                                 band.keep_stop - band.start]
  tail = chunk_programs(_encoder_tail, None)
  h = list(_run_chunks(tail, vae, (feats[:, i:i + 1] for i in range(len(times)))))
  return vae_encoding.latent_distribution(np.concatenate(h, axis=1))
