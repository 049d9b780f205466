"""Ahead-of-time compile of the UMT5 text encoder for a TPU topology, on a machine without a TPU.

  python -m end_to_end.aot.text --topology v6e:2x4 --json text.json                 # one device
  python -m end_to_end.aot.text --topology v6e:2x4 --mesh U=8 --shard-weights       # weights split

What is compiled: `encode_text` jitted as the pipeline jits it (`pipelines.pipeline.run.text`:
`jax.jit(encode_text, static_argnames="config")`) for int32 ids and mask [B, L] (B = 2: the prompt
and the negative prompt under CFG; L = 512, Wan's text length). Placement is the pipeline's
(`pipelines.pipeline.load.placement.PlacedWeights`, DESIGN.md section 2): without sharded weights the
encoder's weights and inputs sit on ONE device (the topology's first), where it runs; with a mesh
whose `shard_weights` is set, every weight of >= 2^20 values is split over all the mesh's devices
along its largest axis the device count divides (`weight_placement.large_leaf_shardings`), ids and
mask are replicated, and GSPMD partitions the matmuls. Weights are `jax.ShapeDtypeStruct`s
(`abstract_umt5_params`, `wo` in fp32 as `load_umt5` keeps it): nothing is allocated.

Reported (XLA's numbers for the compiled program, per device): compile wall time,
`memory_analysis()`, `cost_analysis()`, the collectives in the compiled HLO
(`end_to_end.aot.collectives.hlo_collectives`) and the weight bytes per device. A COMPILE-TIME report,
not a runtime measurement. The 24 layers are one `lax.scan`: FLOPs, bytes accessed and collective
counts see the layer body once (per program text, not per encode); memory_analysis is exact.
libtpu and its environment: `end_to_end/aot/step.py`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from attention.mesh import MeshSpec
from end_to_end.aot import step as aot_step  # no JAX import either
from pipelines.commands.help import HelpFormatter  # no JAX import: the TPU environment is set first
from pipelines.storage.video_io import write_json

def _placed_inputs(devices: list[Any], config: Any, batch: int, text_len: int, dtype: str,
                   mesh_spec: MeshSpec | None, keep_wo_in_fp32: bool) -> tuple[Any, Any, str]:
  """(abstract params, abstract ids / mask, placement) with the pipeline's shardings."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

  from pipelines.wan.encoders import abstract_umt5_params
  from pipelines.wan.transformer import large_leaf_shardings

  params = abstract_umt5_params(config, dtype=jnp.dtype(dtype), keep_wo_in_fp32=keep_wo_in_fp32)
  if mesh_spec is not None and mesh_spec.shard_weights:
    mesh = mesh_spec.build(devices)
    weight_shardings, inputs, placement = large_leaf_shardings(params, mesh), NamedSharding(mesh, P()), "sharded"
  else:
    one = SingleDeviceSharding(devices[0])
    weight_shardings, inputs, placement = jax.tree.map(lambda _: one, params), one, "one device"
  placed = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), params, weight_shardings)
  ids = jax.ShapeDtypeStruct((batch, text_len), jnp.int32, sharding=inputs)
  return placed, ids, placement


def compile_text_encoder(devices: list[Any], *, preset: Any = "umt5-xxl", batch: int = 2, text_len: int = 512,
                         dtype: str = "bfloat16", mesh_spec: MeshSpec | None = None,
                         keep_wo_in_fp32: bool = True) -> dict[str, Any]:
  """AOT-compiles the UMT5 encoder `preset` on `devices` (module docstring).

  Args:
    devices: the topology's devices (`step.topology_devices`) or local ones.
    preset: a `UMT5_PRESETS` name or a `UMT5Config`.
    batch, text_len: B and L of the int32 ids [B, L].
    dtype: "bfloat16" or "float32": the weights' dtype (`wo`: see keep_wo_in_fp32).
    mesh_spec: None or a spec without `shard_weights`: one device, as the pipeline runs it; with
      `shard_weights`: the large weights split over the spec's devices (all of `devices`).
    keep_wo_in_fp32: `load_umt5`'s option (the pipeline loads with True); False: `wo` in `dtype`.

  Returns:
    dict: stage "text", model, dtype, wo_dtype, batch, text_len, placement ("one device" /
    "sharded"), mesh (`MeshSpec.describe()`; one device: `MeshSpec()`'s), devices (used),
    layers, compile_s (wall), compile_cpu_s (this process's CPU seconds: steadier than wall time
    on a shared host), weights_bytes_per_device, resident_bytes_per_device (bytes), memory_analysis,
    cost_analysis, collectives (`step.compiled_analysis`).

  Raises:
    ValueError: an unknown preset or dtype, batch / text_len < 1, a sharded mesh whose device
      count is not the topology's.
  """
  import jax

  from pipelines.wan.encoders import UMT5_PRESETS, UMT5Config, encode_text

  if not isinstance(preset, UMT5Config) and preset not in UMT5_PRESETS:
    raise ValueError(f"preset {preset!r} is not a UMT5 preset; use one of {sorted(UMT5_PRESETS)}")
  if dtype not in ("bfloat16", "float32"):
    raise ValueError(f"dtype {dtype!r} must be 'bfloat16' or 'float32'")
  if batch < 1 or text_len < 1:
    raise ValueError(f"batch={batch} and text_len={text_len} must be >= 1")
  sharded = mesh_spec is not None and mesh_spec.shard_weights
  if sharded and mesh_spec.devices != len(devices):
    raise ValueError(f"mesh {mesh_spec} needs {mesh_spec.devices} devices; the topology has {len(devices)}")
  config = preset if isinstance(preset, UMT5Config) else UMT5_PRESETS[preset]
  placed, ids, placement = _placed_inputs(devices, config, batch, text_len, dtype, mesh_spec, keep_wo_in_fp32)
  encode = jax.jit(encode_text, static_argnames="config")
  start, cpu_start = time.perf_counter(), time.process_time()
  compiled = encode.lower(placed, ids, ids, config=config).compile()
  compile_s, compile_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start

  weights = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(placed))
  report: dict[str, Any] = dict(
      stage="text", model=preset if isinstance(preset, str) else "custom", dtype=dtype,
      wo_dtype="float32" if keep_wo_in_fp32 else dtype, batch=batch, text_len=text_len, placement=placement,
      mesh=(mesh_spec if sharded else MeshSpec()).describe(), devices=len(devices) if sharded else 1,
      layers=config.num_layers, compile_s=compile_s, compile_cpu_s=compile_cpu_s, weights_bytes_per_device=int(weights),
      **aot_step.compiled_analysis(compiled))
  m = report.get("memory_analysis")
  if m is not None:  # arguments (weights, ids, mask) + temporaries + outputs (nothing is donated)
    report["resident_bytes_per_device"] = (m["argument_size_in_bytes"] + m["temp_size_in_bytes"]
                                           + m["output_size_in_bytes"] - m["alias_size_in_bytes"])
  return report


