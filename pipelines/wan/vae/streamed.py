"""Wan VAE decode streamed layer by layer, frame by frame: `decode`'s math in small jitted programs.

`decode` runs each time chunk as ONE jitted program, and XLA keeps many frame-sized buffers of that
program alive at once: on a TPU v5e the later-chunk program of the Wan 2.1 VAE at 720 x 1280 fp32
holds 18.2 GB of temporaries, the Wan 2.2 VAE's (TI2V-5B) at 704 x 1280 64.5 GB fp32 / 32.2 GB bf16.
Bands of rows (`bands.decode_banded`) cannot fix that: a band's window needs 15 latent rows of
margin on each side, 31 of the 44 rows of a 704-row frame.

Here the same chunks run as a SEQUENCE of programs (`decode_plan`): post_quant_conv, then one per
decoder layer (`CausalConv`, `ResBlock`, `AttnBlock`, `Resample`, `NormSiLU`; a Wan 2.2
`ResidualGroup` is flattened into its body's layers and one program adding its shortcut, the
group's input kept alive until then), then the output (unpatchify and clip). Each layer program
takes that layer's parameters, its activations and its cache entries, and returns the new
activations and cache entries; the cache entries (and the activations, unless a shortcut still
needs them) are donated, so only one layer's activations and temporaries are live beside the whole
cache and the weights. Every layer program runs `layers.run_layers` on that one layer, renamed
`LOCAL`, so equal layers (same kind and dims) on equal inputs share one compile. Each chunk's
video is copied to the host as it finishes; the video is assembled there.

Same math as `decode` (diffusers `AutoencoderKLWan.decode`): the same layer functions, time chunks
and causal cache; only the program boundaries differ (XLA may fuse or round across a boundary
differently: fp32 results agree to rounding, see the tests).

Frame by frame (the default; `frames_at_once=True` keeps whole-input programs to compare): each
layer program runs on ONE frame [B, 1, H, W, C] of its input at a time, the layer's cache entries
carried from frame to frame (`_layer_calls` says why that is the same math); a time upsampler
makes 2 frames of each, a `dup_up` shortcut adds its ft frames to the body's frames one by one.
The largest program then holds one frame's activations instead of a later chunk's 4.

Memory (`streamed_decode_memory`, XLA's analysis of every program on abstract inputs, cached per
process): weights + the whole cache + the largest program's own bytes (its activations in and out,
its temporaries, and the activations held beside it: a group input, the frames its layer has yet
to run or has made). Measured with XLA:CPU (a TPU's temporaries differ: not measured here), B = 1,
peak GB, `decode`'s whole-chunk programs (`band_memory.decode_memory`) vs streamed whole inputs
vs streamed frame by frame (weights + cache + largest program, which one):
  Wan 2.1, 30 x 52 latents, fp32:   2.66 vs 2.40 vs 1.97 (0.51 + 0.96 + 0.50, up_blocks.3.resnets.2).
  Wan 2.1, 60 x 104 (480p), fp32:   9.68 vs 8.02 (whole inputs: 0.51 + 3.81 + 3.71).
  Wan 2.1, 90 x 160 (720p), fp32:  21.90 vs 17.81 vs 13.89 (0.51 + 8.76 + 4.62, up_blocks.3.resnets.2).
  Wan 2.2, 44 x 80 (704 x 1280), bf16: 15.02 vs 14.42 vs 8.49 (1.41 + 3.25 + 3.84, up_blocks.3.resnets.0).
  Wan 2.2, 44 x 80, fp32:          19.57 vs 20.92 vs 14.66 (2.82 + 6.50 + 5.34, up_blocks.3.resnets.0).
The largest program is still a full-resolution ResBlock (Wan 2.2: 512 -> 256 channels at 352 x
640), now on one frame beside its layer's other 3 input and output frames; its CPU convs cut every
time tap's frames into copies (`layers.causal_conv`). The cache is now 40-60 % of the peak.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Generator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.wan.vae import layers as L, model as vae_model, residual as vae_residual
from pipelines.wan.vae.band_memory import program_peak
from pipelines.wan.vae.config import WanVAEConfig
from pipelines.wan.vae.effort import check_compile_effort
from pipelines.wan.vae.topology import (AttnBlock, CausalConv, Layer, NormSiLU, Resample, ResBlock, ResidualGroup,
                                        Shortcut, param_shapes)

LOCAL = "layer"  # a layer's name inside its program: equal layers under different names share a compile

# ----------------------------------------------------------------------------------------------
# The plan: one step per program of a chunk


@dataclasses.dataclass(frozen=True)
class LayerStep:
  """Runs `layer` (named `LOCAL`) with the parameters and cache entries under `name`.

  holds: how many later `ShortcutStep`s take this step's input (kept alive, not donated).
  """
  name: str
  layer: Layer
  holds: int = 0

  @property
  def in_place(self) -> bool:
    """Whether the input is donated: nothing else needs it and the output has its shape (XLA can
    write the output over it; a donation it cannot use only draws a warning)."""
    match self.layer:
      case CausalConv(_, i, o, _) | ResBlock(_, i, o):
        same = i == o
      case AttnBlock() | NormSiLU():
        same = True
      case _:
        same = False
    return same and not self.holds

  @property
  def chunk_blind(self) -> bool:
    """Whether the layer computes the first chunk as a later one with a zero cache (all but the
    time resamplers, `layers.resample`): then one program serves every chunk."""
    return not (isinstance(self.layer, Resample) and self.layer.mode.endswith("3d"))


@dataclasses.dataclass(frozen=True)
class ShortcutStep:
  """Adds `shortcut` of the input held since its group's first step to the activations."""
  shortcut: Shortcut


