"""Layers of the Wan causal video VAE (diffusers `AutoencoderKLWan`), functional and channels-last.

Source of the math: diffusers `models/autoencoders/autoencoder_kl_wan.py` (`WanCausalConv3d`,
`WanRMS_norm`, `WanResidualBlock`, `WanAttentionBlock`, `WanResample`, `WanEncoder3d`,
`WanDecoder3d`). Shape letters follow DESIGN.md; inside the VAE a level's activations are
`[B, T, H, W, C]`: T frames, H x W pixels and C channels *at that level* (T = 1 or 4 in the encoder's
input chunks, 1, 2 or 4 in the decoder; H, W between Hl, Wl and 8Hl, 8Wl). Channels-last is the
layout `lax.conv_general_dilated` is fastest with on GPU and TPU.

The Wan 2.2 VAE (`is_residual=True`) adds `ResidualGroup`s: a down / up block's layers plus a
parameter-free shortcut of the block's input (`vae_residual.avg_down` / `dup_up`), run by the same
loop and sharing the same cache dict; its 2x2 patching happens outside the layers (`vae.py`).

Parameters are one flat dict keyed by diffusers' state-dict names (`decoder.up_blocks.0.resnets.1.
conv1.weight`), with values in JAX layout: conv kernels `[kt, kh, kw, I, O]` (2D convs get kt = 1),
biases `[O]`, RMS-norm gammas `[C]`. `param_shapes` gives the checkpoint-layout shapes for the same
keys and `to_jax_layout` converts one tensor (both, with the layer descriptions, in `topology`;
the `vae` package names `to_jax_layout`).

Feature cache. diffusers runs the encoder and decoder one time chunk at a time and, for every causal
conv with a temporal kernel of 3, keeps the last CACHE_T = 2 frames of that conv's *input*
(`feat_cache`). On the first chunk the cache is empty and the conv zero-pads instead; after a 1-frame
chunk diffusers keeps one frame and zero-pads the missing one next time. Both are exactly a 2-frame
cache that starts at zeros, which is what this module carries: `cache_out[name]` is always the last
2 frames of `concat(cache_in[name], x)`, so every chunk after the first sees the same cache shapes
and one compiled program serves them all. Two layers differ on the first chunk, reproduced by the
`first_chunk` flag:
  - upsample3d: diffusers marks its cache "Rep" and skips the time conv (1 frame stays 1 frame), and
    the next chunk's time conv zero-pads rather than seeing that frame: a zero cache.
  - downsample3d: the first chunk skips the stride-2 time conv and stores its input; later chunks
    prepend the stored last frame (a 1-frame cache) before the valid stride-2 time conv.
A causal conv with a 3x3 spatial kernel caches its input with the one row above and below already
attached (the zero padding on one device, the neighbours' rows under a height split), so a cached
entry is `[B, 2, H + 2, W, C]`.

Height split (`RowShards`, decoder only). Under `shard_map`, each of D devices holds a band of rows
at every level (at the latents h = Hp / D rows, Hp = Hl rounded up to a multiple of D; each 2x
upsample doubles the band, so the bands of every level line up). A 3x3 spatial conv needs one row
beyond each edge of its band: the neighbours' edge rows, exchanged with two `ppermute`s (zeros at the
image's top and bottom, as the zero padding). Rows past the real height (when D does not divide Hl)
are set to zero before every spatial conv reads them, so the real rows see exactly the zero padding
they see on one device; the attention block masks them as keys. The attention block (one head over
all H x W pixels of a frame) runs ring-style: D steps, each device's keys and values passed on to
the next device after each, with an online softmax in fp32 (DESIGN.md 4's LSE path, base e).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from pipelines.wan.vae import residual as vae_residual
from pipelines.wan.vae.topology import (AttnBlock, CausalConv, Layer, NormSiLU, Resample, ResBlock,
                                        ResidualGroup, Shortcut)

CACHE_T = 2  # frames of causal-conv input carried between chunks (diffusers' CACHE_T)
RMS_EPS = 1e-12  # torch.nn.functional.normalize's default eps (clamps the L2 norm, not its square)
LOGVAR_RANGE = (-30.0, 20.0)  # diffusers' DiagonalGaussianDistribution clamp

Params = Mapping[str, jax.Array]
Cache = dict[str, jax.Array]
_CONV_DIMS = ("NDHWC", "DHWIO", "NDHWC")
_CONV2D_DIMS = ("NHWC", "HWIO", "NHWC")


# ----------------------------------------------------------------------------------------------
# Height split


@dataclasses.dataclass(frozen=True)
class RowShards:
  """The height split of a decode over D devices, for use inside `shard_map` over `axis`.

  Attributes:
    axis: the mesh axis name (or tuple of names) whose D devices hold the bands, in order: device
      i holds rows [i * h, (i + 1) * h) of each level (h scaled by the level's upsampling).
    devices: D.
    band: h, latent rows per device (>= 1).
    real_rows: Hl, the latents' real height (<= D * h; the rows past it are padding).
  """
  axis: str | tuple[str, ...]
  devices: int
  band: int
  real_rows: int

  def __post_init__(self):
    D, h = self.devices, self.band
    if D < 1 or h < 1 or not D * (h - 1) < self.real_rows <= D * h:
      raise ValueError(f"bad height split {self}: needs D * (h - 1) < Hl <= D * h")

  def mask(self, x_BTHWC: jax.Array) -> jax.Array:
    """Zeros the local rows past the real height (a no-op when D divides Hl)."""
    if self.devices * self.band == self.real_rows:
      return x_BTHWC
    h = x_BTHWC.shape[2]
    factor = h // self.band  # this level's upsampling relative to the latents
    rows = lax.axis_index(self.axis) * h + jnp.arange(h)
    return jnp.where((rows < self.real_rows * factor)[:, None, None], x_BTHWC, jnp.zeros((), x_BTHWC.dtype))

  def halo(self, x_BTHWC: jax.Array) -> jax.Array:
    """[B, T, h, W, C] -> [B, T, h + 2, W, C]: the row above (from device i - 1) and below (i + 1).

    Two `ppermute`s of one row each; the first device gets zeros above, the last zeros below (what
    `ppermute` delivers to a device nobody sends to), i.e. the conv's zero padding.
    """
    D = self.devices
    if D == 1:
      return jnp.pad(x_BTHWC, ((0, 0), (0, 0), (1, 1), (0, 0), (0, 0)))
    above = lax.ppermute(x_BTHWC[:, :, -1:], self.axis, [(i, i + 1) for i in range(D - 1)])
    below = lax.ppermute(x_BTHWC[:, :, :1], self.axis, [(i + 1, i) for i in range(D - 1)])
    return jnp.concatenate([above, x_BTHWC, below], axis=2)


def _halo(rows: RowShards | None, x: jax.Array) -> jax.Array:
  """The conv input with one row of context above and below: zeros (one device) or the neighbours'."""
  if rows is None:
    return jnp.pad(x, ((0, 0), (0, 0), (1, 1), (0, 0), (0, 0)))
  return rows.halo(rows.mask(x))


# ----------------------------------------------------------------------------------------------
# Primitives (x: [B, T, H, W, C]; under a height split H is the local band)


def _conv_taps(frames: Sequence[jax.Array], w: jax.Array, b: jax.Array, stride_hw, padding_hw) -> jax.Array:
  """sum_k conv2d(frames[k], w[k]) + b, frames[k]: [B, T, H, W, I], each tap's frames folded into
  the batch; w: [kt, kh, kw, I, O] with kt == len(frames)."""
  B, T, H, W, C = frames[0].shape
  out = None
  for k, x in enumerate(frames):
    y = lax.conv_general_dilated(x.reshape(B * T, H, W, C), w[k], stride_hw, padding_hw,
                                 dimension_numbers=_CONV2D_DIMS)
    out = y if out is None else out + y
  return out.reshape(B, T, *out.shape[1:]) + b


def _pointwise_taps(frames: Sequence[jax.Array], w: jax.Array, b: jax.Array) -> jax.Array:
  """sum_k frames[k] @ w[k, 0, 0] + b as ONE matmul: a conv whose kernel is 1x1 in space
  ([kt, 1, 1, I, O]) is a matmul over channels of the kt time taps' frames [B, T, H, W, I] laid
  side by side ([..., kt I] @ [kt I, O]; channel k I + i meets w[k, 0, 0, i]). The same products
  and sums as the convolution; a compiler treats it as a matmul, not as one more distinct
  convolution (a TPU compile pays per distinct convolution)."""
  kt, _, _, I, O = w.shape
  x = frames[0] if len(frames) == 1 else jnp.concatenate(frames, axis=-1)
  return jnp.einsum("bthwi,io->bthwo", x, w.reshape(kt * I, O)) + b


def conv3d(x: jax.Array, w: jax.Array, b: jax.Array, *, stride=(1, 1, 1), padding) -> jax.Array:
  """Plain 3D conv, kernel `w: [kt, kh, kw, I, O]`, explicit ((t), (h), (w)) padding pairs.

  Compiled for CPU, with stride 1 and no padding in time (every conv here but the encoder's
  stride-2 time conv), it runs as kt 2D convs, out[t] = sum_k conv2d(x[t + k], w[k]): the same
  products, the kt partial sums added last. XLA:CPU's 3D convs are about half as fast as its 2D
  ones (0.83 s vs 0.45 s measured for a full-resolution 3x3x3 96 -> 96 conv of 4 frames at
  128 x 128); GPU and TPU convolve in 3D natively. The choice is made when the program is lowered,
  for the platform it is compiled for (`lax.platform_dependent`), so an ahead-of-time compile for
  a TPU from a CPU host gets the 3D conv.
  """
  kt = w.shape[0]
  if w.shape[1:3] == (1, 1) and tuple(stride) == (1, 1, 1) and all(tuple(p) == (0, 0) for p in padding):
    T = x.shape[1] - kt + 1
    return _pointwise_taps([x[:, k:k + T] for k in range(kt)], w, b)

  def full(x, w, b):
    return lax.conv_general_dilated(x, w, stride, padding, dimension_numbers=_CONV_DIMS) + b

  if stride[0] != 1 or tuple(padding[0]) != (0, 0):
    return full(x, w, b)

  def taps(x, w, b):
    T = x.shape[1] - kt + 1
    return _conv_taps([x[:, k:k + T] for k in range(kt)], w, b, stride[1:], padding[1:])

  return lax.platform_dependent(x, w, b, cpu=taps, default=full)


def causal_conv(p: Params, name: str, x: jax.Array, cache_in: Cache | None, cache_out: Cache,
                rows: RowShards | None = None) -> jax.Array:
  """`WanCausalConv3d` with stride 1: [B, T, H, W, I] -> [B, T, H, W, O], zero 'same' padding in space.

  A temporal kernel of 3 sees the cached last 2 input frames (zeros when `cache_in` is None) and
  updates `cache_out[name]`; a temporal kernel of 1 is pointwise in time and uses no cache. A 3x3
  spatial kernel first attaches one row above and below (`_halo`: the zero padding, or the
  neighbours' rows under a height split), and the cache keeps the rows so attached. Compiled for CPU each
  time tap's frames are cut from cache and input directly (the last tap is the input itself), so
  neither the [T + 2]-frame concatenation nor copies of it are made.
  """
  w, b = p[f"{name}.weight"], p[f"{name}.bias"]
  kt, kh, kw = w.shape[:3]
  padding = ((0, 0), (0, 0), (kw // 2, kw // 2))
  if kh > 1:
    x = _halo(rows, x)
  if kt > 1:
    prev = cache_in[name] if cache_in is not None else jnp.zeros((x.shape[0], kt - 1, *x.shape[2:]), x.dtype)
    cache_out[name] = jnp.concatenate([prev[:, -CACHE_T:], x], axis=1)[:, -CACHE_T:]
    if (kh, kw) == (1, 1):  # a time-only kernel (upsample3d's time_conv): one matmul
      T = x.shape[1]
      return _pointwise_taps([jnp.concatenate([prev[:, k:], x], axis=1)[:, :T] for k in range(kt - 1)] + [x], w, b)

    def taps(prev, x, w, b):
      T = x.shape[1]
      frames = [jnp.concatenate([prev[:, k:], x], axis=1)[:, :T] for k in range(kt - 1)] + [x]
      return _conv_taps(frames, w, b, (1, 1), padding[1:])

    def full(prev, x, w, b):
      return lax.conv_general_dilated(jnp.concatenate([prev, x], axis=1), w, (1, 1, 1), padding,
                                      dimension_numbers=_CONV_DIMS) + b

    return lax.platform_dependent(prev, x, w, b, cpu=taps, default=full)  # see `conv3d`
  return conv3d(x, w, b, padding=padding)


def rms_norm(x: jax.Array, gamma: jax.Array) -> jax.Array:
  """`WanRMS_norm`: F.normalize over channels (L2 norm clamped at 1e-12) * sqrt(C) * gamma.

  The statistic is fp32 for every input dtype; the normalised value is cast back before the scale,
  as diffusers does for bf16/fp16.
  """
  x32 = x.astype(jnp.float32)
  norm = jnp.sqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True))
  return (x32 / jnp.maximum(norm, RMS_EPS)).astype(x.dtype) * (x.shape[-1] ** 0.5) * gamma


def res_block(p: Params, blk: ResBlock, x: jax.Array, cache_in: Cache | None, cache_out: Cache,
              rows: RowShards | None = None) -> jax.Array:
  """`WanResidualBlock` (dropout is inference-off): [B, T, H, W, in_dim] -> [B, T, H, W, out_dim]."""
  n = blk.name
  h = causal_conv(p, f"{n}.conv_shortcut", x, cache_in, cache_out) if blk.in_dim != blk.out_dim else x
  x = jax.nn.silu(rms_norm(x, p[f"{n}.norm1.gamma"]))
  x = causal_conv(p, f"{n}.conv1", x, cache_in, cache_out, rows)
  x = jax.nn.silu(rms_norm(x, p[f"{n}.norm2.gamma"]))
  x = causal_conv(p, f"{n}.conv2", x, cache_in, cache_out, rows)
  return x + h


def _ring_attention(rows: RowShards, q_XSC: jax.Array, k_XSC: jax.Array, v_XSC: jax.Array,
                    width: int) -> jax.Array:
  """Single-head softmax attention of the local pixels to every real pixel of the frame, ring-style.

  q, k, v: [X, S, C], S = h * W local pixels (X = frames). D steps: at step i the device holds the
  keys/values of band (me - i) mod D and passes them on with one `ppermute` of the packed k/v
  (none after the last step). Online softmax in fp32 (running max m, sum l, output o; masked
  keys -inf, a fully masked band guarded); keys in padded rows are masked by their global row.
  Returns o / l in v's dtype.
  """
  D, X, S, C = rows.devices, *q_XSC.shape
  h = S // width
  factor = h // rows.band
  me = lax.axis_index(rows.axis)
  kv = jnp.stack([k_XSC, v_XSC])
  m = jnp.full((X, S, 1), -jnp.inf, jnp.float32)
  l = jnp.zeros((X, S, 1), jnp.float32)
  o = jnp.zeros((X, S, C), jnp.float32)
  key_row = jnp.arange(S) // width
  for step in range(D):
    src = (me - step) % D
    logits = jnp.einsum("XSC,XRC->XSR", q_XSC, kv[0], preferred_element_type=jnp.float32) * (C ** -0.5)
    if D * rows.band != rows.real_rows:
      valid = src * h + key_row < rows.real_rows * factor
      logits = jnp.where(valid, logits, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1, keepdims=True))
    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    probs = jnp.exp(logits - shift)
    alpha = jnp.exp(m - shift)
    l = alpha * l + jnp.sum(probs, axis=-1, keepdims=True)
    o = alpha * o + jnp.einsum("XSR,XRC->XSC", probs.astype(v_XSC.dtype), kv[1],
                               preferred_element_type=jnp.float32)
    m = m_new
    if step < D - 1:
      kv = lax.ppermute(kv, rows.axis, [(i, (i + 1) % D) for i in range(D)])
  return (o / jnp.where(l > 0, l, 1.0)).astype(v_XSC.dtype)


