"""Pallas kernels for the blockwise block update of both exact paths (TPU Mosaic and GPU Triton).

One kernel call does what `blockwise.attend` does with `lax.map`/`lax.scan`: it folds all key blocks
of one key set into the running (o, l, m) carry of every query block, with the same arithmetic
(base 2, fp32 logits and accumulation, inputs in their own dtype for the two matmuls):

* fixed-m: m is pinned per row (`fixed_m.offsets_of_rows`); p = 2^(s - m), l += sum p, o += p v.
* LSE: online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022, Alg. 1):
  m' = max(m, rowmax s), alpha = 2^(m - m'), l = alpha l + sum 2^(s - m'), o = alpha o + p v.
* auto: either of the two, chosen by a runtime flag (the fixed-m gate's verdict, the same on every
  device of a mesh) read from SMEM: one kernel whose key loop branches on a scalar, instead of a
  `lax.cond` between two kernel calls (half the kernels in the program; on TPU each kernel call site
  is its own code).

Masks are computed inside the kernel from positions and lengths, never read as dense arrays:
the query and key global positions (int32 vectors, one entry per row/slot), the per-batch valid key
count `kv_limit` (scalar-prefetched into SMEM on TPU), the static real slot count S (block padding)
and the static window / causal flags (block padding alone: the TPU kernel masks only the key blocks
past slot S, a branch on the block index, and skips the mask's work on the others). GQA on TPU: the G query heads of a kv head share one tile
(G x bq rows against one K/V block), so K/V are read once per kv head; on GPU each query head is
its own program (Triton cannot slice a tile) and the group's K/V reads meet in L2.

TPU (`_tpu_call`): grid (B, K, T_pad / bq, S_pad / bk), the key axis innermost and sequential
("arbitrary"); the carry lives in VMEM scratch across it, with the row statistics as columns
[rows, 128] (the layout the VPU wants) and converted from/to the carry's [G, T] rows once per query
block by a 2D transpose. GPU (`_gpu_call`): grid (B, K, G, T_pad / bq), one program per query head and
block looping over the key blocks in registers (`lax.fori_loop`), as jax's Pallas GPU flash
attention.
The carry's two ends can live in the kernel: from a `carry.Start` the TPU kernel sets o = l = 0
and m (-inf, or the fixed-m offsets of its own query tile) in VMEM on the first key block, and
with `finish_to` it writes o / l in the output dtype on the last (`_tpu_init`, `_tpu_store`).
On any other platform (CPU) the TPU kernel runs in Pallas interpret mode: slow, exact, and what the
tests check against the float64 and dense references.

Block sizes (`BlockSizes`) must be multiples of 128 here (TPU lanes; the GPU path also needs
powers of two); `BlockLayout.make(..., backend="pallas")` picks blocks that satisfy both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from attention import fixed_m as fm
from attention import heads
from attention.carry import Carry, Start

LANES = 128  # TPU vector lanes; the column layout of the per-row statistics
_TRANS_B = (((1,), (1,)), ((), ()))  # q [rows, H] . k [bk, H]^T


def _precision(dtype):
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def _mask(q_pos_col, kv_pos_row, slot_row, *, limit, S, kv_padded, window, causal):
  """Bool [bq, bk] (or None): key visible to query, from positions (q_pos_col [bq, 1] and
  kv_pos_row / slot_row [1, bk] int32; limit an int32 scalar or None)."""
  mask = None

  def both(a, b):
    return b if a is None else a & b

  if limit is not None:
    mask = both(mask, kv_pos_row < limit)
  if causal or window is not None:
    diff = q_pos_col - kv_pos_row
    if causal:
      mask = both(mask, diff >= 0)
    if window is not None:
      mask = both(mask, jnp.abs(diff) <= window)
  if kv_padded:
    mask = both(mask, slot_row < S)
  if mask is not None:
    mask = jnp.broadcast_to(mask, (q_pos_col.shape[0], kv_pos_row.shape[1]))
  return mask


# --- TPU (Mosaic) -----------------------------------------------------------------------------------

def _rows_to_columns(x_1R):
  """[1, R] -> [R, LANES] (each row's value repeated along the lanes): one 2D transpose."""
  return jnp.transpose(jnp.broadcast_to(x_1R, (LANES, x_1R.shape[1])))


def _fresh_offsets(q_ref, stats_ref, *, rows, H, logit_scale, windowed, margin):
  """fp32 [rows, LANES]: the fixed-m offsets of this query tile (`fm.offsets_of_rows`) from the
  stats tile [8, H] (`fm.OffsetInputs.packed`), as columns."""
  q = q_ref[...].reshape(rows, H).astype(jnp.float32)
  if logit_scale != 1.0:
    q = q * logit_scale
  st = stats_ref[...]
  b = fm.offsets_of_rows(q, st[0:1, :], st[1:2, 0:1], st[2:3, 0:1], windowed=windowed, margin=margin)
  return jnp.broadcast_to(b, (rows, LANES))


def _tpu_init(ins, flag_ref, q_ref, qpos_ref, o_scr, l_scr, m_scr, qp_scr, *, start, mode, G, bq, needs_mask,
              **offset_kw):
  """The first key block's set-up of the VMEM carry: read from the carry inputs (start "carry") or
  built here (o = l = 0, m = -inf or the fixed-m offsets: no zeros or offsets read from HBM)."""
  rows, H = o_scr.shape
  if start == "carry":
    o_in, l_in, m_in = ins
    o_scr[...] = o_in[...].astype(jnp.float32).reshape(rows, H)
    for g in range(G):
      m_scr[g * bq:(g + 1) * bq, :] = _rows_to_columns(m_in[g:g + 1, :])
      l_scr[g * bq:(g + 1) * bq, :] = _rows_to_columns(l_in[g:g + 1, :])
  else:
    o_scr[...] = jnp.zeros(o_scr.shape, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
    if start == "offsets":
      def pin():
        m_scr[...] = _fresh_offsets(q_ref, ins[0], rows=rows, H=H, **offset_kw)
      pl.when(flag_ref[0] != 0)(pin) if mode == "auto" else pin()
  if needs_mask:
    qp_scr[...] = _rows_to_columns(qpos_ref[...])


def _tpu_store(outs, o_scr, l_scr, m_scr, *, finish, G, bq):
  """The last key block's output: the carry, or with `finish` o / l in the output's dtype
  (`carry.finish`: no fp32 o, l, m in HBM)."""
  H = o_scr.shape[1]
  if finish:
    l = l_scr[:, :1]
    o = jnp.where(l > 0, o_scr[...] / jnp.where(l > 0, l, 1.0), 0.0)
    outs[0][...] = o.astype(outs[0].dtype).reshape(G, bq, H)
    return
  o_out, l_out, m_out = outs
  o_out[...] = o_scr[...].reshape(G, bq, H)
  for g in range(G):
    m_out[g:g + 1, :] = jnp.transpose(m_scr[g * bq:(g + 1) * bq, :])[:1, :]
    l_out[g:g + 1, :] = jnp.transpose(l_scr[g * bq:(g + 1) * bq, :])[:1, :]


def _fixed_m_update(v, o_scr, l_scr, m_scr, prec, s):
  """One key block into the VMEM carry with m pinned: p = 2^(s - m), l += sum p, o += p v."""
  p = jnp.exp2(s - m_scr[:, :1])
  l_scr[...] += jnp.sum(p, axis=1, keepdims=True)
  o_scr[...] += jax.lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=prec)


def _lse_update(v, o_scr, l_scr, m_scr, prec, s):
  """One key block into the VMEM carry by the online softmax (module docstring)."""
  m_prev = m_scr[...]
  m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet stay at l = o = 0
  alpha = jnp.exp2(m_prev - m_safe)
  p = jnp.exp2(s - m_safe[:, :1])
  l_scr[...] = alpha * l_scr[...] + jnp.sum(p, axis=1, keepdims=True)
  o_scr[...] = alpha[:, :1] * o_scr[...] + jax.lax.dot(
      p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=prec)
  m_scr[...] = m_new


def _tpu_kernel(lim_ref, flag_ref, q_ref, k_ref, v_ref, qpos_ref, kpos_ref, *refs, mode, start, finish, G, bq,
                bk, S, kv_padded, use_limit, window, causal, logit_scale, windowed, margin):
  n_in = {"carry": 3, "offsets": 1, "lse": 0}[start]
  n_out = 1 if finish else 3
  ins, outs, (o_scr, l_scr, m_scr, qp_scr) = refs[:n_in], refs[n_in:n_in + n_out], refs[n_in + n_out:]
  b, j = pl.program_id(0), pl.program_id(3)
  H = q_ref.shape[-1]
  rows = G * bq
  needs_mask = use_limit or kv_padded or causal or window is not None
  pl.when(j == 0)(functools.partial(
      _tpu_init, ins, flag_ref, q_ref, qpos_ref, o_scr, l_scr, m_scr, qp_scr, start=start, mode=mode, G=G, bq=bq,
      needs_mask=needs_mask, logit_scale=logit_scale, windowed=windowed, margin=margin))

  q = q_ref[...].reshape(rows, H)
  k, v = k_ref[...], v_ref[...]
  prec = _precision(q.dtype)

  def scores(masked):
    s = jax.lax.dot_general(q, k, _TRANS_B, preferred_element_type=jnp.float32, precision=prec)
    if logit_scale != 1.0:
      s = s * logit_scale
    if masked:
      slot = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
      mask = _mask(qp_scr[:, :1], kpos_ref[...], slot, limit=lim_ref[b] if use_limit else None, S=S,
                   kv_padded=kv_padded, window=window, causal=causal)
      s = jnp.where(mask[None], s.reshape(G, bq, bk), -jnp.inf).reshape(rows, bk)
    return s

  fixed_m_update = functools.partial(_fixed_m_update, v, o_scr, l_scr, m_scr, prec)
  lse_update = functools.partial(_lse_update, v, o_scr, l_scr, m_scr, prec)

  def block(masked):
    if mode == "auto":  # the mesh-uniform verdict, scalar-prefetched: a branch on a scalar per step
      pl.when(flag_ref[0] != 0)(lambda: fixed_m_update(scores(masked)))
      pl.when(flag_ref[0] == 0)(lambda: lse_update(scores(masked)))
    else:
      (fixed_m_update if mode == "fixed_m" else lse_update)(scores(masked))

  if needs_mask and not (use_limit or causal or window is not None):
    # Only block padding to mask: it lies in the key blocks past slot S (the last one), so every
    # other block skips the mask's iota, compares and selects over its [rows, bk] scores.
    padded = (j + 1) * bk > S
    pl.when(padded)(lambda: block(True))
    pl.when(jnp.logical_not(padded))(lambda: block(False))
  else:
    block(needs_mask)

  pl.when(j == pl.num_programs(3) - 1)(functools.partial(_tpu_store, outs, o_scr, l_scr, m_scr, finish=finish,
                                                           G=G, bq=bq))


TPU_DEFAULT_SCOPED_VMEM = 16 << 20  # XLA:TPU's scoped VMEM limit per kernel on v5e (v6e: 32 MiB)
TPU_VMEM_LIMIT_CAP = 100 << 20  # of v5e's / v6e's 128 MiB of VMEM


def tpu_vmem_bytes(bq: int, bk: int, G: int, H: int, itemsize: int) -> int:
  """An upper bound of the TPU kernel's scoped VMEM, bytes: the fp32 logits and their probabilities
  (6 B per [G bq, bk] entry), K and V tiles double-buffered, the q tile and o / carry blocks
  double-buffered, the o / l / m scratch and the row positions. Above Mosaic's own figures for every
  block pair it refused on v5e at G = 1, H = 128, bf16 (e.g. 4096 x 2048: 48.1 MiB LSE, bound 69.1;
  tests/attention/test_kernels_vmem.py)."""
  rows = G * bq
  logits = 6 * rows * bk
  kv_tiles = 2 * 2 * bk * H * itemsize
  q_o_blocks = 2 * rows * H * itemsize + 2 * 2 * rows * H * 4  # q in; o out and the carry's o in (fp32)
  scratch = rows * H * 4 + 2 * rows * LANES * 4 + bq * LANES * 4 + 2 * 2 * 2 * rows * 4  # o, l, m, positions; l/m blocks
  return logits + kv_tiles + q_o_blocks + scratch + (1 << 20)


def tpu_vmem_limit(bq: int, bk: int, G: int, H: int, itemsize: int) -> int | None:
  """The kernel's own scoped VMEM limit (Pallas TPU compiler params' vmem_limit_bytes): None (XLA's default)
  while `tpu_vmem_bytes` fits the default, else that bound up to `TPU_VMEM_LIMIT_CAP`, so large
  blocks compile without a process-wide `--xla_tpu_scoped_vmem_limit_kib` (checked ahead of time
  for v5e with libtpu 0.0.42: 4096 x 2048 compiles with it, is refused without)."""
  need = tpu_vmem_bytes(bq, bk, G, H, itemsize)
  return None if need <= TPU_DEFAULT_SCOPED_VMEM else min(need, TPU_VMEM_LIMIT_CAP)


def _start_kind(carry) -> str:
  """"carry" (a Carry to continue), "offsets" (a fixed-m Start) or "lse" (an LSE Start)."""
  if not isinstance(carry, Start):
    return "carry"
  return "lse" if carry.offsets is None else "offsets"


def _tpu_call(carry, q, k, v, q_pos, kv_pos, limit, flag, *, mode, bq, bk, S, kv_padded, use_limit,
              window, causal, logit_scale, finish_to, interpret):
  from jax.experimental.pallas import tpu as pltpu

  B, K, G, T, H = heads.update_dims(q, k, v)
  (q, q_off), (k, k_off) = heads.split(q), heads.split(k)
  (v, v_off) = (k, k_off + K) if v is None else heads.split(v)  # packed K/V: values K heads after keys
  S_pad = k.shape[2]
  nq, nk = T // bq, S_pad // bk
  start = _start_kind(carry)
  offsets = carry.offsets if start == "offsets" else None
  sq = pl.squeezed
  kernel = functools.partial(
      _tpu_kernel, mode=mode, start=start, finish=finish_to is not None, G=G, bq=bq, bk=bk, S=S,
      kv_padded=kv_padded, use_limit=use_limit, window=window, causal=causal, logit_scale=logit_scale,
      windowed=offsets is not None and offsets.windowed, margin=fm.DEFAULT_MARGIN if offsets is None else offsets.margin)
  q_spec = pl.BlockSpec((sq, sq, G, bq, H), lambda b, h, i, j, *_: (b, h, 0, i, 0))
  if q.ndim == 4:  # a heads-major buffer: the G query heads of kv head h are block h (+ offset)
    q_in_spec = pl.BlockSpec((sq, G, bq, H), lambda b, h, i, j, *_: (b, h + q_off // G, i, 0))
  else:
    q_in_spec = q_spec
  k_spec = pl.BlockSpec((sq, sq, bk, H), lambda b, h, i, j, *_: (b, h + k_off, j, 0))
  v_spec = pl.BlockSpec((sq, sq, bk, H), lambda b, h, i, j, *_: (b, h + v_off, j, 0))
  row_spec = pl.BlockSpec((sq, sq, G, bq), lambda b, h, i, j, *_: (b, h, 0, i))
  in_specs = [q_in_spec, k_spec, v_spec, pl.BlockSpec((1, bq), lambda b, h, i, j, *_: (0, i)),
              pl.BlockSpec((1, bk), lambda b, h, i, j, *_: (0, j))]
  args = [limit, flag, q, k, v, q_pos.reshape(1, T), kv_pos.reshape(1, S_pad)]
  if start == "carry":
    in_specs += [q_spec, row_spec, row_spec]
    args += [carry.o, carry.l, carry.m]
  elif start == "offsets":
    in_specs.append(pl.BlockSpec((sq, sq, 8, H), lambda b, h, i, j, *_: (b, h, 0, 0)))
    args.append(offsets.packed())
  o_shape = (B, K, G, T, H)
  if finish_to is not None:
    out_specs, out_shape = [q_spec], [jax.ShapeDtypeStruct(o_shape, finish_to)]
  else:
    out_specs = [q_spec, row_spec, row_spec]
    out_shape = [jax.ShapeDtypeStruct(o_shape, jnp.float32), *[jax.ShapeDtypeStruct(o_shape[:4], jnp.float32)] * 2]
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(B, K, nq, nk),
      in_specs=in_specs,
      out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((G * bq, H), jnp.float32), pltpu.VMEM((G * bq, LANES), jnp.float32),
                      pltpu.VMEM((G * bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.int32)])
  return pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=out_shape,
      input_output_aliases={7: 0, 8: 1, 9: 2} if start == "carry" and finish_to is None else {},
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=tpu_vmem_limit(bq, bk, G, H, q.dtype.itemsize)),
      interpret=interpret,
      name=f"attend_{mode}",
  )(*args)


