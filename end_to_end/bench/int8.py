"""What int8 can buy on this chip, in one run: matmuls and attention's QK^T, int8 against bf16.

  python -m end_to_end.bench.int8                       # 1.3B shapes: CFG batch of 2 x 32,760 tokens
  python -m end_to_end.bench.int8 --tokens 256 --seq 512 --interpret   # CPU smoke run (not a speed)

A TPU v5e's MXU multiplies int8 at twice its bf16 rate (394 vs 197 TOP/s). How much of that a step
can use is bounded by what is not a matmul. Two measurements, each against its bf16 twin:

* matmul: x [M, I] @ W [I, O] at the Wan transformer's shapes (M = --tokens, the projections and
  the feed-forward's two matmuls): bf16 x bf16 -> fp32 -> bf16; int8 x int8 -> int32; the int32
  scaled back per row and column to bf16; x quantized per row, then that; and the quantized
  `Dense` as the pipeline runs it (`transformer.dense`, weight-only and w8a8).
* attention: the smallest flash-attention kernel (`flash`: grid (heads, query blocks, key blocks),
  a fixed logit offset, no masks, no rescaling: the per-block work of our fixed-m kernel and nothing
  else) with q and k in bf16, or int8 with fp32 scales (q per row, k per head, as SageAttention's
  8-bit QK^T; P V stays bf16). Its ratio is the most int8 QK^T can give this chip's attention: QK^T
  is half the MXU work, so the bound is 4/3 where the MXU alone sets the time.

Prints median milliseconds over --repeats calls after a warm-up (compile excluded), TOP/s, and the
int8 / bf16 speed-up of each pair; --json writes the same. The attention rows also give the output
error against fp32 attention on the unquantized q and k (int8's: quantization and rounding).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pipelines.commands.help import HelpFormatter
from pipelines.storage.video_io import write_json

LANES = 128


def _flash_kernel(q_ref, k_ref, v_ref, qs_ref, o_ref, o_scr, l_scr, *, int8: bool, offset: float, nk: int):
  """One (head, query block, key block) step: s = q k^T (int8: times the row scales), p = 2^(s - offset),
  l += sum p, o += p v; the last key block writes o / l."""
  j = pl.program_id(2)

  @pl.when(j == 0)
  def _():
    o_scr[...] = jnp.zeros(o_scr.shape, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)

  q, k, v = q_ref[...], k_ref[...], v_ref[...]
  dims = (((1,), (1,)), ((), ()))
  if int8:
    s = jax.lax.dot_general(q, k, dims, preferred_element_type=jnp.int32).astype(jnp.float32) * qs_ref[:, :1]
  else:
    s = jax.lax.dot_general(q, k, dims, preferred_element_type=jnp.float32)
  p = jnp.exp2(s - offset)
  l_scr[...] += jnp.sum(p, axis=1, keepdims=True)
  o_scr[...] += jax.lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)

  @pl.when(j == nk - 1)
  def _():
    o_ref[...] = (o_scr[...] / l_scr[:, :1]).astype(o_ref.dtype)


def flash(q: jax.Array, k: jax.Array, v: jax.Array, q_scale: jax.Array, *, bq: int, bk: int, offset: float = 0.0,
          interpret: bool = False) -> jax.Array:
  """softmax(s) v per head, s in base 2: bf16 q, k (s = q k^T) or int8 (s = (q k^T) q_scale).

  Args:
    q: [N, T, H] bf16, or int8 with `q_scale` [N, T, 128] fp32 (each row's scale in every lane; the
      k scale folded in); k: [N, S, H] of q's dtype; v: [N, S, H] bf16. T % bq == S % bk == 0.
    offset: the fixed max subtracted from every logit (base 2): exact while 2^(s - offset) stays
      in fp32's range (no rescaling, as fixed-m).
  Returns:
    [N, T, H] bf16.
  """
  from jax.experimental.pallas import tpu as pltpu

  (N, T, H), S = q.shape, k.shape[1]
  int8, nk, sq = q.dtype == jnp.int8, S // bk, pl.squeezed
  return pl.pallas_call(
      functools.partial(_flash_kernel, int8=int8, offset=offset, nk=nk),
      grid=(N, T // bq, nk),
      in_specs=[pl.BlockSpec((sq, bq, H), lambda n, i, j: (n, i, 0)),
                pl.BlockSpec((sq, bk, H), lambda n, i, j: (n, j, 0)),
                pl.BlockSpec((sq, bk, H), lambda n, i, j: (n, j, 0)),
                pl.BlockSpec((sq, bq, LANES), lambda n, i, j: (n, i, 0))],
      out_specs=pl.BlockSpec((sq, bq, H), lambda n, i, j: (n, i, 0)),
      out_shape=jax.ShapeDtypeStruct((N, T, H), jnp.bfloat16),
      scratch_shapes=[pltpu.VMEM((bq, H), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                           vmem_limit_bytes=100 << 20),
      interpret=interpret,
  )(q, k, v, q_scale)


def quantize_rows(x: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
  """Symmetric int8 along `axis` (absmax / 127 per row): (int8 values, fp32 scales with axis kept)."""
  x32 = x.astype(jnp.float32)
  scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=axis, keepdims=True), 1e-30) / 127.0
  return jnp.round(x32 / scale).astype(jnp.int8), scale


def int8_attention_inputs(q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """q [N, T, H] (logits base 2 already: q k^T is s), k [N, S, H] -> int8 q (per row), int8 k (per
  head, after subtracting its mean over the keys: a per-row constant of s, which softmax ignores),
  and the merged scales [N, T, LANES]."""
  k = k.astype(jnp.float32) - jnp.mean(k.astype(jnp.float32), axis=1, keepdims=True)
  q8, q_s = quantize_rows(q)
  k8, k_s = quantize_rows(k, axis=(1, 2))
  return q8, k8, jnp.broadcast_to(q_s * k_s, (*q.shape[:2], LANES))


def time_median(fns: dict, args: dict, repeats: int) -> dict[str, float]:
  """Median seconds per call of each fn on its args, calls taken round-robin after one warm-up."""
  for name, fn in fns.items():
    jax.block_until_ready(fn(*args[name]))
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args[name]))
      times[name].append(time.perf_counter() - t0)
  return {name: statistics.median(t) for name, t in times.items()}


def attention_rows(args) -> dict:
  """The flash kernel, bf16 vs int8 QK^T, at --seq x --heads x 128: seconds, TOP/s, error vs fp32."""
  N, T, H = args.heads, args.seq, 128
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (N, T, H), jnp.float32) for key in keys)
  q = q * (H ** -0.5 * 1.4427)  # logits of unit-variance q, k in base 2
  q8, k8, qs = int8_attention_inputs(q, k)
  ones = jnp.ones((N, T, LANES), jnp.float32)
  rows, result = {}, {}
  for bq, bk in args.blocks:
    call = functools.partial(flash, bq=min(bq, T), bk=min(bk, T), offset=4.0, interpret=args.interpret)
    rows[f"bf16 {bq}x{bk}"] = (jax.jit(call), (q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), ones))
    rows[f"int8 {bq}x{bk}"] = (jax.jit(call), (q8, k8, v.astype(jnp.bfloat16), qs))
  seconds = time_median({n: f for n, (f, _) in rows.items()}, {n: a for n, (_, a) in rows.items()}, args.repeats)
  reference = jax.nn.softmax(jnp.einsum("nth,nsh->nts", q, k) * jnp.log(2.0), axis=-1) @ v
  flops = 4.0 * N * T * T * H
  for name, (fn, a) in rows.items():
    err = float(jnp.max(jnp.abs(fn(*a).astype(jnp.float32) - reference)))
    result[name] = dict(seconds=seconds[name], tops=flops / seconds[name] / 1e12, max_error=err)
  return result


def _scaled_int8_dot(x8, x_scale, w8, w_scale):
  """bf16 (x8 @ w8 in int32) * x_scale [M, 1] * w_scale [O]."""
  y = jnp.dot(x8, w8, preferred_element_type=jnp.int32).astype(jnp.float32)
  return (y * x_scale * w_scale).astype(jnp.bfloat16)


def matmul_rows(args) -> dict:
  """x [M, I] @ W [I, O] per shape: bf16, int8 -> int32, scaled, quantized-x, the pipeline's Dense."""
  from pipelines.wan import transformer

  result = {}
  for I, O in args.matmuls:
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (args.tokens, I), jnp.bfloat16)
    w = jax.random.normal(kw, (I, O), jnp.bfloat16) * 0.02
    x8, x_s = quantize_rows(x)
    wq = transformer.quantize_kernel(w, "int8")
    w8, w_s = wq.qvalue, wq.scale[0]
    bias = jnp.zeros((O,), jnp.bfloat16)
    rows = {
        "bf16": (lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16), (x, w)),
        "int8->int32": (lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.int32), (x8, w8)),
        "int8 scaled": (_scaled_int8_dot, (x8, x_s, w8, w_s)),
        "x quantized + int8 scaled": (lambda a, b, sb: _scaled_int8_dot(*quantize_rows(a), b, sb), (x, w8, w_s)),
        "Dense weight-only": (functools.partial(transformer.dense, int8_activations=False), (x, wq, bias)),
        "Dense w8a8": (functools.partial(transformer.dense, int8_activations=True), (x, wq, bias)),
    }
    seconds = time_median({n: jax.jit(f) for n, (f, _) in rows.items()}, {n: a for n, (_, a) in rows.items()},
                          args.repeats)
    ops = 2.0 * args.tokens * I * O
    result[f"{args.tokens}x{I}x{O}"] = {n: dict(seconds=s, tops=ops / s / 1e12) for n, s in seconds.items()}
  return result