def attn_block(p: Params, blk: AttnBlock, x_BTHWC: jax.Array, rows: RowShards | None = None) -> jax.Array:
  """`WanAttentionBlock`: per-frame single-head attention over H*W pixels, scale 1/sqrt(C).

  Logits and softmax are fp32 (`preferred_element_type`); the block is frame-local, so it needs no
  cache. Memory: one [H*W, H*W] fp32 score matrix per frame (156 MB at 480p latents, 60 x 104).
  Under a height split (`rows`) each device attends its own pixels to the whole frame ring-style
  (`_ring_attention`: [h*W, h*W] scores per step).
  """
  n = blk.name
  B, T, H, W, C = x_BTHWC.shape
  h = rms_norm(x_BTHWC, p[f"{n}.norm.gamma"])
  qkv = conv3d(h, p[f"{n}.to_qkv.weight"], p[f"{n}.to_qkv.bias"], padding=((0, 0),) * 3)
  qkv_XSC = qkv.reshape(B * T, H * W, 3 * C)  # X = B * T frames, S = H * W pixels
  q, k, v = jnp.split(qkv_XSC, 3, axis=-1)
  if rows is None:
    logits = jnp.einsum("XSC,XRC->XSR", q, k, preferred_element_type=jnp.float32) * (C ** -0.5)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    o_XSC = jnp.einsum("XSR,XRC->XSC", probs, v)
  else:
    o_XSC = _ring_attention(rows, q, k, v, W)
  o = conv3d(o_XSC.reshape(B, T, H, W, C), p[f"{n}.proj.weight"], p[f"{n}.proj.bias"], padding=((0, 0),) * 3)
  return x_BTHWC + o


