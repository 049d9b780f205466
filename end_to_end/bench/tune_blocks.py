"""Grid search over attention block sizes: times `local_attention` for each (block_q, block_kv).

  python -m end_to_end.bench.tune_blocks --backend xla --seq 4096                 # CPU: the XLA loops
  python -m end_to_end.bench.tune_blocks --backend pallas --seq 32760 --dtype bfloat16   # on a GPU / TPU
  python -m end_to_end.bench.tune_blocks --backend pallas --topology v6e:2x2      # TPU AOT: compile check
  python -m end_to_end.bench.tune_blocks --pick v6e-a.json v6e-b.json             # one chip's default

On a real device it times every pair of the grid for both exact paths (LSE and fixed-m), round-robin
over the pairs so that load from other processes hits them all alike, and prints the table sorted by
the time of `--rank-by` (default fixed_m, the path the gate picks on real inputs) with the winner and
the current default (`BlockSizes.get_default` for the device kind, e.g. a TPU generation's entry of
`attention.settings.DEFAULT_BLOCKS`) side by side; `--json` keeps the table.
A winner becomes a default by editing DEFAULT_BLOCKS with the table's numbers in the comment.

With `--topology` (TPU, compiled on this machine with libtpu; see end_to_end/aot/step.py) nothing runs:
each pair is compiled for one chip and the table gives compile seconds, generated code and temp
(HBM) memory per pair, and which pairs Mosaic refuses (e.g. a kernel whose scoped VMEM exceeds its
limit, with the MiB it asked for; the kernel raises its own limit past XLA's default 16 MiB on v5e /
32 MiB on v6e where its blocks need it, `attention.kernels.tpu_vmem_limit`). That prunes the grid a TPU run then
times; `--pick` turns one chip's tables (one per attention shape) into its default (`pick_blocks`).

The Pallas kernels on CPU run in interpret mode, whose speed says nothing about a TPU or GPU: that
combination is refused.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
import time

from pipelines.commands.help import HelpFormatter
from pipelines.storage.video_io import write_json


def _pairs(text: str) -> list[int]:
  try:
    sizes = sorted({int(x) for x in text.split(",") if x.strip()})
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated positive ints, e.g. 128,256,512") from None
  if not sizes or min(sizes) <= 0:
    raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated positive ints, e.g. 128,256,512")
  return sizes


def _scoped_vmem_mib(message: str) -> list[float] | None:
  """[needed, limit] scoped VMEM (MiB) of the allocation a TPU compile refused ("Scoped allocation
  with size 20.81M and limit 16.00M exceeded ..."), or None for any other error."""
  found = re.search(r"Scoped allocation with size ([0-9.]+)([KMG]) and limit ([0-9.]+)([KMG])", message)
  if not found:
    return None
  unit = {"K": 2**-10, "M": 1.0, "G": 2**10}
  return [float(found.group(1)) * unit[found.group(2)], float(found.group(3)) * unit[found.group(4)]]


def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m end_to_end.bench.tune_blocks", description=__doc__,
                               formatter_class=HelpFormatter)
  ap.add_argument("--backend", default="auto", choices=("auto", "xla", "pallas"),
                  help="kernels to tune (auto: Pallas on TPU/GPU, XLA on CPU)")
  ap.add_argument("--batch", type=int, default=1, help="B")
  ap.add_argument("--seq", type=int, default=4096, help="T = S (Wan 1.3B 480p: 32760 over all devices)")
  ap.add_argument("--heads", type=int, default=12, help="N (= K)")
  ap.add_argument("--head-dim", type=int, default=128, help="H")
  ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
  ap.add_argument("--block-q", type=_pairs, default=None,
                  help="block_q values, comma-separated (default 128,256,512,1024)")
  ap.add_argument("--block-kv", type=_pairs, default=None,
                  help="block_kv values, comma-separated (default 128,256,512,1024)")
  ap.add_argument("--repeats", type=int, default=5, help="timed calls per pair (median reported)")
  ap.add_argument("--rank-by", default="fixed_m", choices=("fixed_m", "lse"), help="path that orders the table")
  ap.add_argument("--topology", help="TPU topology for an AOT compile check instead of timing, e.g. v6e:2x2")
  ap.add_argument("--json", help="write the table here")
  ap.add_argument("--pick", nargs="+", metavar="TABLE",
                  help="instead of a grid: the pick of one chip's --topology tables (--json files, one per "
                       "shape), by the rule of `pick_blocks`")
  return ap


