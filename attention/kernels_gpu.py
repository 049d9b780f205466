"""The GPU (Triton) kernel of the blockwise block update: one program per (batch, query head,
query block), looping over the key blocks in registers (`lax.fori_loop`), as jax's Pallas GPU flash
attention; the same arithmetic as the TPU kernel (`attention.kernels`, whose `attend_kernel` is the
one entry of both). GQA: each query head is its own program (Triton cannot slice a tile) and the
group's K/V reads meet in L2. Head dims that are not powers of two are padded in registers and
masked on load and store.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from attention import heads
from attention.carry import Carry, Start
from attention.masks import kernel_mask
from attention.settings import matmul_precision

_TRANS_B = (((1,), (1,)), ((), ()))  # q [rows, H] . k [bk, H]^T

def _gpu_kernel(q_ref, k_ref, v_ref, qpos_ref, kpos_ref, lim_ref, *refs, mode, fresh, finish, bk, nk, H, S,
                kv_padded, use_limit, window, causal, logit_scale):
  from jax.experimental.pallas import triton as plgpu

  n_in = 1 if fresh else 3  # fresh: m only (o = l = 0 here)
  ins, outs = refs[:n_in], refs[n_in:]

  Hp = q_ref.shape[-1]
  head_ok = (jnp.arange(Hp) < H)[None, :]  # head dims that are not powers of two: masked loads
  q = plgpu.load(q_ref, mask=head_ok, other=0.0)  # [bq, Hp]
  prec = matmul_precision(q.dtype)
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
      mask = kernel_mask(q_pos_col, kpos_ref[sl][None, :], slot, limit=limit, S=S, kv_padded=kv_padded,
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


def gpu_call(carry, q, k, v, q_pos, kv_pos, limit, *, mode, bq, bk, S, kv_padded, use_limit,
              window, causal, logit_scale, finish_to, interpret):
  """One program per (batch, query head, query block); K/V of the head's kv head read through
  L2 by the G programs of a group (the FlashAttention GPU layout; Triton cannot slice tiles).
  Mode "fixed_m" or "lse" (`kernels.attend_kernel` resolves "auto"). A `Start` carry: o = l = 0
  in the kernel, its m (-inf or the fixed-m offsets) formed by XLA."""

  fresh = isinstance(carry, Start)
  B, K, G, T, H = heads.update_dims(q, k, v)
  if fresh:
    q_BKGTH = heads.take(q).reshape(B, K, G, T, H)
    carry = Carry(None, None, carry.materialise(q_BKGTH, logit_scale).m)
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