@dataclasses.dataclass(frozen=True)
class OutputStep:
  """`unpatchify` by `patch`, then clip to [-1, 1], as `model.decode_chunk` ends."""
  patch: int


Step = LayerStep | ShortcutStep | OutputStep


def _layer_steps(layers: tuple[Layer, ...]) -> list[Step]:
  steps: list[Step] = []
  for layer in layers:
    if isinstance(layer, ResidualGroup):
      body = _layer_steps(layer.body)
      if layer.shortcut is not None:  # the group's input is its first body step's input
        body[0] = dataclasses.replace(body[0], holds=body[0].holds + 1)
        body.append(ShortcutStep(layer.shortcut))
      steps += body
    else:
      steps.append(LayerStep(layer.name, dataclasses.replace(layer, name=LOCAL)))
  return steps


@functools.cache
def decode_plan(config: WanVAEConfig) -> tuple[Step, ...]:
  """The programs of one streamed decoder chunk, in order: post_quant_conv, the decoder's layers
  (`ResidualGroup`s flattened, each followed by its shortcut), the output."""
  return (*_layer_steps(config.decode_layers()), OutputStep(config.patch))


def _localized(tree: dict[str, Any], name: str) -> dict[str, Any]:
  """The entries of `tree` under the layer `name` (key == name or name + "."...), keyed under LOCAL."""
  return {LOCAL + k[len(name):]: v for k, v in tree.items() if k == name or k.startswith(name + ".")}


def _globalized(tree: dict[str, Any], name: str) -> dict[str, Any]:
  return {name + k[len(LOCAL):]: v for k, v in tree.items()}


# ----------------------------------------------------------------------------------------------
# Programs


def _frames(x: jax.Array, split: bool) -> tuple[jax.Array, ...]:
  """x [B, T, ...] as T frames [B, 1, ...] (split) or as itself, one element."""
  return tuple(x[:, t:t + 1] for t in range(x.shape[1])) if split else (x,)


