"""Collectives of one attention call, read from the compiled HLO, next to the theoretical minimum.

  python -m end_to_end.aot.collectives --mesh U=2,R=2 --tokens 32760 --heads 12 --head-dim 128 --dtype bfloat16
  python -m end_to_end.aot.collectives --mesh U=2,R=4 --topology v6e:2x4   # TPU AOT (needs libtpu)

Lowers and compiles `attention.usp_attention` (or `--kind halo --window W`) for abstract inputs of
the given shape on the given mesh, then counts each collective in the compiled HLO with the bytes
its buffer holds per device. The theoretical minimum for USP (DESIGN.md section 3) is 2 all-to-alls
(q/k/v in, output back), R - 1 permutes of the packed K/V shard, and for the fixed-m gate one tiny
all-gather of the k sums (added in mesh order) and one tiny all-reduce (pmax) of the maxima. With `--topology` it compiles for that TPU topology on this machine (libtpu needed:
`pip install --no-deps --target DIR "libtpu==0.0.42.*"`, put DIR on PYTHONPATH, and run with
JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 so libtpu does not wait for a TPU metadata server) and also prints
`memory_analysis()` and `cost_analysis()`. This is a compile-time report, not a runtime measurement.
On CPU it asks for enough fake devices itself when JAX has not started yet.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from typing import Any

from attention.mesh import MeshSpec, request_cpu_devices
from pipelines.commands.help import HelpFormatter
from pipelines.storage.video_io import write_json

_OPS = ("all-to-all", "collective-permute", "all-reduce", "all-gather")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "f64": 8, "s8": 1, "u8": 1}


def _shape_bytes(shape_text: str) -> int:
  """Bytes of an HLO result type such as 'bf16[1,64,8,32]' or a tuple '(f32[2], f32[2])'."""
  total = 0
  for dtype, dims in re.findall(r"([a-z]+\d*)\[([\d,]*)\]", shape_text):
    n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    total += n * _DTYPE_BYTES.get(dtype, 4)
  return total


def hlo_collectives(hlo: str) -> dict[str, dict[str, int]]:
  """{op: {count, bytes}} over the compiled HLO; bytes = result buffer per device."""
  table = {op: {"count": 0, "bytes": 0} for op in _OPS}
  for line in hlo.splitlines():
    for op in _OPS:
      m = re.search(rf"=\s*(.+?)\s+{op}(-start)?\(", line)
      if m:
        result = m.group(1)
        if m.group(2) and op == "collective-permute" and result.startswith("("):
          # Async start ops return (operand, output, contexts...): count the output once.
          result = re.findall(r"[a-z]+\d*\[[\d,]*\]", result)[1]
        table[op]["count"] += 1
        table[op]["bytes"] += _shape_bytes(result)
  return table


def estimated_cycles(compiled_hlo: str) -> int | None:
  """The TPU compiler's own run-time estimate of a compiled program: the sum of the
  `estimated_cycles` its cost model writes into each scheduled instruction's backend config
  (None where the backend writes none, e.g. CPU). A loop body is counted once, as in
  `cost_analysis`; the figure compares two compiles of one program (e.g. at two optimization
  efforts), it is not a measured time."""
  cycles = [int(c) for c in re.findall(r'"estimated_cycles":"(\d+)"', compiled_hlo)]
  return sum(cycles) if cycles else None


def summary(collectives: dict[str, dict[str, int]]) -> str:
  """`hlo_collectives`' result as one phrase: "op count / MiB, ..." for the ops present, or "none"."""
  found = [f"{op} {v['count']} / {v['bytes'] / 2**20:.1f}" for op, v in collectives.items() if v["count"]]
  return ", ".join(found) or "none"