def _fold_taps(w: jax.Array, axis: int, phase: int) -> jax.Array:
  """A 3-tap kernel axis seen by output phase 0 or 1 of a 2x nearest upsample: 2 taps."""
  w0, w1, w2 = jnp.split(w, 3, axis=axis)
  return jnp.concatenate([w0, w1 + w2] if phase == 0 else [w0 + w1, w2], axis=axis)


def upsample_conv(x: jax.Array, w: jax.Array, b: jax.Array, rows: RowShards | None = None) -> jax.Array:
  """2x nearest upsample then a 3x3 'same' conv, without the upsampled input: [B, T, H, W, C] ->
  [B, T, 2H, 2W, O] (`nn.Upsample(scale_factor=2, mode="nearest-exact")` + `nn.Conv2d(C, O, 3,
  padding=1)` of diffusers' `WanResample`).

  Output row 2i + py sees upsampled rows 2i + py - 1 .. 2i + py + 1, i.e. input rows i - 1, i, i
  (py = 0) or i, i, i + 1 (py = 1), and likewise for columns; so each of the 4 output phases is a
  2x2 conv of the input with taps summed (`_fold_taps`), and the phases interleave into the
  output. Phase (py, px) at (i, j) reads input rows i + py - 1, i + py and columns j + px - 1,
  j + px: the 2x2 window at (i + py, j + px) of the input padded by one row and one column on each
  side. So every phase runs the SAME convolution (that padding, [H + 1, W + 1] outputs) with its
  own kernel and keeps its window: one distinct convolution per upsampler for the compiler instead
  of four of different paddings (a TPU compile pays per distinct convolution: 4 -> 1 here, and
  measured on the 720p later-chunk decode program for a v6e with the matmul pointwise kernels, 360
  -> 284 s of compile CPU and 15.7 -> 13.9 GiB of temporaries). 16 C O multiply-adds per input
  pixel (plus one row and column) instead of 36, and no [2H, 2W, C] temporary. The summed taps are
  rounded once more than the reference's separate products (one rounding of a weight: ~eps
  relative, as one more term of the conv's sum).
  """
  x = _halo(rows, x)  # [B, T, H + 2, W, C]: rows -1 .. H
  B, T, H2, W, _ = x.shape
  H, O = H2 - 2, w.shape[-1]
  phases = []
  for py in (0, 1):
    row = []
    for px in (0, 1):
      k = _fold_taps(_fold_taps(w, 1, py), 2, px)  # [1, 2, 2, C, O]
      y = conv3d(x, k, b, padding=((0, 0), (0, 0), (1, 1)))  # [B, T, H + 1, W + 1, O]
      row.append(y[:, :, py:py + H, px:px + W])
    phases.append(jnp.stack(row, axis=4))  # [B, T, H, W, 2 (px), O]
  out = jnp.stack(phases, axis=3)  # [B, T, H, 2 (py), W, 2 (px), O]
  return out.reshape(B, T, 2 * H, 2 * W, O)


