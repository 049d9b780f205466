"""Blockwise local attention with two exact paths sharing one block structure.

* LSE scan: online softmax in base 2 (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022,
  Alg. 1): running max m, running sum l, rescaling of (o, l) whenever m grows.
* fixed-m: m is pinned per row from a Cauchy-Schwarz bound (`attention.fixed_m`, DESIGN.md section 4),
  so there is no running max and no rescaling: l and o are plain sums.

Both use one carry layout (o, l, m) so a ring step can pick either at run time (`attend`'s mode
"auto": a `lax.cond` for XLA, a branch inside the one kernel for Pallas). The logits
reach the kernels multiplied by scale * log2(e) (folded into q once, or applied to the fp32 logits
for bf16 q: `query_scaling`) so the kernels use exp2. One block set-up (`block_layout.BlockLayout`)
pads T and S to block multiples, and `attend` masks the padded key slots itself. The settings
(`BlockSizes`, backends, implementation names) live in `attention.settings`. Internal layout is
heads-major: q [B, K, G, T, H] (N = K * G, query head n = k * G + g reads kv head k), k/v
[B, K, S, H]. One whole attention (a `Start` to the finished output: one device's, the halo
paths') hands `attend` its operands unpadded; the Pallas kernels read them as they are, with no
pad or unpad copy around them, and the XLA loops pad them.

Shapes: B batch, T query tokens, S key tokens, N query heads, K kv heads, G = N // K, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp

from attention import fixed_m as fm
from attention import heads
from attention import kernels
from attention.carry import Carry, Start, finish
from attention.masks import key_mask, validate_qkv
from attention.block_layout import BlockLayout
from attention.settings import IMPLEMENTATIONS, BlockSizes, matmul_precision, resolve_backend

Mode = Literal["lse", "fixed_m", "auto"]
def query_scaling(q: jax.Array, scale: float, q_prescaled: bool) -> tuple[jax.Array, float]:
  """How q meets the base-2 kernels with at most one rounding of q: returns (q_in, logit_scale).

  The kernels compute s = (q_in . k) * logit_scale in fp32 and use exp2, so q_in * logit_scale must
  equal q * scale * log2(e):
    * q_prescaled: q already carries the factor (e.g. `producers.rmsnorm_rope` applies it in fp32
      before its one rounding): (q, 1).
    * fp32 q: the factor is folded into q in fp32 (one fp32 rounding, no per-logit multiply).
    * bf16 / fp16 q: q is used as given and the fp32 logits are scaled, so q is not rounded a
      second time (re-rounding q * scale * log2(e) to bf16 doubles q's error; with logit spreads of
      4 it made the output error 8x that of `jax.nn.dot_product_attention`).
  """
  if q_prescaled:
    return q, 1.0
  factor = float(scale) * fm.LOG2E
  if jnp.finfo(q.dtype).bits >= 32:
    return (q.astype(jnp.float32) * factor).astype(q.dtype), 1.0
  return q, factor


def _block_update(carry: Carry, q, k, v, mask, mode: Mode, logit_scale: float) -> Carry:
  """One [T_blk, S_blk] block: q [B,K,G,Tb,H], k/v [B,K,Sb,H], mask None or bool [B|1, Tb, Sb]."""
  prec = matmul_precision(q.dtype)
  s = jnp.einsum("BKGTH,BKSH->BKGTS", q, k, preferred_element_type=jnp.float32, precision=prec)
  if logit_scale != 1.0:
    s = s * logit_scale
  if mask is not None:
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
  if mode == "fixed_m":
    p = jnp.exp2(s - carry.m[..., None])
    l = carry.l + jnp.sum(p, axis=-1)
    o = carry.o + jnp.einsum(
        "BKGTS,BKSH->BKGTH", p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=prec)
    return Carry(o, l, carry.m)
  m_new = jnp.maximum(carry.m, jnp.max(s, axis=-1))
  m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with no key yet stay at l = o = 0
  alpha = jnp.exp2(carry.m - m_safe)
  p = jnp.exp2(s - m_safe[..., None])
  l = alpha * carry.l + jnp.sum(p, axis=-1)
  o = alpha[..., None] * carry.o + jnp.einsum(
      "BKGTS,BKSH->BKGTH", p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=prec)
  return Carry(o, l, m_new)


def attend(
    carry: Carry,
    q_BKGTH: jax.Array,
    k_BKSH: jax.Array,
    v_BKSH: jax.Array | None,
    *,
    mode: Mode,
    layout: BlockLayout,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    kv_limit: jax.Array | None = None,
    window: int | None = None,
    causal: bool = False,
    logit_scale: float = 1.0,
    fixed: jax.Array | None = None,
    finish_to=None,
) -> Carry | jax.Array:
  """Accumulates the keys k/v into the carry of queries q, block by block.

  The one dispatch of every blockwise path: `layout.backend` "xla" runs `lax.map` over query blocks
  and `lax.scan` over key blocks; "pallas" runs the same arithmetic as one kernel call
  (`attention.kernels.attend_kernel`: Mosaic on TPU, Triton on GPU, interpret mode elsewhere).
  It stays one piece: its argument checks, the key/query block splits and the scan over key
  blocks are one linear schedule sharing the same local shapes, and read best top to bottom.

  Args:
    carry: a `Carry` from `init_carry` or a previous `attend` (e.g. the previous ring step), T_pad
      rows; or a `Start` (an empty carry the Pallas kernel builds in VMEM, `attention.carry`).
    q_BKGTH: queries, T_pad rows (`layout.pad_q`), or T with a Start and `finish_to` (one whole
      attention: unpadded, read as they are by the Pallas kernels); q * logit_scale = q * scale *
      log2(e). Or
      `heads.Heads` of a heads-major buffer: its N = K * G query heads (USP's received buffer).
    k_BKSH, v_BKSH: keys/values, S_pad slots (`layout.pad_kv`), or S as q. Slots >= layout.S are masked here,
      always: callers cannot forget the block padding. v_BKSH None: k_BKSH is the packed K/V
      [B, 2K, S_pad, H] (keys, then values), read in place. Either may be `heads.Heads` too.
      The Pallas kernels read `Heads` in place; the XLA loops slice them out.
    mode: "lse" or "fixed_m" (must match how the carry was initialised), or "auto": fixed-m where the
      bool scalar `fixed` is true, else LSE (the carry initialised accordingly, e.g. m = where(gate,
      b, -inf)). `fixed` must be the same on every device of a mesh (the fixed-m gate's verdict):
      a `lax.cond` between the two updates (XLA's loops, or the two single-mode Pallas kernels).
    layout: the call's `BlockLayout`.
    q_pos: int [T_pad] global query positions (`layout.q_positions`).
    kv_pos: int [S_pad] global key positions (`layout.kv_positions`); slots that hold no key
      carry `PAD_POSITION`.
    kv_limit: None or int [B]: keys at positions >= it are masked.
    window, causal: as in `attention_reference`.
    logit_scale: static fp32 factor applied to the logits (see `query_scaling`).
    fixed: bool scalar, with mode "auto" only.
    finish_to: None, or a dtype: return `finish(carry)` in that dtype (the Pallas kernel writes it
      directly: no fp32 carry in HBM).

  Returns:
    The updated Carry (`finish` turns it into the output), or with `finish_to` the output
    [B, K, G, T or T_pad (q's rows), H] in that dtype.

  Raises:
    ValueError: shapes that do not match the layout; `fixed` without mode "auto" or missing with it;
      a Start whose offsets do not fit the mode (`Start.check_mode`).
  """
  B, K, G, T, H = heads.update_dims(q_BKGTH, k_BKSH, v_BKSH)
  S = k_BKSH.shape[2]
  whole, q_rows = isinstance(carry, Start) and finish_to is not None, T  # a whole attention may be unpadded
  rows_ok, slots_ok = T == layout.T_pad or (whole and T == layout.T), S == layout.S_pad or (whole and S == layout.S)
  if not (rows_ok and slots_ok) or q_pos.shape != (layout.T_pad,) or kv_pos.shape != (layout.S_pad,):
    raise ValueError(f"q rows {T}, k slots {S}, q_pos {q_pos.shape}, kv_pos {kv_pos.shape} do not "
                     f"match {layout} (T_pad={layout.T_pad}, S_pad={layout.S_pad}); pad with the layout "
                     "(unpadded operands only from a Start with finish_to)")
  bq, bk = layout.block_q, layout.block_kv
  if v_BKSH is None and k_BKSH.shape[1] != 2 * K:
    raise ValueError(f"packed K/V needs 2K = {2 * K} heads, got k {k_BKSH.shape}")
  if (mode == "auto") != (fixed is not None):
    raise ValueError(f"attend: mode {mode!r} {'needs' if mode == 'auto' else 'takes no'} `fixed` flag")
  if isinstance(carry, Start):
    carry.check_mode(mode)
  if layout.backend == "pallas":  # the same update as one Pallas kernel call (attention/kernels.py)
    finish_to = None if finish_to is None else jnp.dtype(finish_to)
    return _attend_pallas(carry, q_BKGTH, k_BKSH, v_BKSH, q_pos, kv_pos, kv_limit, fixed, mode, layout, window,
                          causal, logit_scale, finish_to)
  # The XLA loops read arrays of whole blocks: `Heads` of one buffer are sliced out, unpadded
  # operands padded (their output's padded rows dropped below).
  q_BKGTH = layout.pad_q(heads.take(q_BKGTH).reshape(B, K, G, T, H))
  k_BKSH = layout.pad_kv(heads.take(k_BKSH))
  v_BKSH = None if v_BKSH is None else layout.pad_kv(heads.take(v_BKSH))
  T, S = layout.T_pad, layout.S_pad
  if isinstance(carry, Start):
    carry = carry.materialise(q_BKGTH, logit_scale, fixed)
  if finish_to is not None:
    carry = attend(carry, q_BKGTH, k_BKSH, v_BKSH, mode=mode, layout=layout, q_pos=q_pos, kv_pos=kv_pos,
                   kv_limit=kv_limit, window=window, causal=causal, logit_scale=logit_scale, fixed=fixed)
    return finish(carry).astype(finish_to)[:, :, :, :q_rows]
  if mode == "auto":
    kw = dict(layout=layout, q_pos=q_pos, kv_pos=kv_pos, kv_limit=kv_limit, window=window, causal=causal,
              logit_scale=logit_scale)
    return jax.lax.cond(fixed, lambda c: attend(c, q_BKGTH, k_BKSH, v_BKSH, mode="fixed_m", **kw),
                        lambda c: attend(c, q_BKGTH, k_BKSH, v_BKSH, mode="lse", **kw), carry)
  nq, nk = T // bq, S // bk
  needs_mask = kv_limit is not None or window is not None or causal or layout.kv_padded
  if v_BKSH is None:
    k_BKSH, v_BKSH = k_BKSH[:, :K], k_BKSH[:, K:]

  def kv_blocks(x):  # [B, K, S, H] -> [nk, B, K, bk, H]
    return jnp.moveaxis(x.reshape(B, K, nk, bk, H), 2, 0)

  ks, vs, kps = kv_blocks(k_BKSH), kv_blocks(v_BKSH), kv_pos.reshape(nk, bk)
  block_ids = jnp.arange(nk, dtype=jnp.int32)

  def one_q_block(args):
    q_blk, c_blk, qp = args

    def step(c, xs):
      k_blk, v_blk, kp, j = xs
      mask = None
      if needs_mask:
        mask = key_mask(qp, kp, kv_valid_len=kv_limit, window=window, causal=causal)
        if layout.kv_padded:  # block padding: by slot index, independent of kv_pos
          mask = mask & ((j * bk + jnp.arange(bk)) < layout.S)[None, None, :]
      return _block_update(c, q_blk, k_blk, v_blk, mask, mode, logit_scale), None

    if nk == 1:
      return step(c_blk, (ks[0], vs[0], kps[0], block_ids[0]))[0]
    return jax.lax.scan(step, c_blk, (ks, vs, kps, block_ids))[0]

  if nq == 1:
    return one_q_block((q_BKGTH, carry, q_pos))

  def q_blocks(x, axis=3):  # split T (axis 3) into [nq, ..., bq, ...]
    shape = x.shape[:axis] + (nq, bq) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)

  def merge_q(x, axis=3):
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (T,) + x.shape[axis + 2:])

  c_blocks = Carry(q_blocks(carry.o), q_blocks(carry.l), q_blocks(carry.m))
  out = jax.lax.map(one_q_block, (q_blocks(q_BKGTH), c_blocks, q_pos.reshape(nq, bq)))
  return Carry(merge_q(out.o), merge_q(out.l), merge_q(out.m))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12, 13))
def _attend_pallas(carry, q, k, v, q_pos, kv_pos, kv_limit, fixed, mode, layout, window, causal, logit_scale,
                   finish_to):
  """`attend` as one kernel call; differentiable: the backward pass is the XLA loops' VJP (a
  recompute of the forward in XLA, then its transpose), so gradients equal the XLA path's."""
  return kernels.attend_kernel(
      carry, q, k, v, q_pos, kv_pos, kv_limit, mode=mode, bq=layout.block_q, bk=layout.block_kv,
      bkc=layout.block_kv_compute, S=layout.S,
      kv_padded=layout.kv_padded, window=window, causal=causal, logit_scale=logit_scale, fixed=fixed,
      finish_to=finish_to)


def _attend_pallas_fwd(carry, q, k, v, q_pos, kv_pos, kv_limit, fixed, mode, layout, window, causal, logit_scale,
                       finish_to):
  out = _attend_pallas(carry, q, k, v, q_pos, kv_pos, kv_limit, fixed, mode, layout, window, causal, logit_scale,
                       finish_to)
  return out, (carry, q, k, v, q_pos, kv_pos, kv_limit, fixed)


def _attend_pallas_bwd(mode, layout, window, causal, logit_scale, finish_to, residuals, cotangent):
  carry, q, k, v, q_pos, kv_pos, kv_limit, fixed = residuals
  xla = dataclasses.replace(layout, backend="xla")

  def update(carry, q, k, v):
    return attend(carry, q, k, v, mode=mode, layout=xla, q_pos=q_pos, kv_pos=kv_pos, kv_limit=kv_limit,
                  window=window, causal=causal, logit_scale=logit_scale, fixed=fixed, finish_to=finish_to)

  _, pullback = jax.vjp(update, carry, q, k, v)
  return (*pullback(cotangent), None, None, None, None)


_attend_pallas.defvjp(_attend_pallas_fwd, _attend_pallas_bwd)


def local_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    kv_valid_len: jax.Array | None = None,
    window: int | None = None,
    causal: bool = False,
    scale: float | None = None,
    implementation: str = "auto",
    block_sizes: BlockSizes | None = None,
    q_prescaled: bool = False,
    backend: str = "auto",
) -> jax.Array:
  """Exact blockwise attention on one device.

  Args:
    q: [B, T, N, H].
    k, v: [B, S, K, H], N % K == 0 (GQA: query head n reads kv head n // (N // K)).
    kv_valid_len: None or int [B]; keys at positions >= it are padding. Rows with no visible valid
      key return 0.
    window: None or w: query i sees key j only when |i - j| <= w (i - w <= j <= i with causal).
    causal: key j visible to query i only when j <= i.
    scale: logit scale, default 1 / sqrt(H).
    implementation: "lse" (online softmax), "fixed_m" (pinned max; when the gate rejects the
      input the output is all NaN, never a silently wrong number) or "auto" (the gate picks fixed-m
      when eligible, else LSE, by a `lax.cond` between the two (XLA's loops or Pallas kernels);
      with the Pallas backend and a single key block, LSE alone, which then costs the same).
    block_sizes: `BlockSizes`, default `BlockSizes.get_default(backend)` (this process's device kind).
    q_prescaled: q is already multiplied by scale * log2(e) (e.g. by `producers.rmsnorm_rope`).
    backend: "auto" (Pallas kernels on TPU and GPU, XLA elsewhere), "xla" or "pallas" (on CPU the
      kernels run in Pallas interpret mode: slow, exact). Same results either way.

  Returns:
    [B, T, N, H] in q's dtype (softmax and accumulation in fp32).

  Raises:
    ValueError: bad ranks/shapes/dtypes, N % K != 0, bad window or block sizes, or an unknown
      implementation or backend, before any compute.
  """
  validate_qkv(q, k, v, kv_valid_len=kv_valid_len, window=window)
  backend = resolve_backend(backend)
  block_sizes = check_block_sizes(block_sizes, backend)
  match implementation:
    case "auto" | "fixed_m" | "lse":
      pass
    case _:
      raise ValueError(f"unknown {implementation=}; expected one of {IMPLEMENTATIONS}")
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
  return _local_attention(
      q, k, v, kv_valid_len, window=None if window is None else int(window), causal=bool(causal),
      scale=scale, implementation=implementation, block_sizes=block_sizes,
      q_prescaled=bool(q_prescaled), backend=backend)


def check_block_sizes(block_sizes: BlockSizes | None, backend: str, platform: str | None = None,
                      device_kind: str | None = None) -> BlockSizes:
  """The call's BlockSizes: when None, the default of `backend` on `platform` and `device_kind` (the
  devices the program is compiled for, e.g. a mesh's; None: JAX's default backend and device; the
  TPU generation picks its entry, `BlockSizes.get_default`).

  Raises:
    ValueError: not a BlockSizes, or Pallas blocks that are not multiples of 128.
  """
  block_sizes = BlockSizes.get_default(backend, platform, device_kind) if block_sizes is None else block_sizes
  if not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"block_sizes must be a BlockSizes, got {block_sizes!r}")
  BlockLayout.make(1, 1, block_sizes, backend)  # the backend's own constraints
  return block_sizes


@functools.partial(jax.jit, static_argnames=("window", "causal", "scale", "implementation", "block_sizes",
                                             "q_prescaled", "backend"))
def _local_attention(q, k, v, kv_valid_len, *, window, causal, scale, implementation, block_sizes,
                     q_prescaled, backend):
  T, S, K = q.shape[1], k.shape[1], k.shape[2]
  q_in, logit_scale = query_scaling(q, scale, q_prescaled)
  layout = BlockLayout.make(T, S, block_sizes, backend)
  kv_limit = None if kv_valid_len is None else jnp.minimum(kv_valid_len.astype(jnp.int32), S)
  windowed = window is not None or causal
  q_pos, kv_pos = layout.q_positions(jnp.arange(T)), layout.kv_positions(jnp.arange(S))
  operands = layout.queries(q_in, K), layout.keys(k), layout.keys(v)  # unpadded: the kernels read them as they are

  def run(start, mode, fixed=None):
    return layout.output(attend(start, *operands, mode=mode, layout=layout, q_pos=q_pos, kv_pos=kv_pos,
                                kv_limit=kv_limit, window=window, causal=causal, logit_scale=logit_scale,
                                fixed=fixed, finish_to=q.dtype))

  def offsets(stats, c_max):
    return fm.OffsetInputs(stats.k_mean, stats.k_centred_max, c_max, windowed=windowed)

  # One key block (e.g. 512 text keys): LSE rescales nothing that fixed-m would save, so the Pallas
  # "auto" runs the LSE kernel alone (no gate statistics, one kernel in the program).
  if implementation == "lse" or (implementation == "auto" and backend == "pallas" and layout.S_pad == layout.block_kv):
    return run(Start(), "lse")
  stats, gate = fm.local_gate(q_in, logit_scale, k, v, kv_valid_len, windowed=windowed)
  if implementation == "fixed_m":
    return jnp.where(gate.eligible, run(Start(offsets(stats, gate.c_max)), "fixed_m"), jnp.nan)
  if backend == "pallas":  # the kernels' own cond on the verdict, from the fixed-m Start (as each USP ring step)
    return run(Start(offsets(stats, gate.c_max)), "auto", gate.eligible)
  return jax.lax.cond(gate.eligible, lambda: run(Start(offsets(stats, gate.c_max)), "fixed_m"),
                      lambda: run(Start(), "lse"))
