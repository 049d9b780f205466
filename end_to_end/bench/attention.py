"""Times our blockwise attention (LSE and fixed-m) against the platform's best attention, in one run.

  python -m end_to_end.bench.attention [--seq 4096] [--heads 12] [--head-dim 128] [--backend auto] [--json PATH]
  python -m end_to_end.bench.attention --seq 32760 --dtypes bfloat16          # one 1.3B 480p call
  LIBTPU_INIT_ARGS=--xla_tpu_scoped_vmem_limit_kib=65536 python -m end_to_end.bench.attention --seq 32768 --dtypes bfloat16

Prints, per dtype, the median wall time, TFLOP/s (4 B N T^2 H) and fraction of the chip's bf16 peak
(TPU v5e / v6e, H100 / H200) of each baseline and of `attention.local_attention` with implementation
"lse" and "fixed_m" on `--backend` (auto: the Pallas kernels on TPU and GPU, the XLA loops on CPU),
and the ratios baseline / ours; fixed-m's gate (the key statistics and verdict before its kernel) is
timed alone too, so fixed_m minus it is the kernel's time with the layout copies around it. Baselines (`bench.attention_baselines`): XLA's dense attention
(skipped when its logits would exceed --dense-limit-gb), cuDNN on a GPU, and on a TPU jax's Pallas
flash attention and splash attention over a grid of block shapes (--splash-grid), padded to their
blocks at any length; a baseline that does not compile (e.g. a scoped-VMEM overflow at large blocks:
raise the limit with LIBTPU_INIT_ARGS as above) is reported and left out; --baselines keeps some kinds
only (e.g. `--baselines splash`, to fit a chip's timed call). Times are medians over
--repeats calls after one warm-up (compile excluded), taken round-robin so that load from other
processes hits all of them alike. Ratios from the same run are what to compare across machines. The
Pallas kernels on CPU run in interpret mode (slow; exact): not a speed number.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from attention import BlockSizes, local_attention, resolve_backend
from attention import fixed_m as fm
from attention.blockwise import check_block_sizes, query_scaling
from end_to_end.bench.attention_baselines import baselines, parse_grid, parse_kinds
from pipelines.commands.help import HelpFormatter
from pipelines.parallel.planner import chip_of
from pipelines.storage.video_io import write_json


def _time_interleaved(fns: dict, args, repeats: int) -> tuple[dict[str, float], dict[str, str]]:
  """(median seconds per call of each fn that runs, {name: error} of those that fail to compile or
  run), timed round-robin so that load spikes hit them all alike."""
  failed = {}
  for name, fn in list(fns.items()):
    try:
      jax.block_until_ready(fn(*args))  # compile + warm up
    except Exception as e:  # noqa: BLE001 - a baseline that does not compile here is reported, not fatal
      failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
      del fns[name]
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - t0)
  return {name: statistics.median(t) for name, t in times.items()}, failed


def _rate(seconds: float, flops: float, peak: float | None) -> str:
  text = f"{seconds * 1e3:.2f} ms {flops / seconds / 1e12:.3g} TFLOP/s"
  return text + (f" ({flops / seconds / peak:.0%} of peak)" if peak else "")


OURS = ("lse", "fixed_m")
GATE = "fixed_m_gate"  # the part of "fixed_m" before its kernel, timed alone


def _gate(q, k, v):
  """The fixed-m gate's statistics and verdict (`fixed_m.local_gate`), as `local_attention` runs them."""
  q_in, logit_scale = query_scaling(q, q.shape[-1] ** -0.5, q_prescaled=False)
  return fm.local_gate(q_in, logit_scale, k, v)[1].eligible


def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m end_to_end.bench.attention", description=__doc__,
                               formatter_class=HelpFormatter)
  ap.add_argument("--batch", type=int, default=1, help="B")
  ap.add_argument("--seq", type=int, default=4096, help="T = S (any length: the Pallas baselines pad it)")
  ap.add_argument("--heads", type=int, default=12, help="N")
  ap.add_argument("--head-dim", type=int, default=128, help="H")
  ap.add_argument("--backend", default="auto", choices=("auto", "xla", "pallas"),
                  help="our kernels: auto (Pallas on TPU/GPU, XLA on CPU), xla or pallas")
  ap.add_argument("--block-q", type=int, default=None, help="query rows per block (default: the backend's)")
  ap.add_argument("--block-kv", type=int, default=None, help="key rows per block (default: the backend's)")
  ap.add_argument("--block-kv-compute", type=int, default=None,
                  help="keys per chunk of the TPU kernel's key block (default: the backend's; BlockSizes.block_kv_compute)")
  ap.add_argument("--dense-limit-gb", type=float, default=8.0,
                  help="skip XLA's dense attention when its fp32 logits would exceed this many GB")
  ap.add_argument("--splash-grid", default="default",
                  help="splash attention's block shapes on a TPU: 'default' (attention_baselines.SPLASH_GRID), "
                       "'none', or QxKVxC,... (block_q x block_kv x block_kv_compute)")
  ap.add_argument("--baselines", default="all",
                  help="which baselines to time: 'all' or some of dense, cudnn, flash, splash (e.g. 'splash': "
                       "jax's 128-block flash alone takes ~0.4 s a call at 32,760 tokens on a v5e)")
  ap.add_argument("--interpret", action="store_true",
                  help="also run splash in Pallas' interpret mode off a TPU (exact and slow: for tests)")
  ap.add_argument("--dtypes", default="float32,bfloat16",
                  help="comma-separated, each float32 or bfloat16 (default both)")
  ap.add_argument("--repeats", type=int, default=5, help="timed calls of each (the median is reported)")
  ap.add_argument("--json", help="also write the results as JSON to this path")
  return ap


