"""Ahead-of-time compile of one denoising step for a TPU topology, on a machine without a TPU.

What is compiled: the pipeline's denoise step (transformer forward on [cond; uncond] = 2 rows,
guidance mix, flow-UniPC update, finite-latents flag: `pipelines.pipeline.step.denoise_step`
with CFG on) for abstract inputs: weights replicated over the mesh (DESIGN.md section 2), latents /
solver state / text replicated, video tokens sharded over (ring, ulysses) inside the forward.
Nothing is allocated: weights are `ShapeDtypeStruct`s from `nnx.eval_shape`.

Reported per device (XLA's own numbers for the compiled program): `memory_analysis()` (argument,
output, temp and code bytes), `cost_analysis()` (flops, bytes accessed, transcendentals), compile
wall time, and the collectives in the compiled HLO (`end_to_end.collectives.hlo_collectives`).
This is a COMPILE-TIME report, not a runtime measurement: no step is executed. XLA's cost analysis
and the HLO collective count see each loop body once (the transformer blocks are one `lax.scan`, the
attention runs block loops), so FLOPs, bytes accessed and collective counts are per program text,
not per step (a step runs the block body num_layers times); memory_analysis is exact.

libtpu: `pip install --no-deps --target DIR "libtpu==0.0.42.*"`, DIR on PYTHONPATH, and run with
JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 TPU_WORKER_HOSTNAMES=localhost so that libtpu does not wait
for a TPU metadata server (`benchmark --aot` sets these, and ALLOW_MULTIPLE_LIBTPU_LOAD=1 so that
libtpu's one-process lock, which guards real chips, does not refuse a second compile-only process).
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any


# name -> (transformer preset, height, width, flow shift) compiled by `--aot`.
AOT_TARGETS = {"1.3b": ("wan2.1-t2v-1.3b", 480, 832, 3.0), "14b": ("wan2.1-t2v-14b", 720, 1280, 5.0),
               "a14b": ("wan2.2-t2v-a14b", 720, 1280, 12.0)}
# Transformers resident in device memory per preset (Wan 2.2 A14B: the high- and low-noise experts).
EXPERTS = {"wan2.2-t2v-a14b": 2}
# Environment for compiling with libtpu on a host without a TPU (see the module docstring).
OFFLINE_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "JAX_PLATFORMS": "cpu",
               "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
AOT_FRAMES = 81
AOT_TEXT_LEN = 512


class TopologyUnavailable(RuntimeError):
  """The TPU topology could not be built here (no libtpu, locked, unknown name)."""


def topology_devices(name: str, timeout_s: float | None = None) -> list[Any]:
  """The devices of TPU topology `name` (e.g. "v6e:2x4") for AOT compilation.

  Sets `OFFLINE_ENV` (where not set) first; JAX must not have initialised a backend yet for
  JAX_PLATFORMS to apply. With `timeout_s`, a watchdog ends the process when libtpu blocks inside C
  (e.g. waiting for a metadata server), which a Python-level timeout could not.

  Raises:
    TopologyUnavailable: libtpu missing or unusable, with how to fix it.
  """
  import faulthandler
  import os
  import sys

  for key, value in OFFLINE_ENV.items():
    os.environ.setdefault(key, value)
  from jax.experimental import topologies

  if timeout_s is not None:
    faulthandler.dump_traceback_later(timeout_s, exit=True, file=sys.__stderr__)
  try:
    return list(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
  except Exception as e:  # noqa: BLE001 - the optional TPU path: say why it is unavailable, then stop
    raise TopologyUnavailable(
        f"cannot build TPU topology {name!r}: {e}. Install libtpu (pip install --no-deps --target DIR "
        "'libtpu==0.0.42.*'), put DIR on PYTHONPATH and set JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 "
        "TPU_WORKER_HOSTNAMES=localhost (ALLOW_MULTIPLE_LIBTPU_LOAD=1 if another process holds libtpu)") from e
  finally:
    if timeout_s is not None:
      faulthandler.cancel_dump_traceback_later()


def default_degrees(devices: int, heads: int) -> tuple[int, int]:
  """(U, R) with U * R == devices and the largest U that divides `heads` (Ulysses is the cheaper
  axis on one ICI island; DESIGN.md section 2)."""
  ulysses = max(u for u in range(1, devices + 1) if devices % u == 0 and heads % u == 0)
  return ulysses, devices // ulysses


def _text_kv_spec(config: Any, text_len: int, dtype: Any, spec: Any) -> Any:
  """The step's text argument as the pipeline passes it: every block's text K/V of the [cond;
  uncond] rows (`transformer.TextKV`, [Z, 2, L, N, H] each, computed once before the loop)."""
  import jax

  from pipelines.wan.transformer import TextKV

  heads = config.num_attention_heads
  kv = jax.ShapeDtypeStruct((config.num_layers, 2, text_len, heads, config.dim // heads), dtype)
  return TextKV(k_ZBLNH=spec(kv), v_ZBLNH=spec(kv))


def compile_denoise_step(devices: list[Any], *, preset: str, height: int, width: int, frames: int,
                         dtype: str, text_len: int, flow_shift: float, mesh_spec: Any = None,
                         attention_backend: str = "auto", quantize: str | None = None) -> dict[str, Any]:
  """AOT-compiles `denoise_step` for the Wan transformer `preset` on `devices`.

  Args:
    mesh_spec: an `attention.MeshSpec` (CFG split, weight sharding) or None for the default
      (U as large as the heads allow, no CFG split, weights replicated).
    attention_backend: "auto" (resolved for the devices' platform: the Pallas kernels on TPU),
      "xla" or "pallas".
    quantize: None or a `pipelines.wan.quantization.MODES` mode: the block Linear weights are
      int8 / fp8 arguments (with their fp32 scales) of the compiled step.

  Returns:
    dict: model, mesh (`MeshSpec.describe()`), latent shape, tokens, compile_s, memory_analysis
    (bytes per device), cost_analysis, collectives ({op: {count, bytes}}).

  Raises:
    ValueError: a mesh that does not fit the devices or heads.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P

  import attention
  from end_to_end.collectives import hlo_collectives
  from pipelines.wan import schedulers
  from pipelines.wan.transformer import build_transformer
  from pipelines.wan.transformer_config import PRESETS, param_shapes

  config = PRESETS[preset]
  if mesh_spec is None:
    ulysses, ring = default_degrees(len(devices), config.num_attention_heads)
    mesh_spec = attention.MeshSpec(ulysses=ulysses, ring=ring)
  if mesh_spec.devices != len(devices):
    raise ValueError(f"mesh {mesh_spec} needs {mesh_spec.devices} devices; the topology has {len(devices)}")
  mesh_spec.check(num_heads=config.num_attention_heads, device_count=len(devices), cfg_active=True)
  mesh = mesh_spec.build(devices)
  replicated = NamedSharding(mesh, P())
  model_dtype = jnp.dtype(dtype)

  def zeros(tree):
    return {k: zeros(v) if isinstance(v, dict) else jnp.zeros(v, jnp.float32) for k, v in tree.items()}

  from pipelines.wan.quantization import quantize_transformer

  abstract = nnx.eval_shape(lambda: quantize_transformer(
      build_transformer(config, zeros(param_shapes(config)), model_dtype), quantize))
  graphdef, state = nnx.split(abstract)

  def spec(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)

  latent_shape = (1, config.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8)
  solver = schedulers.UniPCConfig(flow_shift=flow_shift).set_timesteps(50).init_state(latent_shape, jnp.float32)
  from pipelines.wan.transformer import weight_shardings

  placed = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state,
                        weight_shardings(state, mesh, mesh_spec.shard_weights))
  args = (placed, spec(jax.ShapeDtypeStruct(latent_shape, jnp.float32)),
          jax.tree.map(lambda x: spec(jnp.asarray(x)), solver),
          _text_kv_spec(config, text_len, model_dtype, spec),
          spec(jax.ShapeDtypeStruct((), jnp.float32)))
  from pipelines.parallel.plan import ParallelPlan
  from pipelines.pipeline.step import denoise_step

  backend = attention.resolve_backend(attention_backend, devices[0].platform)
  # Built directly (not `ParallelPlan.build`): the topology's devices are not this host's.
  plan = ParallelPlan(spec=mesh_spec, mesh=mesh, attention_backend=backend)
  step = jax.jit(functools.partial(denoise_step, cfg=True), static_argnums=0, static_argnames="plan",
                 donate_argnums=(2, 3))
  start = time.perf_counter()
  compiled = step.lower(graphdef, *args, plan=plan).compile()
  compile_s = time.perf_counter() - start

  report: dict[str, Any] = dict(
      model=preset, dtype=dtype, quantize=quantize, height=height, width=width, frames=frames, text_len=text_len,
      latent_shape=list(latent_shape), tokens=int(np.prod(latent_shape[2:]) // int(np.prod(config.patch_size))),
      mesh=mesh_spec.describe(), devices=len(devices), attention_backend=backend, compile_s=compile_s,
      collectives=hlo_collectives(compiled.as_text()))
  weights = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(placed))
  experts = EXPERTS.get(preset, 1)
  report.update(weights_bytes_per_device=int(weights), experts=experts)
  memory = compiled.memory_analysis()
  if memory is not None:
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes", "alias_size_in_bytes")
    report["memory_analysis"] = m = {f: int(getattr(memory, f, 0)) for f in fields}
    # What one device holds while a step runs: the step's arguments (this expert's weights, the
    # latents, solver state and text), its temporaries and outputs not aliased to donated inputs,
    # plus the other expert's weights, which stay resident (same shardings) in a two-expert model.
    report["resident_bytes_per_device"] = (m["argument_size_in_bytes"] + m["temp_size_in_bytes"]
                                           + m["output_size_in_bytes"] - m["alias_size_in_bytes"]
                                           + (experts - 1) * int(weights))
  cost = compiled.cost_analysis()
  if cost:
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    report["cost_analysis"] = {k: float(v) for k, v in cost.items()
                               if k in ("flops", "bytes accessed", "transcendentals")}
  return report