def _pairs(text: str) -> list[tuple[int, int]]:
  return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m end_to_end.bench.int8", description=__doc__, formatter_class=HelpFormatter)
  ap.add_argument("--tokens", type=int, default=65520, help="matmul rows M (default: 2 x 32,760, 1.3B 480p with CFG)")
  ap.add_argument("--matmuls", type=_pairs, default=_pairs("1536x1536,1536x8960,8960x1536"),
                  help="I x O pairs (default: 1.3B's projections and feed-forward)")
  ap.add_argument("--seq", type=int, default=32768, help="attention T = S (a multiple of the blocks)")
  ap.add_argument("--heads", type=int, default=12)
  ap.add_argument("--blocks", type=_pairs, default=_pairs("4096x1024,2048x2048"), help="bq x bk pairs")
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU: exact, slow, not a speed)")
  ap.add_argument("--skip", choices=("matmul", "attention"), help="leave one part out")
  ap.add_argument("--json", help="also write the result here")
  return ap


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  if args.seq % 128 or any(args.seq % min(b, args.seq) for pair in args.blocks for b in pair):
    print(f"error: --seq {args.seq} must be a multiple of 128 and of every block in --blocks", file=sys.stderr)
    return 2
  device = jax.devices()[0]
  result = dict(device_kind=device.device_kind, jax=jax.__version__)
  print(f"{device.device_kind}, JAX {jax.__version__}", flush=True)
  if args.skip != "attention":
    result["attention"] = attention_rows(args)
    for name, row in result["attention"].items():
      print(f"attention {args.heads}x{args.seq}x128 {name}: {row['seconds'] * 1e3:.2f} ms, {row['tops']:.1f} TOP/s, "
            f"max error {row['max_error']:.2e}", flush=True)
    for bq, bk in args.blocks:
      pair = result["attention"]
      print(f"  int8 / bf16 at {bq}x{bk}: {pair[f'bf16 {bq}x{bk}']['seconds'] / pair[f'int8 {bq}x{bk}']['seconds']:.3f}x")
  if args.skip != "matmul":
    result["matmul"] = matmul_rows(args)
    for shape, rows in result["matmul"].items():
      for name, row in rows.items():
        print(f"matmul {shape} {name}: {row['seconds'] * 1e3:.2f} ms, {row['tops']:.1f} TOP/s, "
              f"{rows['bf16']['seconds'] / row['seconds']:.3f}x bf16", flush=True)
  if args.json:
    write_json(result, args.json, overwrite=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