CODE_TOLERANCE = 1.25  # code of both paths within 25% of the grid's least counts as equal
PADDING_TOLERANCE = 0.01  # padded work within 1% of the grid's least counts as equal


def eligible_pairs(table: dict) -> list[tuple[int, int]]:
  """The (block_q, block_kv) of one `--topology` table (a `--json` file's dict) that pass the pick's
  filters, in the table's order: (1) fit: Mosaic compiled both paths under the chip's scoped VMEM
  limit; (2) padding: the padded work T_pad * S_pad (T = S = the table's sequence, padded to the
  pair's own blocks as `block_layout.capped_block` caps them, not halved as `BlockLayout` may halve
  them) within `PADDING_TOLERANCE` of the least of the fitting pairs;
  (3) code: the generated code of both paths together (the "auto" kernel holds both updates)
  within `CODE_TOLERANCE` of the least of the fitting pairs."""
  from attention.block_layout import capped_block
  from attention.padding import round_up

  seq = table["shape"][1]
  fit = {(r["block_q"], r["block_kv"]): r for r in table["rows"]
         if all("error" not in r[path] for path in ("lse", "fixed_m"))}
  if not fit:
    return []
  padded = lambda block: round_up(seq, capped_block(seq, block))  # noqa: E731
  work = {key: padded(key[0]) * padded(key[1]) for key in fit}
  code = {key: r["lse"]["code_mib"] + r["fixed_m"]["code_mib"] for key, r in fit.items()}
  return [key for key in fit if work[key] <= min(work.values()) * (1 + PADDING_TOLERANCE)
          and code[key] <= min(code.values()) * CODE_TOLERANCE]


def pick_blocks(tables: list[dict]) -> tuple[int, int] | None:
  """One chip's default from its tables (one per attention shape): of the pairs every table finds
  eligible (`eligible_pairs`), the largest block_q * block_kv (fewer grid steps: each costs a fixed
  overhead, the usual TPU heuristic), then the larger block_q (K/V are read from HBM once per query
  block, so block_q sets the kernel's FLOPs per byte). None when no pair passes everywhere."""
  common = set.intersection(*(set(eligible_pairs(t)) for t in tables)) if tables else set()
  return max(common, key=lambda key: (key[0] * key[1], key[0]), default=None)


def _pick_main(paths: list[str]) -> list[dict]:
  tables = []
  for path in paths:
    with open(path) as f:
      tables.append(json.load(f))
    t = tables[-1]
    print(f"{path}: {t.get('topology')} [B,T,N,H]={t['shape']} eligible {eligible_pairs(t)}")
  print(f"pick: {pick_blocks(tables)}")
  return tables


def _compiled_rows(fn, pairs: list, shape: tuple[int, ...], dtype, device) -> list[dict]:
  """Each pair's LSE and fixed-m programs compiled for `device` (a TPU topology's): compile time,
  code and temp MiB, or the error (with the scoped VMEM asked, when Mosaic refused it); printed."""
  import jax
  from jax.sharding import SingleDeviceSharding

  abstract = jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))
  rows = []
  for sizes in pairs:
    row = dict(block_q=sizes.block_q, block_kv=sizes.block_kv)
    for impl in ("lse", "fixed_m"):
      start = time.perf_counter()
      try:
        compiled = fn(sizes, impl).lower(abstract, abstract, abstract).compile()
      except Exception as e:  # noqa: BLE001 - a pair Mosaic refuses is a row of the table, not a crash
        row[impl] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}",
                         scoped_vmem_mib=_scoped_vmem_mib(str(e)))
        continue
      mem = compiled.memory_analysis()
      row[impl] = dict(compile_s=time.perf_counter() - start,
                       code_mib=mem.generated_code_size_in_bytes / 2**20,
                       temp_mib=mem.temp_size_in_bytes / 2**20)
    rows.append(row)
    cells = [(f"{r['compile_s']:6.1f} s {r['code_mib']:6.2f} MiB code {r['temp_mib']:8.1f} MiB temp"
              if "error" not in r else "refused: scoped VMEM {:.2f} MiB > limit {:.2f} MiB".format(*r["scoped_vmem_mib"])
              if r["scoped_vmem_mib"] else r["error"]) for r in (row["lse"], row["fixed_m"])]
    print(f"  {sizes.block_q:5d} x {sizes.block_kv:<5d} lse: {cells[0]} | fixed_m: {cells[1]}", flush=True)
  return rows


