"""Pallas kernels for the blockwise block update of both exact paths (TPU Mosaic and GPU Triton).

One kernel call does what `blockwise.attend` does with `lax.map`/`lax.scan`: it folds all key blocks
of one key set into the running (o, l, m) carry of every query block, with the same arithmetic
(base 2, fp32 logits and accumulation, inputs in their own dtype for the two matmuls):

* fixed-m: m is pinned per row (`fixed_m.offsets_of_rows`); p = 2^(s - m), l += sum p, o += p v.
* LSE: online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022, Alg. 1):
  m' = max(m, rowmax s), alpha = 2^(m - m'), l = alpha l + sum 2^(s - m'), o = alpha o + p v.
* auto: either of the two, chosen by a runtime flag (the fixed-m gate's verdict, the same on every
  device of a mesh): a `lax.cond` between the two single-mode kernel calls. (One TPU kernel whose
  key loop branched on the flag in SMEM ran at LSE's speed even on the fixed-m path: on a v5e at
  [2, 32760, 12, 128] bf16, 86.2 ms against fixed-m's 74.7 ms and the cond's 75.7 ms, gate included.)

Masks are computed inside the kernel from positions and lengths, never read as dense arrays:
the query and key global positions (int32 vectors, one entry per row/slot), the per-batch valid key
count `kv_limit` (scalar-prefetched into SMEM on TPU), the static real slot count S (block padding)
and the static window / causal flags (block padding alone: the TPU kernel masks only the key blocks
past slot S, a branch on the block index, and skips the mask's work on the others). GQA on TPU: the G query heads of a kv head share one tile
(G x bq rows against one K/V block), so K/V are read once per kv head; on GPU each query head is
its own program (Triton cannot slice a tile) and the group's K/V reads meet in L2.

TPU (`_tpu_call`): grid (B, K, ceil(T / bq), ceil(S / bk)), the key axis innermost and sequential
("arbitrary"); the carry lives in VMEM scratch across it, with the row statistics as columns
[rows, 128] (the layout the VPU wants; m repeated along the lanes, l as 128 lane partial sums added
up on the last key block, so no cross-lane reduction per key block) and converted from/to the
carry's [G, T] rows once per query block by a 2D transpose. A key block may be computed in chunks of
bkc keys (`BlockSizes.block_kv_compute`, as splash attention's): logits, probabilities and P V per
chunk, and in the key block that holds the padding only the chunks past slot S masked. Its operands
are padded to the blocks (USP's ring steps, the halo paths)
or, for one whole attention from a `Start` to the finished output (one device's), not: the last
query block's rows past T are computed on whatever lies past the array's end and never written,
and the last key block's slots past S are masked and their values zeroed, so no pad or unpad copy
surrounds the kernel (on a v5e, 2.7 ms of a 38.9-ms call at 32,760 tokens). GPU
(`kernels_gpu.gpu_call`): grid (B, K, G, T_pad / bq), one program per query head and block looping
over the key blocks in registers (`lax.fori_loop`), as jax's Pallas GPU flash attention; it gets
unpadded operands padded.
The carry's two ends can live in the kernel: from a `carry.Start` the TPU kernel sets o = l = 0
and m (-inf, or the fixed-m offsets of its own query tile) in VMEM on the first key block, and
with `finish_to` it writes o / l in the output dtype on the last (`_tpu_init`, `_tpu_store`). With
one key block, LSE, from a Start to the finished output (the text cross-attention), there is no
carry at all: the tile's softmax and P V are computed and written at once (`_tpu_single`).
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
from attention import kernels_gpu
from attention.carry import Carry, Start
from attention.masks import kernel_mask
from attention.padding import pad_axis
from attention.settings import matmul_precision

LANES = 128  # TPU vector lanes; the column layout of the per-row statistics
_TRANS_B = (((1,), (1,)), ((), ()))  # q [rows, H] . k [bk, H]^T


# --- TPU (Mosaic) -----------------------------------------------------------------------------------

def _rows_to_columns(x_1R):
  """[1, R] -> [R, LANES] (each row's value repeated along the lanes): one 2D transpose."""
  return jnp.transpose(jnp.broadcast_to(x_1R, (LANES, x_1R.shape[1])))


def _fresh_offsets(q_rows, stats_ref, *, logit_scale, windowed, margin):
  """fp32 [rows, LANES]: the fixed-m offsets of this query tile (`fm.offsets_of_rows`) of rows
  q_rows [rows, H] from the stats tile [8, H] (`fm.OffsetInputs.packed`), as columns."""
  q = q_rows.astype(jnp.float32)
  if logit_scale != 1.0:
    q = q * logit_scale
  st = stats_ref[...]
  b = fm.offsets_of_rows(q, st[0:1, :], st[1:2, 0:1], st[2:3, 0:1], windowed=windowed, margin=margin)
  return jnp.broadcast_to(b, (q.shape[0], LANES))


def _tpu_init(ins, q_rows, qpos_ref, o_scr, l_scr, m_scr, qp_scr, *, start, G, bq, needs_mask, **offset_kw):
  """The first key block's set-up of the VMEM carry: read from the carry inputs (start "carry") or
  built here (o = l = 0, m = -inf or the fixed-m offsets: no zeros or offsets read from HBM)."""
  rows, H = o_scr.shape
  if start == "carry":
    o_in, l_in, m_in = ins
    o_scr[...] = o_in[...].astype(jnp.float32).reshape(rows, H)
    lane0 = jax.lax.broadcasted_iota(jnp.int32, (bq, LANES), 1) == 0
    for g in range(G):
      m_scr[g * bq:(g + 1) * bq, :] = _rows_to_columns(m_in[g:g + 1, :])
      l_scr[g * bq:(g + 1) * bq, :] = jnp.where(lane0, _rows_to_columns(l_in[g:g + 1, :]), 0.0)
  else:
    o_scr[...] = jnp.zeros(o_scr.shape, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
    if start == "offsets":
      m_scr[...] = _fresh_offsets(q_rows(), ins[0], **offset_kw)
  if needs_mask:
    qp_scr[...] = _rows_to_columns(qpos_ref[...])


def _write_finished(out_ref, o, l, *, G, bq):
  """Writes o / l (fp32 [rows, H] and [rows, 1]) in out_ref's dtype as [G, bq, H] (`carry.finish`:
  rows that saw no valid key, l = 0, give 0)."""
  o = jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0)
  out_ref[...] = o.astype(out_ref.dtype).reshape(G, bq, o.shape[1])


def _tpu_store(outs, o_scr, l_scr, m_scr, *, finish, G, bq):
  """The last key block's output: the carry, or with `finish` o / l in the output's dtype
  (`carry.finish`: no fp32 o, l, m in HBM)."""
  H = o_scr.shape[1]
  if finish:
    _write_finished(outs[0], o_scr[...], jnp.sum(l_scr[...], axis=1, keepdims=True), G=G, bq=bq)
    return
  o_out, l_out, m_out = outs
  o_out[...] = o_scr[...].reshape(G, bq, H)
  for g in range(G):
    m_out[g:g + 1, :] = jnp.transpose(m_scr[g * bq:(g + 1) * bq, :])[:1, :]
    l_out[g:g + 1, :] = jnp.sum(jnp.transpose(l_scr[g * bq:(g + 1) * bq, :]), axis=0, keepdims=True)


def _lane_sums(p):
  """fp32 [rows, n] -> [rows, LANES]: the sums of p's 128-lane column groups (n a multiple of 128),
  by VPU adds alone; the carry's l keeps these partial sums and adds its lanes up once, on the last
  key block (`_tpu_store`), instead of a cross-lane reduction per key block."""
  acc = p[:, :LANES]
  for c in range(LANES, p.shape[1], LANES):
    acc = acc + p[:, c:c + LANES]
  return acc


def _fixed_m_update(chunks, o_scr, l_scr, m_scr, prec):
  """One key block into the VMEM carry with m pinned, a chunk (s fp32 [rows, n], v [n, H]) at a
  time: p = 2^(s - m), l += sum p (lane partials, `_lane_sums`), o += p v."""
  m, l, o = m_scr[:, :1], l_scr[...], o_scr[...]
  for s, v in chunks:
    p = jnp.exp2(s - m)
    l = l + _lane_sums(p)
    o = o + jax.lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=prec)
  l_scr[...], o_scr[...] = l, o