def resample(p: Params, blk: Resample, x: jax.Array, cache_in: Cache | None, cache_out: Cache,
             first_chunk: bool, rows: RowShards | None = None) -> jax.Array:
  """`WanResample` with diffusers' feature-cache semantics (see the module docstring).

  upsample3d: [B, T, H, W, C] -> [B, 2T, 2H, 2W, C/2] (T stays 1 on the first chunk);
  upsample2d: -> [B, T, 2H, 2W, C/2]; downsample2d: -> [B, T, H/2, W/2, C];
  downsample3d: -> [B, T/2, H/2, W/2, C] (T stays 1 on the first chunk).
  A height split (`rows`) is supported for the upsamplers (the decoder) only.

  Raises:
    ValueError: an unknown mode, or a downsampler under a height split.
  """
  n, mode = blk.name, blk.mode
  if rows is not None and mode.startswith("down"):
    raise ValueError(f"{mode} ({n}) does not run under a height split; only the decoder does")
  if mode == "upsample3d":
    if first_chunk:
      cache_out[f"{n}.time_conv"] = jnp.zeros((x.shape[0], CACHE_T, *x.shape[2:]), x.dtype)
    else:
      x = causal_conv(p, f"{n}.time_conv", x, cache_in, cache_out)  # [B, T, H, W, 2C]
      B, T, H, W, C2 = x.shape
      # torch reshapes channels as (2, C) and interleaves the pair along time: t0a, t0b, t1a, ...
      x = x.reshape(B, T, H, W, 2, C2 // 2).transpose(0, 1, 4, 2, 3, 5).reshape(B, 2 * T, H, W, C2 // 2)
  w, b = p[f"{n}.resample.1.weight"], p[f"{n}.resample.1.bias"]
  match mode:
    case "upsample2d" | "upsample3d":
      x = upsample_conv(x, w, b, rows)
    case "downsample2d" | "downsample3d":
      # nn.ZeroPad2d((0, 1, 0, 1)) pads right and bottom only, then a valid stride-2 3x3 conv.
      x = conv3d(x, w, b, stride=(1, 2, 2), padding=((0, 0), (0, 1), (0, 1)))
    case _:
      raise ValueError(f"unknown resample {mode=}")
  if mode == "downsample3d":
    key = f"{n}.time_conv"
    if first_chunk:
      cache_out[key] = x[:, -1:]
    else:
      last = x[:, -1:]
      x = conv3d(jnp.concatenate([cache_in[key], x], axis=1), p[f"{key}.weight"], p[f"{key}.bias"],
                 stride=(2, 1, 1), padding=((0, 0),) * 3)
      cache_out[key] = last
  return x


def run_layers(p: Params, layers: Sequence[Layer], x: jax.Array, cache_in: Cache | None, *,
               first_chunk: bool, rows: RowShards | None = None) -> tuple[jax.Array, Cache]:
  """Runs an encoder or decoder layer sequence on one time chunk; returns (output, new cache).

  `cache_in` is None exactly on the first chunk (all caches start at zeros); the returned cache has
  the same keys and shapes for every chunk, so later chunks share one compiled program. `rows`: the
  height split when called inside `shard_map` (decoder layers only), else None.
  """
  cache_out: Cache = {}
  x = _run(p, layers, x, cache_in, cache_out, first_chunk, rows)
  return x, cache_out


def shortcut(s: Shortcut, x: jax.Array, first_chunk: bool) -> jax.Array:
  """A `ResidualGroup`'s parameter-free shortcut of its input x [B, T, H, W, C] (`vae_residual`)."""
  if s.kind == "avg_down":
    return vae_residual.avg_down(s, x)
  return vae_residual.dup_up(s, x, first_chunk)


def _run(p: Params, layers: Sequence[Layer], x: jax.Array, cache_in: Cache | None, cache_out: Cache,
         first_chunk: bool, rows: RowShards | None) -> jax.Array:
  """`run_layers`' loop, writing every cached conv's new cache into `cache_out` (keys are unique
  conv names, so a `ResidualGroup`'s body shares the one dict)."""
  for layer in layers:
    match layer:
      case CausalConv():
        x = causal_conv(p, layer.name, x, cache_in, cache_out, rows)
      case ResBlock():
        x = res_block(p, layer, x, cache_in, cache_out, rows)
      case AttnBlock():
        x = attn_block(p, layer, x, rows)
      case Resample():
        x = resample(p, layer, x, cache_in, cache_out, first_chunk, rows)
      case NormSiLU():
        x = jax.nn.silu(rms_norm(x, p[f"{layer.name}.gamma"]))
      case ResidualGroup():
        body = _run(p, layer.body, x, cache_in, cache_out, first_chunk, rows)
        x = body if layer.shortcut is None else body + shortcut(layer.shortcut, x, first_chunk)
      case _:
        raise ValueError(f"unknown layer {layer=}")
  return x