def usp_minimum(B, T, N, K, H, U, R, dtype_bytes) -> dict[str, dict[str, int]]:
  """Theoretical per-device collectives of one USP call (DESIGN.md section 3)."""
  D = U * R
  Kp = max(K, U)
  Tl = -(-T // D)
  qkv = B * Tl * (N + 2 * Kp) * H * dtype_bytes
  out = B * Tl * N * H * dtype_bytes
  kv_shard = 2 * B * (U * Tl) * (Kp // U) * H * dtype_bytes
  a2a = {"count": 2 if U > 1 else 0, "bytes": (qkv + out) if U > 1 else 0}
  return {
      "all-to-all": a2a,
      "collective-permute": {"count": R - 1, "bytes": (R - 1) * kv_shard},
      "all-reduce": {"count": 1 if D > 1 else 0, "bytes": B * (N + 2 * Kp) * 4 if D > 1 else 0},
      "all-gather": {"count": 1 if D > 1 else 0, "bytes": D * B * Kp * H * 4 if D > 1 else 0},
  }


def compile_local_kernels(device: Any, *, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                          dtype: str = "bfloat16") -> list[dict[str, Any]]:
  """AOT-compiles one device's attention block for `device` (a TPU topology device): our Pallas
  kernels (`local_attention(backend="pallas")`, LSE and fixed-m) beside jax's splash attention
  kernel (jax.experimental.pallas.ops.tpu.splash_attention, full mask, its default blocks) for the
  same q [B, T, N, H] and k/v [B, S, N, H]. Splash needs block multiples: T and S are rounded up to
  512 for it (reported).

  Returns:
    one dict per kernel: name, shape, compile_s, code_mib, temp_mib (or error).
  """
  import jax
  import jax.numpy as jnp
  from jax.sharding import SingleDeviceSharding

  import attention

  sharding = SingleDeviceSharding(device)
  dt = jnp.dtype(dtype)

  def spec(*shape):
    return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

  def measure(name, fn, *args):
    start = time.perf_counter()
    try:
      compiled = jax.jit(fn).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - a kernel that does not compile is a row, not a crash
      return dict(name=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    mem = compiled.memory_analysis()
    return dict(name=name, shape=[list(a.shape) for a in args], compile_s=time.perf_counter() - start,
                code_mib=mem.generated_code_size_in_bytes / 2**20, temp_mib=mem.temp_size_in_bytes / 2**20,
                estimated_cycles=estimated_cycles(compiled.as_text()))

  q, kv = spec(batch, q_len, heads, head_dim), spec(batch, kv_len, heads, head_dim)
  rows = [measure(f"ours {impl}", lambda q, k, v, impl=impl: attention.local_attention(
      q, k, v, implementation=impl, backend="pallas"), q, kv, kv) for impl in ("lse", "fixed_m")]
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

  Tq, Sk = -(-q_len // 512) * 512, -(-kv_len // 512) * 512
  kernel = splash.make_splash_mha_single_device(mask_lib.MultiHeadMask([mask_lib.FullMask((Tq, Sk))] * heads))
  rows.append(measure("jax splash (full mask)", jax.vmap(kernel), spec(batch, heads, Tq, head_dim),
                      spec(batch, heads, Sk, head_dim), spec(batch, heads, Sk, head_dim)))
  return rows


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m end_to_end.aot.collectives", description=__doc__,
                               formatter_class=HelpFormatter)
  ap.add_argument("--mesh", default="U=2,R=2", help="Ulysses and ring degrees, e.g. U=2,R=4 (default U=2,R=2)")
  ap.add_argument("--batch", type=int, default=1, help="B (default 1)")
  ap.add_argument("--tokens", type=int, default=32760, help="T = S (Wan 1.3B 480p x 81 frames: 32760)")
  ap.add_argument("--heads", type=int, default=12, help="N query heads (default 12, Wan 1.3B)")
  ap.add_argument("--kv-heads", type=int, default=None, help="K kv heads (default N)")
  ap.add_argument("--head-dim", type=int, default=128, help="H (default 128)")
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="q/k/v dtype")
  ap.add_argument("--kind", choices=("usp", "halo"), default="usp", help="attention call to compile")
  ap.add_argument("--window", type=int, default=256, help="halo only: window w")
  ap.add_argument("--implementation", default="auto", choices=("auto", "lse", "fixed_m"))
  ap.add_argument("--backend", default="auto", choices=("auto", "xla", "pallas"),
                  help="per-device block update: Pallas kernels or XLA loops (auto: Pallas on TPU/GPU)")
  ap.add_argument("--block-q", type=int, default=None, help="BlockSizes.block_q (default: the backend's default)")
  ap.add_argument("--block-kv", type=int, default=None, help="BlockSizes.block_kv")
  ap.add_argument("--topology", help="TPU topology for AOT compile, e.g. v6e:2x2 (needs libtpu)")
  ap.add_argument("--json", help="write the report as JSON here")
  return ap


def _devices(topology: str | None) -> tuple[list, str, str]:
  """(devices, target, platform): the TPU topology's devices compiled for ahead of time, or JAX's own."""
  import jax

  if not topology:
    return jax.devices(), jax.default_backend(), jax.default_backend()
  from jax.experimental import topologies
  try:
    topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
  except Exception as e:  # noqa: BLE001 - report why the optional TPU path is unavailable
    raise SystemExit(f"cannot build TPU topology {topology!r} ({e}); install libtpu: "
                     "pip install --no-deps --target DIR 'libtpu==0.0.42.*', add DIR to PYTHONPATH "
                     "and set JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1") from e
  return topo.devices, f"tpu AOT {topology}", "tpu"


def _print_collectives(table: dict, minimum: dict | None) -> None:
  print(f"{'collective':20s} {'count':>6s} {'MiB/device':>11s}" + (f" {'min count':>10s} {'min MiB':>9s}" if minimum else ""))
  for op in _OPS:
    row = f"{op:20s} {table[op]['count']:6d} {table[op]['bytes'] / 2**20:11.3f}"
    if minimum:
      row += f" {minimum[op]['count']:10d} {minimum[op]['bytes'] / 2**20:9.3f}"
    print(row)


def _analyses(compiled) -> dict:
  """XLA's memory analysis, libtpu's estimated cycles and XLA's cost analysis of a compiled call,
  each printed and returned where the backend gives it."""
  report = {}
  mem = compiled.memory_analysis()
  if mem is not None:
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "generated_code_size_in_bytes")
    report["memory_analysis"] = {f: int(getattr(mem, f, 0)) for f in fields}
    print("memory_analysis (per device): " + ", ".join(f"{f.replace('_size_in_bytes', '')}={v / 2**20:.1f} MiB"
                                                       for f, v in report["memory_analysis"].items()))
  cycles = estimated_cycles(compiled.as_text())
  if cycles is not None:  # libtpu's model of the XLA work around the kernels (a kernel carries none)
    report["estimated_cycles"] = cycles
    print(f"estimated_cycles (libtpu's cost model, XLA ops only): {cycles / 1e6:.2f} M")
  cost = compiled.cost_analysis()
  if cost:
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    report["cost_analysis"] = {k: float(v) for k, v in cost.items() if k in ("flops", "bytes accessed", "transcendentals")}
    print("cost_analysis (per device): " + ", ".join(f"{k}={v:.3e}" for k, v in report["cost_analysis"].items()))
  return report


def _print_local_kernels(local: list[dict], kv_heads: int) -> None:
  print(f"one device's block (q [B, T/R, N/U, H], k/v of one ring step; kv heads {kv_heads}), "
        "compiled for one chip:")
  for row in local:
    print(f"  {row['name']:24s} " + (row["error"] if "error" in row else
          f"compile {row['compile_s']:5.1f} s  code {row['code_mib']:6.2f} MiB  temp {row['temp_mib']:7.1f} MiB"
          + (f"  {row['estimated_cycles'] / 1e6:6.2f} Mcycles" if row.get("estimated_cycles") else "")))


def main(argv=None):
  ap = _parser()
  args = ap.parse_args(argv)
  try:
    spec = MeshSpec.parse(args.mesh)
    if spec.cfg > 1:
      raise ValueError(f"mesh {spec}: one attention call has no guidance split; give U and R only")
    U, R = spec.ulysses, spec.ring
  except ValueError as e:
    ap.error(str(e))
  if args.topology is None:
    request_cpu_devices(U * R)
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding

  from attention import SEQUENCE_SPEC, BlockSizes, make_mesh, resolve_backend, usp_attention
  from attention.halo import halo_attention

  devices, target, platform = _devices(args.topology)
  kernel_backend = resolve_backend(args.backend, platform)
  mesh = make_mesh(ulysses=U, ring=R, devices=devices)
  K = args.kv_heads or args.heads
  dtype = jnp.dtype(args.dtype)
  sh = NamedSharding(mesh, SEQUENCE_SPEC)
  T_pad = -(-args.tokens // (U * R)) * (U * R)
  q = jax.ShapeDtypeStruct((args.batch, T_pad, args.heads, args.head_dim), dtype, sharding=sh)
  kv = jax.ShapeDtypeStruct((args.batch, T_pad, K, args.head_dim), dtype, sharding=sh)
  default = BlockSizes.get_default(kernel_backend, platform, devices[0].device_kind)
  sizes = BlockSizes(args.block_q or default.block_q, args.block_kv or default.block_kv)
  if args.kind == "usp":
    fn = lambda q, k, v: usp_attention(q, k, v, mesh=mesh, implementation=args.implementation,
                                       block_sizes=sizes, backend=kernel_backend)
  else:
    fn = lambda q, k, v: halo_attention(q, k, v, mesh=mesh, window=args.window, block_sizes=sizes,
                                        backend=kernel_backend)
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(q, kv, kv).compile()
  compile_s = time.perf_counter() - t0
  table = hlo_collectives(compiled.as_text())
  minimum = usp_minimum(args.batch, T_pad, args.heads, K, args.head_dim, U, R, dtype.itemsize) if args.kind == "usp" else None
  print(f"{args.kind} attention  target={target}  backend={kernel_backend}  mesh {MeshSpec(ulysses=U, ring=R)}  q [B,T,N,H]={q.shape} "
        f"kv heads={K} dtype={args.dtype}  blocks {sizes.block_q}x{sizes.block_kv}  compile {compile_s:.2f} s")
  _print_collectives(table, minimum)
  report = dict(kind=args.kind, target=target, backend=kernel_backend, blocks=[sizes.block_q, sizes.block_kv], mesh=dict(U=U, R=R), shape=list(q.shape), kv_heads=K,
                dtype=args.dtype, compile_s=compile_s, collectives=table, minimum=minimum, **_analyses(compiled))
  if args.topology and args.kind == "usp":
    report["local_kernels"] = compile_local_kernels(devices[0], batch=args.batch, heads=args.heads // U, q_len=T_pad // R,
                                                    kv_len=T_pad // R, head_dim=args.head_dim, dtype=args.dtype)
    _print_local_kernels(report["local_kernels"], max(K, U) // U)
  if args.topology:
    print("note: TPU numbers come from an ahead-of-time compile on this machine, not a runtime measurement")
  elif target == "cpu" and dtype == jnp.bfloat16:
    print("note: XLA:CPU converts bf16 collectives to f32, so bytes read 2x an accelerator's")
  if args.json:
    write_json(report, args.json, overwrite=True)
  return report


if __name__ == "__main__":
  main()