def _lse_update(chunks, o_scr, l_scr, m_scr, prec):
  """One key block into the VMEM carry by the online softmax (module docstring), a chunk at a time
  (as `_fixed_m_update`)."""
  m, l, o = m_scr[...], l_scr[...], o_scr[...]
  for s, v in chunks:
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet stay at l = o = 0
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s - m_safe[:, :1])
    l = alpha * l + _lane_sums(p)
    o = alpha[:, :1] * o + jax.lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=prec)
    m = m_new
  m_scr[...], l_scr[...], o_scr[...] = m, l, o


def _tpu_single(s, v, out_ref, *, G, bq, prec):
  """The whole attention of a query tile over one key block (LSE from a Start, finished: text
  cross-attention's 512 keys): m = rowmax s, p = 2^(s - m), o = p v / sum p, written in the output's
  dtype. The values `_lse_update` from the empty carry and `_tpu_store` give (alpha = 0 there), with
  no VMEM carry set up, rescaled or read back."""
  m = jnp.max(s, axis=1, keepdims=True)
  p = jnp.exp2(s - jnp.where(m == -jnp.inf, 0.0, m))  # rows with no visible key: l = o = 0
  l = jnp.sum(_lane_sums(p), axis=1, keepdims=True)  # the carry path's order of the sums
  o = jax.lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=prec)
  _write_finished(out_ref, o, l, G=G, bq=bq)


