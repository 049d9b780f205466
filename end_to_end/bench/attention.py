"""Times our blockwise attention (LSE and fixed-m) against the platform's best attention, in one run.

  python -m end_to_end.bench.attention [--seq 4096] [--heads 12] [--head-dim 128] [--backend auto] [--json PATH]
  python -m end_to_end.bench.attention --seq 32760 --dtypes bfloat16          # on a GPU: vs cuDNN

Prints, per dtype, the median wall time of each baseline and of `attention.local_attention` with
implementation "lse" and "fixed_m" on `--backend` (auto: the Pallas kernels on TPU and GPU, the XLA
loops on CPU), and the ratios baseline / ours and LSE / fixed-m. Baselines: XLA's dense
`jax.nn.dot_product_attention` (skipped when its [B, N, T, S] logits would exceed --dense-limit-gb),
on GPU also `implementation="cudnn"` (bf16/fp16), on TPU jax's Pallas flash-attention kernel.
Times are medians over --repeats calls after one warm-up (compile excluded), taken round-robin so
that load from other processes hits all of them alike. Ratios from the same run are what to compare
across machines. The Pallas kernels on CPU run in interpret mode (slow; exact): not a speed number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from attention import BlockSizes, local_attention, resolve_backend
from pipelines.commands.help import HelpFormatter


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


def baselines(platform: str, dtype, shape, dense_limit_gb: float) -> dict:
  """The platform's attention implementations to compare with, as jitted fns of (q, k, v) [B, T, N, H]."""
  B, T, N, H = shape
  fns = {}
  if B * N * T * T * 4 <= dense_limit_gb * 1e9:
    fns["xla_dense"] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"))
  if platform == "gpu" and dtype != jnp.float32:
    fns["cudnn"] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
  if platform == "tpu":
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

    def flash(q, k, v):  # [B, N, T, H] layout, natural-log softmax with sm_scale
      out = tpu_flash.flash_attention(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), sm_scale=H ** -0.5)
      return out.transpose(0, 2, 1, 3)
    fns["jax_tpu_flash"] = jax.jit(flash)
  if not fns:
    raise SystemExit(f"no baseline fits: dense logits of {B * N * T * T * 4 / 1e9:.1f} GB exceed "
                     f"--dense-limit-gb {dense_limit_gb} and {platform} has no fused attention here")
  return fns


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m end_to_end.bench.attention", description=__doc__,
                               formatter_class=HelpFormatter)
  ap.add_argument("--batch", type=int, default=1, help="B")
  ap.add_argument("--seq", type=int, default=4096, help="T = S")
  ap.add_argument("--heads", type=int, default=12, help="N")
  ap.add_argument("--head-dim", type=int, default=128, help="H")
  ap.add_argument("--backend", default="auto", choices=("auto", "xla", "pallas"),
                  help="our kernels: auto (Pallas on TPU/GPU, XLA on CPU), xla or pallas")
  ap.add_argument("--block-q", type=int, default=None, help="query rows per block (default: the backend's)")
  ap.add_argument("--block-kv", type=int, default=None, help="key rows per block (default: the backend's)")
  ap.add_argument("--dense-limit-gb", type=float, default=8.0,
                  help="skip XLA's dense attention when its fp32 logits would exceed this many GB")
  ap.add_argument("--dtypes", default="float32,bfloat16",
                  help="comma-separated, each float32 or bfloat16 (default both)")
  ap.add_argument("--repeats", type=int, default=5, help="timed calls of each (the median is reported)")
  ap.add_argument("--json", help="also write the results as JSON to this path")
  args = ap.parse_args(argv)
  bad = [d for d in args.dtypes.split(",") if d not in ("float32", "bfloat16")]
  if bad:
    ap.error(f"--dtypes {bad} not understood; use float32 and/or bfloat16, comma-separated")
  backend = resolve_backend(args.backend)
  default = BlockSizes.get_default(backend)
  sizes = BlockSizes(args.block_q or default.block_q, args.block_kv or default.block_kv)
  shape = (args.batch, args.seq, args.heads, args.head_dim)
  rng = np.random.default_rng(0)
  base = [rng.standard_normal(shape, np.float32) for _ in range(3)]
  platform = jax.default_backend()
  print(f"platform={platform} ({jax.devices()[0].device_kind}) devices={jax.device_count()} shape [B,T,N,H]={shape} "
        f"backend={backend} block_q={sizes.block_q} block_kv={sizes.block_kv}")
  results = []
  for name in args.dtypes.split(","):
    dtype = jnp.dtype(name)
    q, k, v = (jnp.asarray(x, dtype) for x in base)
    fns = baselines(platform, dtype, shape, args.dense_limit_gb)
    fns["lse"] = jax.jit(lambda q, k, v: local_attention(q, k, v, implementation="lse", block_sizes=sizes,
                                                         backend=backend))
    fns["fixed_m"] = jax.jit(lambda q, k, v: local_attention(q, k, v, implementation="fixed_m",
                                                             block_sizes=sizes, backend=backend))
    t = _time_interleaved(fns, (q, k, v), args.repeats)
    outs = {key: np.asarray(f(q, k, v), np.float32) for key, f in fns.items()}
    reference = next(key for key in fns if key not in ("lse", "fixed_m"))
    row = dict(dtype=name, backend=backend, seconds=t,
               baseline_over_lse={key: t[key] / t["lse"] for key in fns if key not in ("lse", "fixed_m")},
               lse_over_fixed_m=t["lse"] / t["fixed_m"],
               max_abs_vs={key: float(np.max(np.abs(outs[key] - outs[reference]))) for key in fns},
               reference=reference)
    results.append(row)
    print(f"{name}: " + "  ".join(f"{key} {sec * 1e3:.2f} ms" for key, sec in t.items()))
    print("  " + "  ".join(f"{key}/lse {r:.2f}" for key, r in row["baseline_over_lse"].items())
          + f"  lse/fixed_m {row['lse_over_fixed_m']:.2f}  (ratios > 1: ours faster)")
    print("  max |out - " + reference + "|: " + "  ".join(f"{key} {e:.2e}" for key, e in row["max_abs_vs"].items()))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(platform=platform, backend=backend, shape=shape, block_sizes=[sizes.block_q, sizes.block_kv],
                     args=vars(args), results=results), f, indent=2)
  return results


if __name__ == "__main__":
  main()