def _layer(layer: Layer, first_chunk: bool, split: bool, params: L.Params, x: jax.Array,
           cache: L.Cache | None) -> tuple[tuple[jax.Array, ...], L.Cache]:
  y, cache = L.run_layers(params, (layer,), x, cache, first_chunk=first_chunk)
  return _frames(y, split), cache


def _shortcut(s: Shortcut, first_chunk: bool, phase: int | None, body: jax.Array,
              x: jax.Array) -> tuple[tuple[jax.Array, ...], L.Cache]:
  """body + the shortcut of x; with `phase`, only the shortcut's output frame `phase` (a `dup_up`
  with time factor ft makes ft output frames of each input frame: body frame k takes frame k % ft
  of input frame k // ft's)."""
  short = L.shortcut(s, x, first_chunk)
  return (body + (short if phase is None else short[:, phase:phase + 1]),), {}


def _output(patch: int, x: jax.Array) -> tuple[tuple[jax.Array, ...], L.Cache]:
  return (jnp.clip(vae_residual.unpatchify(x, patch), -1.0, 1.0),), {}


class _Programs(NamedTuple):
  """Every program returns (a tuple of activations, new cache entries); cache entries are donated."""
  layer: Any  # (layer, first_chunk, split, params, x, cache)
  layer_in_place: Any  # the same with x donated (`LayerStep.in_place`)
  shortcut: Any  # (shortcut, first_chunk, phase, body, x): body donated
  output: Any  # (patch, x)


@functools.cache
def _programs(effort: float | None) -> _Programs:
  """The streamed decode's jitted programs at XLA optimization `effort` (None: JAX's setting)."""
  jit = functools.partial(jax.jit, compiler_options=None if effort is None else
                          {"exec_time_optimization_effort": effort})
  return _Programs(jit(_layer, static_argnums=(0, 1, 2), donate_argnums=5),
                   jit(_layer, static_argnums=(0, 1, 2), donate_argnums=(4, 5)),
                   jit(_shortcut, static_argnums=(0, 1, 2), donate_argnums=3),
                   jit(_output, static_argnums=0))


class _Call(NamedTuple):
  """One program call of a chunk: `_Programs` field `program` on (*static, *arrays)."""
  program: str
  static: tuple
  arrays: tuple
  weights: dict  # the parameters among `arrays`
  held: tuple  # activations alive beside the call (group inputs, the step's other frames)
  label: str  # what runs, for reports
  frame: int = 0  # the element of its step's input it runs on (0 for a whole input)


def _zeros(shapes: Any) -> Any:
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _flat(held: list[list[Any]]) -> tuple:
  return tuple(f for group in held for f in group if f is not None)


def _layer_calls(step: LayerStep, static: tuple, params: dict, frames: list, cache: L.Cache | None,
                 held: list[list[Any]]) -> Generator[_Call, tuple[Any, L.Cache], tuple[list, L.Cache]]:
  """One layer on each element of `frames` in time order (consumed: each is dropped once run),
  carrying its cache entries from one call to the next; returns (outputs, the last cache entries).

  Per frame this is the whole input's math: a causal conv's output frame t reads input frames
  t - 2, t - 1, t, i.e. the 2-frame cache as the previous call left it and frame t; RMS norms and
  pointwise convs are per pixel, the attention per frame, upsample2d per frame and upsample3d's
  time conv (a causal conv) makes 2 output frames of each input frame. Not frame-separable, and
  absent from the decoder: downsample3d (stride 2 in time) and `avg_down`.
  """
  program = "layer_in_place" if step.in_place else "layer"
  done: list = []
  n = len(frames)
  for i in range(n):
    frame = frames.pop(0)
    label = step.name if n == 1 else f"{step.name} frame {i + 1}/{n}"
    out, cache = yield _Call(program, static, (params, frame, cache), params, (*_flat(held), *frames, *done), label, i)
    done += out
  return done, cache