def single_block_path(start: str, finish: bool, key_blocks: int) -> bool:
  """Whether the TPU kernel takes `_tpu_single`: one key block, from an LSE Start (`_start_kind`
  "lse", which `Start.check_mode` admits only with mode "lse"), finished."""
  return key_blocks == 1 and start == "lse" and finish


def _tpu_kernel(lim_ref, q_ref, k_ref, v_ref, qpos_ref, kpos_ref, *refs, mode, start, finish, G, bq,
                bk, bkc, S, kv_slots, kv_padded, use_limit, window, causal, logit_scale, windowed, margin, single):
  n_in = {"carry": 3, "offsets": 1, "lse": 0}[start]
  n_out = 1 if finish else 3
  ins, outs, (o_scr, l_scr, m_scr, qp_scr) = refs[:n_in], refs[n_in:n_in + n_out], refs[n_in + n_out:]
  b, j = pl.program_id(0), pl.program_id(3)
  rows, H = G * bq, o_scr.shape[1]
  q_rows = lambda: q_ref[...].reshape(rows, H)  # noqa: E731
  needs_mask = use_limit or kv_padded or causal or window is not None
  q, prec = q_rows(), matmul_precision(q_ref.dtype)

  def scores(masked, c, n):  # fp32 logits [rows, n] of the block's keys c .. c + n - 1
    s = jax.lax.dot_general(q, k_ref[c:c + n, :], _TRANS_B, preferred_element_type=jnp.float32, precision=prec)
    if logit_scale != 1.0:
      s = s * logit_scale
    if masked:
      slot = j * bk + c + jax.lax.broadcasted_iota(jnp.int32, (1, n), 1)
      mask = kernel_mask(qp_scr[:, :1], kpos_ref[:, c:c + n], slot, limit=lim_ref[b] if use_limit else None, S=S,
                         kv_padded=kv_padded, window=window, causal=causal)
      s = jnp.where(mask[None], s.reshape(G, bq, n), -jnp.inf).reshape(rows, n)
    return s

  def values(masked, c, n):
    v = v_ref[c:c + n, :]
    if masked and kv_padded:
      # Unpadded K/V (one whole attention): the last block's slots >= S are read past the array's
      # end (undefined, maybe NaN); their logits are masked above, and their values are zeroed so
      # that 0 * NaN joins no sum (padded K/V hold zeros there: the same values).
      slot = j * bk + c + jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0)
      v = jnp.where(slot < S, v, jnp.zeros_like(v))
    return v

  pad_only = not (use_limit or causal or window is not None)
  # With pad_only and at most one key block past slot S (the operands padded to the blocks, or not),
  # the masked block is the one starting at last_start, and its chunks before slot S need no mask.
  last_start = (S - 1) // bk * bk if kv_slots - S < bk else None

  def chunks(masked):  # the key block bkc keys at a time (static slices: the loop is unrolled)
    return ((scores(m, c, bkc), values(m, c, bkc)) for c in range(0, bk, bkc)
            for m in [masked and (not pad_only or last_start is None or last_start + c + bkc > S)])

  if single:
    if needs_mask:
      qp_scr[...] = _rows_to_columns(qpos_ref[...])
    _tpu_single(scores(needs_mask, 0, bk), values(needs_mask, 0, bk), outs[0], G=G, bq=bq, prec=prec)
    return
  pl.when(j == 0)(functools.partial(
      _tpu_init, ins, q_rows, qpos_ref, o_scr, l_scr, m_scr, qp_scr, start=start, G=G, bq=bq,
      needs_mask=needs_mask, logit_scale=logit_scale, windowed=windowed, margin=margin))
  _tpu_key_block(functools.partial(_tpu_update, chunks, (o_scr, l_scr, m_scr), prec, mode), j,
                 bk=bk, S=S, needs_mask=needs_mask, pad_only=pad_only)
  pl.when(j == pl.num_programs(3) - 1)(functools.partial(_tpu_store, outs, o_scr, l_scr, m_scr, finish=finish,
                                                           G=G, bq=bq))