def run_dtype(args: argparse.Namespace, name: str, base: list[np.ndarray], sizes: BlockSizes, backend: str,
              grid: tuple) -> dict:
  """One dtype's row: every implementation timed in one run, with TFLOP/s, the fraction of the
  chip's bf16 peak (None off the known chips and for float32), ratios and agreement."""
  platform, dtype = jax.default_backend(), jnp.dtype(name)
  shape = base[0].shape
  q, k, v = (jnp.asarray(x, dtype) for x in base)
  fns = baselines(platform, dtype, shape, args.dense_limit_gb, splash_grid=grid, interpret=args.interpret,
                  kinds=args.baseline_kinds)
  for impl in OURS:
    fns[impl] = jax.jit(lambda q, k, v, impl=impl: local_attention(q, k, v, implementation=impl,
                                                                   block_sizes=sizes, backend=backend))
  fns[GATE] = jax.jit(_gate)
  t, failed = _time_interleaved(fns, (q, k, v), args.repeats)
  gate = t.pop(GATE, None)
  outs = {key: np.asarray(fns[key](q, k, v), np.float32) for key in t}
  theirs = [key for key in t if key not in OURS]
  reference = "xla_dense" if "xla_dense" in t else theirs[0] if theirs else "fixed_m"
  best = min(theirs, key=t.get) if theirs else None
  chip = chip_of(jax.devices()[0].device_kind)
  peak = chip.peak_flops if chip is not None and dtype == jnp.bfloat16 else None
  flops = 4.0 * shape[0] * shape[2] * shape[1] ** 2 * shape[3]
  row = dict(dtype=name, backend=backend, seconds=t, gate_seconds=gate, failed=failed, flops=flops,
             tflops={key: flops / sec / 1e12 for key, sec in t.items()},
             peak_fraction={key: flops / sec / peak for key, sec in t.items()} if peak else None,
             best_baseline=best, baseline_over_lse={key: t[key] / t["lse"] for key in theirs},
             baseline_over_fixed_m={key: t[key] / t["fixed_m"] for key in theirs},
             lse_over_fixed_m=t["lse"] / t["fixed_m"],
             max_abs_vs={key: float(np.max(np.abs(outs[key] - outs[reference]))) for key in t}, reference=reference)
  print(f"{name}:")
  for key, sec in t.items():
    print(f"  {key:26s} {_rate(sec, flops, peak)}" + ("  <- the best baseline" if key == best else ""))
  if gate is not None and "fixed_m" in t:
    rest = t["fixed_m"] - gate  # the kernel and the layout copies around it
    print(f"  {GATE:26s} {gate * 1e3:.2f} ms, part of fixed_m"
          + (f" (fixed_m without it: {_rate(rest, flops, peak)})" if rest > 0 else ""))
  for key, error in failed.items():
    print(f"  {key:26s} failed: {error}")
  if best is not None:
    print(f"  {best}/fixed_m {row['baseline_over_fixed_m'][best]:.3f}  {best}/lse {row['baseline_over_lse'][best]:.3f}"
          f"  lse/fixed_m {row['lse_over_fixed_m']:.3f}  (ratios > 1: ours faster)")
  print("  max |out - " + reference + "|: " + "  ".join(f"{key} {e:.2e}" for key, e in row["max_abs_vs"].items()))
  return row


def main(argv=None):
  ap = build_parser()
  args = ap.parse_args(argv)
  bad = [d for d in args.dtypes.split(",") if d not in ("float32", "bfloat16")]
  if bad:
    ap.error(f"--dtypes {bad} not understood; use float32 and/or bfloat16, comma-separated")
  try:
    grid = parse_grid(args.splash_grid)
    args.baseline_kinds = parse_kinds(args.baselines)
  except ValueError as e:
    ap.error(str(e))
  backend = resolve_backend(args.backend)
  default = BlockSizes.get_default(backend)
  try:
    sizes = check_block_sizes(BlockSizes(args.block_q or default.block_q, args.block_kv or default.block_kv,
                                         args.block_kv_compute or default.block_kv_compute), backend)
  except ValueError as e:
    ap.error(str(e))
  shape = (args.batch, args.seq, args.heads, args.head_dim)
  rng = np.random.default_rng(0)
  base = [rng.standard_normal(shape, np.float32) for _ in range(3)]
  platform = jax.default_backend()
  print(f"platform={platform} ({jax.devices()[0].device_kind}) devices={jax.device_count()} shape [B,T,N,H]={shape} "
        f"backend={backend} block_q={sizes.block_q} block_kv={sizes.block_kv} block_kv_compute={sizes.block_kv_compute}")
  results = [run_dtype(args, name, base, sizes, backend, grid) for name in args.dtypes.split(",")]
  if args.json:
    write_json(dict(platform=platform, device_kind=jax.devices()[0].device_kind, jax=jax.__version__,
                    backend=backend, shape=shape, block_sizes=[sizes.block_q, sizes.block_kv, sizes.block_kv_compute],
                    args=vars(args), results=results), args.json, overwrite=True)
  return results


if __name__ == "__main__":
  main()