def format_header(topology: str) -> str:
  """The AOT table's title and column names."""
  return "\n".join([
      f"AOT compile for TPU {topology} (compile-time analysis on this machine; NOT a runtime "
      "measurement). Denoise step = transformer on 2 rows (CFG) + guidance + UniPC; per device:",
      f"{'model':16s} {'video':>14s} {'tokens':>7s} {'mesh':>8s} {'compile s':>9s} {'args GiB':>9s} "
      f"{'temp GiB':>9s} {'held GiB':>9s} {'code MiB':>8s} {'TFLOP':>8s} {'GB accessed':>11s}  "
      "collectives (count / MiB)",
      "(held = args + temp + outputs not aliased to donated inputs + a second expert's weights where the "
      "model has two)",
      "(TFLOP, GB accessed and collectives count each loop body ONCE: the blocks run in one lax.scan "
      "and attention in block loops, so these are per program text, not per step)"])


def format_row(r: dict[str, Any]) -> str:
  """One row of the AOT table (GiB per device, TFLOP per device, collective counts / MiB)."""
  if "error" in r:
    return f"{r['model']:16s} {r['frames']}x{r['height']}x{r['width']:<6d} failed: {r['error']}"
  mem, cost = r.get("memory_analysis", {}), r.get("cost_analysis", {})
  coll = ", ".join(f"{op} {v['count']} / {v['bytes'] / 2**20:.1f}" for op, v in r["collectives"].items() if v["count"])
  return (f"{r['model']:16s} {r['frames']:>3d}x{r['height']}x{r['width']:<5d} {r['tokens']:7d} "
          f"{r['mesh']['spec'] + (' sw' if r['mesh']['shard_weights'] else ''):>8s} {r['compile_s']:9.1f} "
          f"{mem.get('argument_size_in_bytes', 0) / 2**30:9.2f} {mem.get('temp_size_in_bytes', 0) / 2**30:9.2f} "
          f"{r.get('resident_bytes_per_device', 0) / 2**30:9.2f} {mem.get('generated_code_size_in_bytes', 0) / 2**20:8.1f} "
          f"{cost.get('flops', 0) / 1e12:8.1f} {cost.get('bytes accessed', 0) / 1e9:11.1f}  {coll or 'none'}")