def _tpu_update(chunks, carry_scr, prec, mode, masked):
  """One key block into the VMEM carry, by `mode` ("fixed_m" or "lse"), a chunk of keys at a time."""
  update = _fixed_m_update if mode == "fixed_m" else _lse_update
  update(chunks(masked), *carry_scr, prec)


def _tpu_key_block(update, j, *, bk, S, needs_mask, pad_only):
  """Runs `update(masked)` for key block j: with only block padding to mask (`pad_only`), it lies in
  the key blocks past slot S (the last one), so every other block skips the mask's iota, compares
  and selects over its [rows, bk] scores (and in the last one, the chunks before slot S do)."""
  if needs_mask and pad_only:
    padded = (j + 1) * bk > S
    pl.when(padded)(lambda: update(True))
    pl.when(jnp.logical_not(padded))(lambda: update(False))
  else:
    update(needs_mask)


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


def _tpu_operands(q, k, v, *, bq, bk):
  """What the TPU kernel reads: ((B, K, G, nq, nk, H), [q, k, v] arrays, their BlockSpecs, the
  output's BlockSpec and shape), from q [B, K, G, T, H] (or `Heads`), k/v [B, K, S, H] (or `Heads`,
  or the packed K/V), padded to the blocks or not: the grid covers T and S in ceil-divided blocks."""
  sq = pl.squeezed
  B, K, G, T, H = heads.update_dims(q, k, v)
  (q, q_off), (k, k_off) = heads.split(q), heads.split(k)
  (v, v_off) = (k, k_off + K) if v is None else heads.split(v)  # packed K/V: values K heads after keys
  q_spec = pl.BlockSpec((sq, sq, G, bq, H), lambda b, h, i, j, *_: (b, h, 0, i, 0))
  if q.ndim == 4:  # a heads-major buffer: the G query heads of kv head h are block h (+ offset)
    q_in_spec = pl.BlockSpec((sq, G, bq, H), lambda b, h, i, j, *_: (b, h + q_off // G, i, 0))
  else:
    q_in_spec = q_spec
  k_spec = pl.BlockSpec((sq, sq, bk, H), lambda b, h, i, j, *_: (b, h + k_off, j, 0))
  v_spec = pl.BlockSpec((sq, sq, bk, H), lambda b, h, i, j, *_: (b, h + v_off, j, 0))
  dims = (B, K, G, pl.cdiv(T, bq), pl.cdiv(k.shape[2], bk), H)
  return dims, [q, k, v], [q_in_spec, k_spec, v_spec], q_spec, (B, K, G, T, H)


def _tpu_call(carry, q, k, v, q_pos, kv_pos, limit, *, mode, bq, bk, bkc, S, kv_padded, use_limit,
              window, causal, logit_scale, finish_to, interpret):
  from jax.experimental.pallas import tpu as pltpu

  (B, K, G, nq, nk, H), qkv, qkv_specs, q_spec, o_shape = _tpu_operands(q, k, v, bq=bq, bk=bk)
  start = _start_kind(carry)
  offsets = carry.offsets if start == "offsets" else None
  sq = pl.squeezed
  kernel = functools.partial(
      _tpu_kernel, mode=mode, start=start, finish=finish_to is not None, G=G, bq=bq, bk=bk, bkc=bkc, S=S,
      kv_slots=nk * bk,
      kv_padded=kv_padded, use_limit=use_limit, window=window, causal=causal, logit_scale=logit_scale,
      windowed=offsets is not None and offsets.windowed, margin=fm.DEFAULT_MARGIN if offsets is None else offsets.margin,
      single=single_block_path(start, finish_to is not None, nk))
  row_spec = pl.BlockSpec((sq, sq, G, bq), lambda b, h, i, j, *_: (b, h, 0, i))
  in_specs = [*qkv_specs, pl.BlockSpec((1, bq), lambda b, h, i, j, *_: (0, i)),
              pl.BlockSpec((1, bk), lambda b, h, i, j, *_: (0, j))]
  args = [limit, *qkv, q_pos.reshape(1, nq * bq), kv_pos.reshape(1, nk * bk)]
  if start == "carry":
    in_specs += [q_spec, row_spec, row_spec]
    args += [carry.o, carry.l, carry.m]
  elif start == "offsets":
    in_specs.append(pl.BlockSpec((sq, sq, 8, H), lambda b, h, i, j, *_: (b, h, 0, 0)))
    args.append(offsets.packed())
  if finish_to is not None:
    out_specs, out_shape = [q_spec], [jax.ShapeDtypeStruct(o_shape, finish_to)]
  else:
    out_specs = [q_spec, row_spec, row_spec]
    out_shape = [jax.ShapeDtypeStruct(o_shape, jnp.float32), *[jax.ShapeDtypeStruct(o_shape[:4], jnp.float32)] * 2]
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(B, K, nq, nk), in_specs=in_specs, out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((G * bq, H), jnp.float32), pltpu.VMEM((G * bq, LANES), jnp.float32),
                      pltpu.VMEM((G * bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.int32)])
  return pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=out_shape,
      input_output_aliases={6: 0, 7: 1, 8: 2} if start == "carry" and finish_to is None else {},
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=tpu_vmem_limit(bq, bk, G, H, qkv[0].dtype.itemsize)),
      interpret=interpret,
      name=f"attend_{mode}",
  )(*args)