def format_row(r: dict[str, Any]) -> str:
  """One line of a text-stage report (GiB per device, TFLOP, collective counts / MiB)."""
  mem, cost = r.get("memory_analysis", {}), r.get("cost_analysis", {})
  from end_to_end.aot.collectives import summary

  return (f"text {r['model']} B={r['batch']} L={r['text_len']} {r['dtype']} (wo {r['wo_dtype']}) {r['placement']}"
          f"{' ' + r['mesh']['spec'] if r['placement'] == 'sharded' else ''}: compile {r['compile_s']:.1f} s "
          f"({r['compile_cpu_s']:.1f} s CPU), weights "
          f"{r['weights_bytes_per_device'] / 2**30:.2f} GiB, args {mem.get('argument_size_in_bytes', 0) / 2**30:.2f} "
          f"GiB, temp {mem.get('temp_size_in_bytes', 0) / 2**30:.2f} GiB, held "
          f"{r.get('resident_bytes_per_device', 0) / 2**30:.2f} GiB, code "
          f"{mem.get('generated_code_size_in_bytes', 0) / 2**20:.1f} MiB, {cost.get('flops', 0) / 1e12:.2f} TFLOP "
          f"(one layer body), collectives {summary(r['collectives'])}")


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m end_to_end.aot.text", description=__doc__,
                               formatter_class=HelpFormatter)
  ap.add_argument("--topology", required=True, help="TPU topology, e.g. v6e:2x4 (needs libtpu)")
  ap.add_argument("--preset", default="umt5-xxl", help="UMT5 preset (pipelines.wan.encoders.UMT5_PRESETS)")
  ap.add_argument("--batch", type=int, default=2, help="prompts encoded at once (2: prompt + negative)")
  ap.add_argument("--text-len", type=int, default=512, help="L, text tokens")
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  ap.add_argument("--mesh", help="with --shard-weights: the mesh the weights split over, e.g. U=8")
  ap.add_argument("--shard-weights", action="store_true", help="split the large weights over --mesh")
  ap.add_argument("--wo-in-dtype", action="store_true",
                  help="the FFN output projections in --dtype too (load_umt5 keep_wo_in_fp32=False; the pipeline "
                       "keeps them in fp32)")
  ap.add_argument("--init-timeout", type=float, default=120.0, help="seconds for libtpu to build the topology")
  ap.add_argument("--json", help="write the report here")
  args = ap.parse_args(argv)
  if args.shard_weights != bool(args.mesh):
    ap.error("--shard-weights and --mesh go together (without them the encoder runs on one device)")
  try:
    devices = aot_step.topology_devices(args.topology, timeout_s=args.init_timeout)
  except aot_step.TopologyUnavailable as e:
    print(f"error: {e}", file=sys.stderr)
    return 3
  mesh = MeshSpec.parse(args.mesh, shard_weights=True) if args.mesh else None
  report = compile_text_encoder(devices, preset=args.preset, batch=args.batch, text_len=args.text_len,
                                dtype=args.dtype, mesh_spec=mesh, keep_wo_in_fp32=not args.wo_in_dtype)
  report["topology"] = args.topology
  print(f"AOT compile for TPU {args.topology} (compile-time analysis, NOT a runtime measurement):")
  print(format_row(report), flush=True)
  if args.json:
    write_json(report, args.json, overwrite=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