def _timed_rows(fn, pairs: list, shape: tuple[int, ...], dtype, repeats: int, rank_by: str, default) -> list[dict]:
  """Each pair's LSE and fixed-m calls timed on this device (median of `repeats`, round-robin after
  a warm-up), sorted by `rank_by`'s time; printed with the current default marked."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for _ in range(3))
  fns = {(s, impl): fn(s, impl) for s in pairs for impl in ("lse", "fixed_m")}
  times = {key: [] for key in fns}
  for key, f in fns.items():
    jax.block_until_ready(f(q, k, v))  # compile + warm up
  for _ in range(repeats):
    for key, f in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(f(q, k, v))
      times[key].append(time.perf_counter() - start)
  rows = [dict(block_q=s.block_q, block_kv=s.block_kv, lse=dict(median_s=statistics.median(times[(s, "lse")])),
               fixed_m=dict(median_s=statistics.median(times[(s, "fixed_m")]))) for s in pairs]
  rows.sort(key=lambda r: r[rank_by]["median_s"])
  best = rows[0][rank_by]["median_s"]
  print(f"{'block_q':>8s} {'block_kv':>8s} {'lse ms':>9s} {'fixed_m ms':>11s} {'x best':>7s}")
  for r in rows:
    mark = "  <- current default" if default and (r["block_q"], r["block_kv"]) == (default.block_q, default.block_kv) else ""
    print(f"{r['block_q']:8d} {r['block_kv']:8d} {r['lse']['median_s'] * 1e3:9.2f} "
          f"{r['fixed_m']['median_s'] * 1e3:11.2f} {r[rank_by]['median_s'] / best:7.2f}{mark}")
  print(f"winner ({rank_by}): BlockSizes({rows[0]['block_q']}, {rows[0]['block_kv']})")
  return rows


def main(argv: list[str] | None = None) -> list[dict]:
  args = build_parser().parse_args(argv)
  if args.pick:
    return _pick_main(args.pick)
  import jax
  import jax.numpy as jnp

  from attention import BlockSizes, local_attention, resolve_backend

  if args.topology:
    from end_to_end.aot.step import topology_devices

    device = topology_devices(args.topology)[0]
  else:
    device = jax.devices()[0]
  platform = "tpu" if args.topology else jax.default_backend()
  backend = resolve_backend(args.backend, platform)
  if backend == "pallas" and platform == "cpu":
    raise SystemExit("tune_blocks: the Pallas kernels run in interpret mode on CPU; their times say "
                     "nothing about a TPU or GPU. Run on the accelerator, or use --topology for a TPU "
                     "compile check, or --backend xla")
  grid_q = args.block_q or [128, 256, 512, 1024]
  grid_kv = args.block_kv or [128, 256, 512, 1024]
  pairs = [BlockSizes(bq, bk) for bq, bk in itertools.product(grid_q, grid_kv)]
  shape = (args.batch, args.seq, args.heads, args.head_dim)
  dtype = jnp.dtype(args.dtype)
  default = BlockSizes.get_default(backend, platform, device.device_kind)
  print(f"tune_blocks: backend={backend} platform={platform} ({device.device_kind})"
        f"{' (AOT ' + args.topology + ')' if args.topology else ''} [B,T,N,H]={shape} {args.dtype}; "
        f"current default {default}", flush=True)

  def fn(sizes, impl):
    return jax.jit(lambda q, k, v: local_attention(q, k, v, implementation=impl, block_sizes=sizes,
                                                   backend=backend))

  rows = (_compiled_rows(fn, pairs, shape, dtype, device) if args.topology
          else _timed_rows(fn, pairs, shape, dtype, args.repeats, args.rank_by, default))
  if args.json:
    write_json(dict(backend=backend, platform=platform, device_kind=device.device_kind, topology=args.topology, shape=shape,
                    dtype=args.dtype, default=None if default is None else [default.block_q, default.block_kv], rows=rows),
               args.json, overwrite=True)
  return rows


if __name__ == "__main__":
  sys.exit(0 if main() is not None else 1)