# --- dispatch -----------------------------------------------------------------------------------------

def _gpu_padded(carry, q, k, v, q_pos, kv_pos, limit, *, bkc, **kw):  # noqa: ARG001 (a TPU-kernel chunk)
  """The GPU kernel, which reads whole K/V columns and query blocks: unpadded operands (from a Start,
  finished) zero-padded to the positions' lengths for it, its output's padded rows dropped."""
  T = heads.update_dims(q, k, v)[3]
  if (T, k.shape[2]) == (q_pos.shape[0], kv_pos.shape[0]):
    return kernels_gpu.gpu_call(carry, q, k, v, q_pos, kv_pos, limit, **kw)
  q, k = pad_axis(heads.take(q), 3, q_pos.shape[0]), pad_axis(heads.take(k), 2, kv_pos.shape[0])
  v = None if v is None else pad_axis(heads.take(v), 2, kv_pos.shape[0])
  return [kernels_gpu.gpu_call(carry, q, k, v, q_pos, kv_pos, limit, **kw)[0][:, :, :, :T]]


KERNELS = ("tpu", "gpu")


def _call_args(carry, q, k, v, q_pos, kv_pos, limit, *, mode, bq, bk, bkc, S, kv_padded, window, causal,
               logit_scale, finish_to):
  """The kernels' checked positional arguments (carry, q, k, v, q_pos, kv_pos, limit) and
  keywords, for mode "fixed_m" or "lse" (the GPU kernel takes no `bkc`)."""
  if min(bq, bk, bkc) <= 0 or bq % LANES or bk % LANES or bkc % LANES or bk % bkc:
    raise ValueError(f"Pallas attention needs block sizes that are multiples of {LANES} and a key chunk that "
                     f"divides the key block; got bq={bq}, bk={bk}, bkc={bkc}")
  use_limit = limit is not None
  if limit is None:
    limit = jnp.zeros((q.shape[0],), jnp.int32)
  kw = dict(mode=mode, bq=bq, bk=bk, bkc=bkc, S=S, kv_padded=kv_padded, use_limit=use_limit, window=window,
            causal=causal, logit_scale=logit_scale, finish_to=None if finish_to is None else jnp.dtype(finish_to))
  return (carry, q, k, v, q_pos.astype(jnp.int32), kv_pos.astype(jnp.int32), limit.astype(jnp.int32)), kw