# --- GPU (Triton) -----------------------------------------------------------------------------------

def _gpu_kernel(q_ref, k_ref, v_ref, qpos_ref, kpos_ref, lim_ref, *refs, mode, fresh, finish, bk, nk, H, S,
                kv_padded, use_limit, window, causal, logit_scale):
  from jax.experimental.pallas import triton as plgpu

  n_in = 1 if fresh else 3  # fresh: m only (o = l = 0 here)
  ins, outs = refs[:n_in], refs[n_in:]

  Hp = q_ref.shape[-1]
  head_ok = (jnp.arange(Hp) < H)[None, :]  # head dims that are not powers of two: masked loads
  q = plgpu.load(q_ref, mask=head_ok, other=0.0)  # [bq, Hp]
  prec = _precision(q.dtype)
  limit = lim_ref[pl.program_id(0)] if use_limit else None
  q_pos_col = qpos_ref[...][:, None]
  needs_mask = use_limit or kv_padded or causal or window is not None

  def body(j, carry):
    o, l, m = carry
    sl = pl.ds(j * bk, bk)
    k = plgpu.load(k_ref.at[sl, :], mask=head_ok, other=0.0)
    v = plgpu.load(v_ref.at[sl, :], mask=head_ok, other=0.0)
    s = jax.lax.dot_general(q, k, _TRANS_B, preferred_element_type=jnp.float32, precision=prec)
    if logit_scale != 1.0:
      s = s * logit_scale
    if needs_mask:
      slot = (j * bk + jnp.arange(bk))[None, :]
      mask = _mask(q_pos_col, kpos_ref[sl][None, :], slot, limit=limit, S=S, kv_padded=kv_padded,
                   window=window, causal=causal)
      s = jnp.where(mask, s, -jnp.inf)
    if mode == "fixed_m":
      p = jnp.exp2(s - m[:, None])
      pv = jax.lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=prec)
      return o + pv, l + jnp.sum(p, axis=1), m
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet stay at l = o = 0
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    pv = jax.lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=prec)
    return alpha[:, None] * o + pv, alpha * l + jnp.sum(p, axis=1), m_new

  if fresh:
    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(q.shape[:1], jnp.float32), ins[0][...])
  else:
    init = (plgpu.load(ins[0], mask=head_ok, other=0.0), ins[1][...], ins[2][...])
  o, l, m = jax.lax.fori_loop(0, nk, body, init)
  if finish:  # o / l in the output dtype (`carry.finish`)
    o = jnp.where(l[:, None] > 0, o / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
    plgpu.store(outs[0], o.astype(outs[0].dtype), mask=head_ok)
    return
  plgpu.store(outs[0], o, mask=head_ok)
  outs[1][...] = l
  outs[2][...] = m


GPU_SHARED_BYTES = 160 * 1024  # shared memory a Triton program may plan for: A100's 164 KiB less scratch


def gpu_pipeline_stages(bk: int, Hp: int, itemsize: int) -> int:
  """Software-pipeline depth of the GPU kernel's key loop: 2 (the next K and V tiles load while this
  one computes) where two stages of the [bk, Hp] K and V tiles fit `GPU_SHARED_BYTES`, else 1. fp32
  at bk = Hp = 128 needs 256 KiB for 2 stages, over even the H200's 227 KiB (measured: Triton's
  "Shared memory size limit exceeded: requested 262656, available: 232448")."""
  return 2 if 2 * (2 * bk * Hp * itemsize) <= GPU_SHARED_BYTES else 1


def _gpu_compiler_params(H: int, bk: int, Hp: int, itemsize: int):
  from jax.experimental.pallas import triton as plgpu

  return plgpu.CompilerParams(num_warps=4 if H <= 64 else 8, num_stages=gpu_pipeline_stages(bk, Hp, itemsize))


def _gpu_call(carry, q, k, v, q_pos, kv_pos, limit, flag, *, mode, bq, bk, S, kv_padded, use_limit,
              window, causal, logit_scale, finish_to, interpret):
  """One program per (batch, query head, query block); K/V of the head's kv head read through
  L2 by the G programs of a group (the FlashAttention GPU layout; Triton cannot slice tiles).
  "auto": a `lax.cond` on the flag between the two single-mode kernels. A `Start` carry: o = l = 0
  in the kernel, its m (-inf or the fixed-m offsets) formed by XLA."""

  fresh = isinstance(carry, Start)
  B, K, G, T, H = heads.update_dims(q, k, v)
  if fresh:
    q_BKGTH = heads.take(q).reshape(B, K, G, T, H)
    carry = Carry(None, None, carry.materialise(q_BKGTH, logit_scale, None if mode != "auto" else flag[0] != 0).m)
  if mode == "auto":
    kw = dict(bq=bq, bk=bk, S=S, kv_padded=kv_padded, use_limit=use_limit, window=window, causal=causal,
              logit_scale=logit_scale, finish_to=finish_to, interpret=interpret)
    args = (carry, q, k, v, q_pos, kv_pos, limit, flag)
    return jax.lax.cond(flag[0] != 0, lambda: tuple(_gpu_call(*args, mode="fixed_m", **kw)),
                        lambda: tuple(_gpu_call(*args, mode="lse", **kw)))

  (q, q_off), (k, k_off) = heads.split(q), heads.split(k)
  (v, v_off) = (k, k_off + K) if v is None else heads.split(v)  # packed K/V: values K heads after keys
  S_pad = k.shape[2]
  Hp = pl.next_power_of_2(H)
  Bp = pl.next_power_of_2(B)
  limit = jnp.pad(limit, (0, Bp - B))
  kernel = functools.partial(_gpu_kernel, mode=mode, fresh=carry.o is None, finish=finish_to is not None, bk=bk,
                             nk=S_pad // bk, H=H, S=S, kv_padded=kv_padded, use_limit=use_limit, window=window,
                             causal=causal, logit_scale=logit_scale)
  sq = pl.squeezed
  q_spec = pl.BlockSpec((sq, sq, sq, bq, Hp), lambda b, h, g, i: (b, h, g, i, 0))
  if q.ndim == 4:  # a heads-major buffer: query head h * G + g (+ offset)
    q_in_spec = pl.BlockSpec((sq, sq, bq, Hp), lambda b, h, g, i: (b, q_off + h * G + g, i, 0))
  else:
    q_in_spec = q_spec
  k_spec = pl.BlockSpec((sq, sq, S_pad, Hp), lambda b, h, g, i: (b, h + k_off, 0, 0))
  v_spec = pl.BlockSpec((sq, sq, S_pad, Hp), lambda b, h, g, i: (b, h + v_off, 0, 0))
  row_spec = pl.BlockSpec((sq, sq, sq, bq), lambda b, h, g, i: (b, h, g, i))
  carry_in = [carry.m] if carry.o is None else [carry.o, carry.l, carry.m]
  carry_specs = [row_spec] if carry.o is None else [q_spec, row_spec, row_spec]
  o_shape = (B, K, G, T, H)
  rows = jax.ShapeDtypeStruct(o_shape[:4], jnp.float32)
  if finish_to is not None:
    out_specs, out_shape, aliases = [q_spec], [jax.ShapeDtypeStruct(o_shape, finish_to)], {}
  else:
    out_specs, out_shape = [q_spec, row_spec, row_spec], [jax.ShapeDtypeStruct(o_shape, jnp.float32), rows, rows]
    aliases = {6: 2} if carry.o is None else {6: 0, 7: 1, 8: 2}
  return pl.pallas_call(
      kernel,
      grid=(B, K, G, T // bq),
      in_specs=[q_in_spec, k_spec, v_spec, pl.BlockSpec((bq,), lambda b, h, g, i: (i,)),
                pl.BlockSpec((S_pad,), lambda b, h, g, i: (0,)), pl.BlockSpec((Bp,), lambda b, h, g, i: (0,)),
                *carry_specs],
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=_gpu_compiler_params(H, bk, Hp, k.dtype.itemsize),
      interpret=interpret,
      name=f"attend_{mode}",
  )(q, k, v, q_pos, kv_pos, limit, *carry_in)


# --- dispatch -----------------------------------------------------------------------------------------

KERNELS = ("tpu", "gpu")


def attend_kernel(carry, q, k, v, q_pos, kv_pos, limit, *, mode, bq, bk, S, kv_padded, window, causal,
                  logit_scale, fixed=None, finish_to=None, kernel: str | None = None):
  """Runs the block update of `blockwise.attend` as one Pallas call.

  Args:
    carry: a `Carry` to continue (o fp32 [B, K, G, T_pad, H]; l, m fp32 [B, K, G, T_pad]), or a
      `Start`: the empty carry, built in VMEM by the TPU kernel on its first key block (o = l = 0,
      m = -inf for LSE or the fixed-m offsets of `Start.offsets`, in mode "auto" where `fixed`),
      so no zeros and no offsets pass through HBM; the GPU kernel zeroes o and l itself and takes m
      from XLA.
    q: [B, K, G, T_pad, H]; k, v: [B, K, S_pad, H] (bf16 / fp32, same dtype); or v None and k the
      packed K/V [B, 2K, S_pad, H] (keys then values, as USP's ring buffer: no unpacking copy).
      Any of them may be `heads.Heads` of a heads-major buffer (q: its N = K * G query heads),
      read in place by the index maps (USP's received q/k/v buffer: no slicing copy).
      T_pad % bq == 0 and S_pad % bk == 0; slots >= S are block padding (masked here).
    q_pos: int32 [T_pad]; kv_pos: int32 [S_pad]: global positions (masks are built from them).
    limit: None or int32 [B]: keys at positions >= limit[b] are masked.
    mode: "lse", "fixed_m" or "auto" (fixed-m when `fixed`, else LSE: a Carry must then have been
      initialised for the path the flag picks, as `Start.materialise` does with the gate);
      window, causal: as `attention_reference`; logit_scale: static factor on the fp32 logits.
    fixed: bool scalar (traced), only with mode "auto".
    finish_to: None, or a dtype: return the finished output o / l in it (`carry.finish`) instead
      of the carry (the kernel writes it on its last key block: no fp32 o in HBM).
    kernel: None picks by the lowering platform (TPU kernel on TPU, GPU kernel on CUDA/ROCm, the
      TPU kernel in interpret mode elsewhere); "tpu" / "gpu" force one in interpret mode (tests).

  Returns:
    The new Carry (fp32, same shapes), or with `finish_to` the output [B, K, G, T_pad, H] in that
    dtype (rows that saw no valid key give 0).

  Raises:
    ValueError: block sizes that do not divide the padded lengths or are not multiples of 128;
      `fixed` given without mode "auto" or missing with it; a Start whose offsets do not match the
      mode (fixed-m and "auto" need them, LSE takes none).
  """
  T, S_pad = heads.update_dims(q, k, v)[3], k.shape[2]
  if (mode == "auto") != (fixed is not None):
    raise ValueError(f"attend_kernel: mode {mode!r} {'needs' if mode == 'auto' else 'takes no'} `fixed` flag")
  if isinstance(carry, Start):
    carry.check_mode(mode)
  if T % bq or S_pad % bk or bq % LANES or bk % LANES:
    raise ValueError(f"Pallas attention needs block sizes that are multiples of {LANES} dividing the "
                     f"padded lengths; got bq={bq}, bk={bk} for T_pad={T}, S_pad={S_pad}")
  use_limit = limit is not None
  if limit is None:
    limit = jnp.zeros((q.shape[0],), jnp.int32)
  kw = dict(mode=mode, bq=bq, bk=bk, S=S, kv_padded=kv_padded, use_limit=use_limit, window=window,
            causal=causal, logit_scale=logit_scale, finish_to=None if finish_to is None else jnp.dtype(finish_to))
  flag = jnp.zeros((1,), jnp.int32) if fixed is None else jnp.asarray(fixed, jnp.int32).reshape(1)
  args = (carry, q, k, v, q_pos.astype(jnp.int32), kv_pos.astype(jnp.int32), limit.astype(jnp.int32), flag)
  if kernel is not None:
    out = {"tpu": _tpu_call, "gpu": _gpu_call}[kernel](*args, interpret=True, **kw)
  else:
    out = jax.lax.platform_dependent(
        *args,
        tpu=lambda *a: tuple(_tpu_call(*a, interpret=False, **kw)),
        cuda=lambda *a: tuple(_gpu_call(*a, interpret=False, **kw)),
        rocm=lambda *a: tuple(_gpu_call(*a, interpret=False, **kw)),
        default=lambda *a: tuple(_tpu_call(*a, interpret=True, **kw)))
  return out[0] if finish_to is not None else Carry(*out)
