"""Times dense XLA attention against the blockwise LSE scan and fixed-m, in one run.

  python -m end_to_end.bench_attention [--seq 4096] [--heads 12] [--head-dim 128] [--json PATH]

Prints, for fp32 and bf16, the median wall time of `jax.nn.dot_product_attention` (dense, XLA),
`attention.local_attention(implementation="lse")` and `(implementation="fixed_m")`, and the ratios
dense / blockwise and LSE / fixed-m. Times are medians over --repeats calls after one warm-up
(compile excluded), taken round-robin over the three so that load from other processes hits all
of them alike. Ratios from the same run are what to compare across machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from attention import BlockSizes, local_attention
from pipelines.cli import HelpFormatter


def _time_interleaved(fns: dict, args, repeats: int) -> dict[str, float]:
  """Median seconds per call of each fn, timed round-robin so load spikes hit them all alike."""
  for fn in fns.values():
    jax.block_until_ready(fn(*args))  # compile + warm up
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - t0)
  return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m end_to_end.bench_attention", description=__doc__,
                               formatter_class=HelpFormatter)
  ap.add_argument("--batch", type=int, default=1, help="B")
  ap.add_argument("--seq", type=int, default=4096, help="T = S")
  ap.add_argument("--heads", type=int, default=12, help="N")
  ap.add_argument("--head-dim", type=int, default=128, help="H")
  ap.add_argument("--block-q", type=int, default=BlockSizes().block_q, help="query rows per block")
  ap.add_argument("--block-kv", type=int, default=BlockSizes().block_kv, help="key rows per block")
  ap.add_argument("--dtypes", default="float32,bfloat16",
                  help="comma-separated, each float32 or bfloat16 (default both)")
  ap.add_argument("--repeats", type=int, default=5, help="timed calls of each (the median is reported)")
  ap.add_argument("--json", help="also write the results as JSON to this path")
  args = ap.parse_args(argv)
  bad = [d for d in args.dtypes.split(",") if d not in ("float32", "bfloat16")]
  if bad:
    ap.error(f"--dtypes {bad} not understood; use float32 and/or bfloat16, comma-separated")
  sizes = BlockSizes(args.block_q, args.block_kv)
  shape = (args.batch, args.seq, args.heads, args.head_dim)
  rng = np.random.default_rng(0)
  base = [rng.standard_normal(shape, np.float32) for _ in range(3)]
  print(f"backend={jax.default_backend()} devices={jax.device_count()} shape [B,T,N,H]={shape} "
        f"block_q={sizes.block_q} block_kv={sizes.block_kv}")
  print(f"{'dtype':9s} {'dense s':>9s} {'lse s':>9s} {'fixed_m s':>10s} {'dense/lse':>10s} "
        f"{'dense/fixed':>12s} {'lse/fixed':>10s} {'max|lse-dense|':>15s} {'max|fm-lse|':>12s}")
  results = []
  for name in args.dtypes.split(","):
    dtype = jnp.dtype(name)
    q, k, v = (jnp.asarray(x, dtype) for x in base)
    dense = jax.jit(jax.nn.dot_product_attention)
    lse = jax.jit(lambda q, k, v: local_attention(q, k, v, implementation="lse", block_sizes=sizes))
    fixed = jax.jit(lambda q, k, v: local_attention(q, k, v, implementation="fixed_m", block_sizes=sizes))
    t = _time_interleaved(dict(dense=dense, lse=lse, fixed=fixed), (q, k, v), args.repeats)
    t_dense, t_lse, t_fixed = t["dense"], t["lse"], t["fixed"]
    o_dense, o_lse, o_fixed = (np.asarray(f(q, k, v), np.float32) for f in (dense, lse, fixed))
    row = dict(dtype=name, dense_s=t_dense, lse_s=t_lse, fixed_m_s=t_fixed,
               dense_over_lse=t_dense / t_lse, dense_over_fixed_m=t_dense / t_fixed,
               lse_over_fixed_m=t_lse / t_fixed,
               max_abs_lse_vs_dense=float(np.max(np.abs(o_lse - o_dense))),
               max_abs_fixed_m_vs_lse=float(np.max(np.abs(o_fixed - o_lse))))
    results.append(row)
    print(f"{name:9s} {t_dense:9.3f} {t_lse:9.3f} {t_fixed:10.3f} {row['dense_over_lse']:10.2f} "
          f"{row['dense_over_fixed_m']:12.2f} {row['lse_over_fixed_m']:10.2f} "
          f"{row['max_abs_lse_vs_dense']:15.2e} {row['max_abs_fixed_m_vs_lse']:12.2e}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(backend=jax.default_backend(), shape=shape, block_sizes=vars(args), results=results), f, indent=2)
  return results


if __name__ == "__main__":
  main()