def attend_kernel(carry, q, k, v, q_pos, kv_pos, limit, *, mode, bq, bk, S, kv_padded, window, causal,
                  logit_scale, fixed=None, finish_to=None, kernel: str | None = None, bkc: int | None = None):
  """Runs the block update of `blockwise.attend` as one Pallas call.

  Args:
    carry: a `Carry` to continue (o fp32 [B, K, G, T_pad, H]; l, m fp32 [B, K, G, T_pad]), or a
      `Start`: the empty carry, built in VMEM by the TPU kernel on its first key block (o = l = 0,
      m = -inf for LSE or the fixed-m offsets of `Start.offsets`; in mode "auto", -inf where not `fixed`),
      so no zeros and no offsets pass through HBM; the GPU kernel zeroes o and l itself and takes m
      from XLA.
    q: [B, K, G, T_pad, H]; k, v: [B, K, S_pad, H] (bf16 / fp32, same dtype); or v None and k the
      packed K/V [B, 2K, S_pad, H] (keys then values, as USP's ring buffer: no unpacking copy).
      Any of them may be `heads.Heads` of a heads-major buffer (q: its N = K * G query heads),
      read in place by the index maps (USP's received q/k/v buffer: no slicing copy).
      T_pad % bq == 0 and S_pad % bk == 0; slots >= S are block padding (masked here). With a
      Start and `finish_to`, q may have T rows and k, v S slots (unpadded: read as they are).
    q_pos: int32 [T_pad]; kv_pos: int32 [S_pad]: global positions (masks are built from them);
      T_pad, S_pad: the operands' rows and slots rounded up to bq and bk.
    limit: None or int32 [B]: keys at positions >= limit[b] are masked.
    mode: "lse", "fixed_m" or "auto" (fixed-m when `fixed`, else LSE: a Carry must then have been
      initialised for the path the flag picks, as `Start.materialise` does with the gate);
      window, causal: as `attention_reference`; logit_scale: static factor on the fp32 logits.
    fixed: bool scalar (traced), only with mode "auto".
    finish_to: None, or a dtype: return the finished output o / l in it (`carry.finish`) instead
      of the carry (the kernel writes it on its last key block: no fp32 o in HBM).
    kernel: None picks by the lowering platform (TPU kernel on TPU, GPU kernel on CUDA/ROCm, the
      TPU kernel in interpret mode elsewhere); "tpu" / "gpu" force one in interpret mode (tests).
    bkc: keys per chunk of the TPU kernel's key block (None: bk, one chunk), a multiple of 128
      that divides bk: each block's logits, probabilities and P V are computed bkc keys at a time
      (`BlockSizes.block_kv_compute`). The GPU kernel ignores it.

  Returns:
    The new Carry (fp32, same shapes), or with `finish_to` the output [B, K, G, T, H] (q's rows)
    in that dtype (rows that saw no valid key give 0).

  Raises:
    ValueError: block sizes that are not multiples of 128, or bkc not dividing bk; positions that are not the operands'
      lengths rounded up to the blocks; unpadded operands without a Start and `finish_to`;
      `fixed` given without mode "auto" or missing with it; a Start whose offsets do not match the
      mode (fixed-m and "auto" need them, LSE takes none).
  """
  T, S_in = heads.update_dims(q, k, v)[3], k.shape[2]
  if q_pos.shape != (-(-T // bq) * bq,) or kv_pos.shape != (-(-S_in // bk) * bk,):
    raise ValueError(f"positions {q_pos.shape}, {kv_pos.shape} are not the {T} rows and {S_in} slots rounded up "
                     f"to the blocks bq={bq}, bk={bk}")
  if (T, S_in) != (q_pos.shape[0], kv_pos.shape[0]) and not (isinstance(carry, Start) and finish_to is not None):
    raise ValueError("unpadded operands (rows or slots not a multiple of the blocks) need a Start and finish_to")
  if (mode == "auto") != (fixed is not None):
    raise ValueError(f"attend_kernel: mode {mode!r} {'needs' if mode == 'auto' else 'takes no'} `fixed` flag")
  if isinstance(carry, Start):
    carry.check_mode(mode)
  kw = dict(bq=bq, bk=bk, bkc=bk if bkc is None else bkc, S=S, kv_padded=kv_padded, window=window, causal=causal,
            logit_scale=logit_scale, finish_to=finish_to, kernel=kernel)
  if mode == "auto":  # the verdict picks one of two single-mode kernel calls (module docstring)
    lse_start = Start() if isinstance(carry, Start) else carry
    return jax.lax.cond(fixed, lambda: attend_kernel(carry, q, k, v, q_pos, kv_pos, limit, mode="fixed_m", **kw),
                        lambda: attend_kernel(lse_start, q, k, v, q_pos, kv_pos, limit, mode="lse", **kw))
  return _one_call(carry, q, k, v, q_pos, kv_pos, limit, mode=mode, **kw)


def _one_call(carry, q, k, v, q_pos, kv_pos, limit, *, kernel, **kw):
  """`attend_kernel` in mode "fixed_m" or "lse": one Pallas call on the platform's kernel."""
  args, kw = _call_args(carry, q, k, v, q_pos, kv_pos, limit, **kw)
  finish_to = kw["finish_to"]
  if kernel is not None:
    out = {"tpu": _tpu_call, "gpu": _gpu_padded}[kernel](*args, interpret=True, **kw)
  else:
    out = jax.lax.platform_dependent(
        *args,
        tpu=lambda *a: tuple(_tpu_call(*a, interpret=False, **kw)),
        cuda=lambda *a: tuple(_gpu_padded(*a, interpret=False, **kw)),
        rocm=lambda *a: tuple(_gpu_padded(*a, interpret=False, **kw)),
        default=lambda *a: tuple(_tpu_call(*a, interpret=True, **kw)))
  return out[0] if finish_to is not None else Carry(*out)