def _shortcut_calls(s: Shortcut, first: bool, per_frame: bool, body: list, x_in: list,
                    held: list[list[Any]]) -> Generator[_Call, tuple[Any, L.Cache], list]:
  """body + shortcut(x_in) on each body element (consumed); per frame, body frame k with input
  frame k // r, r = len(body) / len(x_in): dup_up's time factor, or 1 on the first chunk (where
  dup_up keeps the last of its frames, as the causal upsampler keeps 1 frame)."""
  r, rest = divmod(len(body), len(x_in))
  if rest or (r != 1 and not per_frame):
    raise AssertionError(f"{s}: {len(body)} body elements for {len(x_in)} inputs")
  done: list = []
  for k in range(len(body)):
    b = body.pop(0)
    phase = k % r if per_frame else None
    x = x_in[k // r]
    if k % r == r - 1:
      x_in[k // r] = None  # its last use
    out, _ = yield _Call("shortcut", (s, first, phase), (b, x), {}, (*_flat(held), *x_in, *body, *done),
                         f"{s.kind} shortcut", k)
    done += out
  return done


def _chunk_calls(vae: vae_model.WanVAE, cache_in: L.Cache | None, z_BTHWC: Any, zeros: Callable[[Any], Any],
                 per_frame: bool) -> Generator[_Call, tuple[Any, L.Cache], tuple[list, L.Cache]]:
  """One decoder chunk as its program calls: yields each `_Call`, is sent its (activations, cache
  entries), returns (the video's [B, t, s Hl, s Wl, 3] pieces in time order, the new cache) as
  `model.decode_chunk` does. per_frame: every program runs on one frame [B, 1, ...] (the
  activations are lists of frames); else on the chunk's whole [B, T, ...] input.

  Works on arrays (`decode_streamed`, `zeros` = `_zeros`) and on `jax.ShapeDtypeStruct`s
  (`streamed_memory`, `zeros` the identity). On the first chunk a `chunk_blind` layer gets a zero
  cache (`zeros` of its first-chunk cache's shapes) and runs the later chunks' program: the
  same values as diffusers' zero padding (`layers.causal_conv`), half the compiles. The first
  chunk has one frame at every level (its upsample3d keeps T = 1), so it is per frame either way.
  """
  first = cache_in is None
  pending = None if first else dict(cache_in)  # entries leave it as they are passed (and donated)
  cache_out: L.Cache = {}
  held: list[list[Any]] = []  # group inputs, kept for their shortcuts
  x: list = [z_BTHWC]
  for step in decode_plan(vae.config):
    match step:
      case LayerStep(name, layer, holds):
        params = {k: vae.params[name + k[len(LOCAL):]] for k in param_shapes((layer,))}
        if not first:
          cache = _localized(pending, name)
          for k in _globalized(cache, name):
            del pending[k]
        elif step.chunk_blind:
          cache = zeros(_programs(None).layer.eval_shape(layer, True, per_frame, params, x[0], None)[1])
        else:
          cache = None
        held += [list(x) for _ in range(holds)]
        static = (layer, first and not step.chunk_blind, per_frame)
        x, new = yield from _layer_calls(step, static, params, x, cache, held)
        cache_out.update(_globalized(new, name))
      case ShortcutStep(shortcut):
        x_in = held.pop()
        x = yield from _shortcut_calls(shortcut, first, per_frame, x, x_in, held)
      case OutputStep(patch):
        video = []
        while x:
          out, _ = yield _Call("output", (patch,), (x.pop(0),), {}, (*x, *video), "output")
          video += out
  if pending:
    raise AssertionError(f"cache entries no step of the plan took: {sorted(pending)}")
  return video, cache_out


def _drive(calls: Generator, run: Callable[[_Call], Any]) -> Any:
  """Runs a `_chunk_calls` generator with `run` answering each call; returns what it returns."""
  try:
    call = next(calls)
    while True:
      call = calls.send(run(call))
  except StopIteration as stop:
    return stop.value


def _run_call(programs: _Programs, call: _Call) -> tuple[tuple[jax.Array, ...], L.Cache]:
  """Runs one call of `decode_streamed` (the tests wrap it to break the cache on purpose)."""
  return getattr(programs, call.program)(*call.static, *call.arrays)


# ----------------------------------------------------------------------------------------------
# Decode


def decode_streamed(vae: vae_model.WanVAE, latents: Any, *, video_layout: str = "BFHWC",
                    compile_effort: float | None = None, frames_at_once: bool = False) -> np.ndarray:
  """`decode` with each time chunk run layer by layer (`decode_plan`), frame by frame: bounded memory.

  Args:
    vae: the model; latents are cast to its dtype, and the video comes back in it.
    latents: VAE-space latents [B, C, F, Hl, Wl] (numpy or JAX), C == config.z_dim.
    video_layout: "BFHWC" (the pipeline's [B, frames, sHl, sWl, 3]) or "BCFHW" (diffusers').
    compile_effort: as in `decode`.
    frames_at_once: run each layer program on the chunk's whole input (up to 4 frames) instead of
      one frame at a time (the default; same math, see `_layer_calls`).

  Returns:
    The video as a host numpy array, frames = 1 + 4(F - 1), in [-1, 1].

  Raises:
    ValueError: as `decode` (latents' rank, channels, empty axes, layout, effort).

  Device memory: the weights, the whole cache and one program's activations and temporaries
  beside the frames its layer has yet to run or has made (`streamed_decode_memory`); the video is
  on the host. Programs compile once per (layer kind and dims, input shape, first/later chunk,
  dtype, effort): per frame every input has one frame, so the chunks share them.
  """
  vae_model.check_latents(vae.config, latents)
  if video_layout not in ("BCFHW", "BFHWC"):
    raise ValueError(f"unknown {video_layout=}; use 'BFHWC' (pipeline) or 'BCFHW' (diffusers)")
  programs = _programs(check_compile_effort(compile_effort, vae_model.platform_of(vae.params)))
  cfg = vae.config
  z = np.asarray(jax.device_get(latents)).astype(vae.dtype).transpose(0, 2, 3, 4, 1)  # [B, F, Hl, Wl, C]
  B, F, Hl, Wl, _ = z.shape
  s = cfg.spatial_factor
  video = np.empty((B, 1 + cfg.temporal_factor * (F - 1), s * Hl, s * Wl, cfg.video_channels), z.dtype)
  where = jax.tree.leaves(vae.params)[0].sharding
  cache, frame = None, 0
  for i in range(F):
    pieces, cache = _drive(_chunk_calls(vae, cache, jax.device_put(z[:, i:i + 1], where), _zeros,
                                        not frames_at_once), functools.partial(_run_call, programs))
    for piece in pieces:
      video[:, frame:frame + piece.shape[1]] = np.asarray(piece)
      frame += piece.shape[1]
  return video if video_layout == "BFHWC" else video.transpose(0, 4, 1, 2, 3)


# ----------------------------------------------------------------------------------------------
# Memory


def tree_bytes(tree: Any) -> int:
  """Bytes of the arrays (or `jax.ShapeDtypeStruct`s) of a pytree."""
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


class StreamedMemory(NamedTuple):
  """A streamed decode's device bytes: `weights` + `cache` + `largest_call` (`largest_label`'s
  arguments, outputs and temporaries less the aliased, its weights and cache entries, plus the
  activations held beside it: `_Call.held`)."""
  weights: int
  cache: int
  largest_call: int
  largest_label: str

  @property
  def total(self) -> int:
    return self.weights + self.cache + self.largest_call


@functools.cache
def _call_peak(program: str, effort: float | None, static: tuple, tree: Any, shapes: tuple) -> int:
  """`program_peak` of one program on abstract arrays; cached (equal layers compile once)."""
  arrays = tree.unflatten([jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes])
  return program_peak(getattr(_programs(effort), program).lower(*static, *arrays))


def _measure(effort: float | None, found: list[tuple[int, str]]) -> Callable[[_Call], Any]:
  """A `_drive` answer that records each call's own bytes into `found` and returns its shapes."""
  def run(call: _Call):
    out = getattr(_programs(effort), call.program).eval_shape(*call.static, *call.arrays)
    leaves, tree = jax.tree.flatten(call.arrays)
    peak = _call_peak(call.program, effort, call.static, tree,
                      tuple((tuple(x.shape), np.dtype(x.dtype)) for x in leaves))
    args = {id(x) for x in leaves}
    beside = {id(x): x for x in call.held if id(x) not in args}  # each held array once
    # the weights and the cache entries (passed in, or made on the first chunk) are counted whole
    found.append((peak - tree_bytes(call.weights) - tree_bytes(out[1]) + tree_bytes(list(beside.values())),
                  call.label))
    return out
  return run


@functools.cache
def _streamed_memory(config: WanVAEConfig, batch: int, latent_height: int, latent_width: int,
                     dtype: np.dtype, per_frame: bool) -> StreamedMemory:
  vae = vae_model.abstract_vae(config, dtype)
  effort = check_compile_effort(None, jax.default_backend())
  z = jax.ShapeDtypeStruct((batch, 1, latent_height, latent_width, config.z_dim), dtype)
  found: list[tuple[int, str]] = []
  _, cache = _drive(_chunk_calls(vae, None, z, lambda shapes: shapes, per_frame), _measure(effort, found))
  n_first = len(found)
  _drive(_chunk_calls(vae, cache, z, lambda shapes: shapes, per_frame), _measure(effort, found))
  largest, i = max((b, i) for i, (b, _) in enumerate(found))
  label = f"{found[i][1]} ({'first' if i < n_first else 'later'} chunk)"
  return StreamedMemory(tree_bytes(vae.params), tree_bytes(cache), largest, label)


def streamed_memory(vae_or_config: vae_model.WanVAE | WanVAEConfig, batch: int, latent_height: int,
                    latent_width: int, dtype: jnp.dtype | None = None, *,
                    frames_at_once: bool = False) -> StreamedMemory:
  """`streamed_decode_memory`'s parts: weights, cache, the largest program's own bytes and its name."""
  if isinstance(vae_or_config, WanVAEConfig):
    config, dtype = vae_or_config, jnp.float32 if dtype is None else dtype
  else:
    config, dtype = vae_or_config.config, vae_or_config.dtype if dtype is None else dtype
  return _streamed_memory(config, batch, latent_height, latent_width, np.dtype(dtype), not frames_at_once)


def streamed_decode_memory(vae_or_config: vae_model.WanVAE | WanVAEConfig, batch: int, latent_height: int,
                           latent_width: int, dtype: jnp.dtype | None = None, *,
                           frames_at_once: bool = False) -> int:
  """Peak device bytes of `decode_streamed` on [B, C, F, Hl, Wl] latents, from abstract inputs.

  Args:
    vae_or_config: the model (only its config and dtype are used) or a config.
    batch, latent_height, latent_width: B, Hl, Wl.
    dtype: the parameters' dtype; None: the model's, or fp32 for a config.
    frames_at_once: as in `decode_streamed` (default: frame by frame).

  Returns:
    All the weights + the whole cache (its shapes from the first chunk, `jax.eval_shape`) + the
    largest over every first- and later-chunk program of XLA's `memory_analysis()` (arguments +
    outputs + temporaries - aliased) less the weights and cache entries it holds (already counted),
    plus the activations held beside it: group inputs kept for a shortcut, and (frame by frame)
    the frames its layer has yet to run and those it has made. Compiled for the default backend at its
    decode effort, once per process for each distinct program (cached). Not counted: the video,
    on the host.
  """
  return streamed_memory(vae_or_config, batch, latent_height, latent_width, dtype).total
