"""Ahead-of-time compile of one denoising step for a TPU topology, on a machine without a TPU.

What is compiled: the pipeline's denoise step (transformer forward on [cond; uncond] = 2 rows,
guidance mix, flow-UniPC update, finite-latents flag: `pipelines.pipeline.run.step.denoise_step`
with CFG on) for abstract inputs: weights replicated over the mesh (DESIGN.md section 2) or sharded,
latents / solver state replicated, the text as the pipeline passes it (every block's text K/V, and
the image tokens' for Wan 2.1 I2V, rows split over cfg; or the text states with `text_kv_once=False`),
the image-to-video or TI2V condition of the target, video tokens sharded over (ring, ulysses)
inside the forward. Nothing is allocated: weights are `ShapeDtypeStruct`s from `nnx.eval_shape`.

Reported per device (XLA's own numbers for the compiled program): `memory_analysis()` (argument,
output, temp and code bytes), `cost_analysis()` (flops, bytes accessed, transcendentals), compile
wall time, and the collectives in the compiled HLO (`end_to_end.aot.collectives.hlo_collectives`).
This is a COMPILE-TIME report, not a runtime measurement: no step is executed. XLA's cost analysis
and the HLO collective count see each loop body once (the transformer blocks are one `lax.scan`, the
attention runs block loops), so FLOPs, bytes accessed and collective counts are per program text,
not per step (a step runs the block body num_layers times); memory_analysis is exact.

libtpu: `pip install --no-deps --target DIR "libtpu==0.0.42.*"`, DIR on PYTHONPATH, and run with
JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 TPU_WORKER_HOSTNAMES=localhost so that libtpu does not wait
for a TPU metadata server (`bench.pipeline --aot` sets these, and ALLOW_MULTIPLE_LIBTPU_LOAD=1 so that
libtpu's one-process lock, which guards real chips, does not refuse a second compile-only process).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any


@dataclasses.dataclass(frozen=True)
class AotTarget:
  """One model and video that `--aot` compiles.

  Attributes:
    preset: the transformer preset (`pipelines.wan.transformer.config.PRESETS`).
    height, width, frames: the video.
    flow_shift: the scheduler's shift (the preset's, `pipelines.commands.presets`).
    ti2v: Wan 2.2 TI2V (`expand_timesteps`: per-token timesteps, the first frame's latents in the
      input, the Wan 2.2 VAE's 16x spatial latents).
  """
  preset: str
  height: int
  width: int
  frames: int
  flow_shift: float
  ti2v: bool = False


# name -> what `--aot` compiles (image-to-video: a 36-channel input of noise, mask and condition
# latents, and for Wan 2.1 I2V the CLIP image tokens' K/V in every cross-attention).
AOT_TARGETS = {"1.3b": AotTarget("wan2.1-t2v-1.3b", 480, 832, 81, 3.0),
               "14b": AotTarget("wan2.1-t2v-14b", 720, 1280, 81, 5.0),
               "a14b": AotTarget("wan2.2-t2v-a14b", 720, 1280, 81, 12.0),
               "i2v-14b": AotTarget("wan2.1-i2v-14b", 720, 1280, 81, 5.0),
               "ti2v-5b": AotTarget("wan2.2-ti2v-5b", 704, 1280, 121, 5.0, ti2v=True),
               # VACE 14B: the 14B plus 8 VACE blocks over a 96-channel context (no reference frame)
               "vace-14b": AotTarget("wan2.1-vace-14b", 720, 1280, 81, 5.0)}
# Transformers resident in device memory per preset (Wan 2.2 A14B: the high- and low-noise experts).
EXPERTS = {"wan2.2-t2v-a14b": 2}
# Environment for compiling with libtpu on a host without a TPU (see the module docstring).
OFFLINE_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "JAX_PLATFORMS": "cpu",
               "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
AOT_TEXT_LEN = 512


class TopologyUnavailable(RuntimeError):
  """The TPU topology could not be built here (no libtpu, locked, unknown name)."""


def topology_devices(name: str, timeout_s: float | None = None) -> list[Any]:
  """The devices of TPU topology `name` (e.g. "v6e:2x4", or "v5e:1x1" for one chip: a one-chip host,
  where libtpu's default host bounds are 2x2) for AOT compilation.

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
    one_chip = name.rpartition(":")[2] in ("1x1", "1x1x1")
    options = {"chips_per_host_bounds": [1, 1, 1]} if one_chip else {}
    return list(topologies.get_topology_desc(topology_name=name, platform="tpu", **options).devices)
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


def _text_spec(config: Any, text_len: int, dtype: Any, spec: Any, mesh: Any, *, once: bool) -> Any:
  """The step's text argument as the pipeline passes it for the [cond; uncond] rows: every block's
  text K/V (`transformer.TextKV`, [Z, 2, L, N, H] each, with the image tokens' [Z, 2, P, N, H] for
  a transformer with an image branch; computed once before the loop, rows split over "cfg" as
  `text_kv` lays them out), or with `once=False` the replicated text states [2, L, text_dim] (K/V
  computed inside the step, `CallOptions(text_kv_once=False)`)."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from attention.mesh import batch_axis

  from pipelines.pipeline.checked.model_facts import image_tokens
  from pipelines.wan.transformer import TextKV

  if not once:
    return spec(jax.ShapeDtypeStruct((2, text_len, config.text_dim), dtype))
  heads = config.num_attention_heads

  rows = NamedSharding(mesh, P(None, batch_axis(mesh)))

  def kv(tokens, layers=config.num_layers):
    return jax.ShapeDtypeStruct((layers, 2, tokens, heads, config.dim // heads), dtype, sharding=rows)

  image = image_tokens(config) or None
  vace = len(config.vace_layers) if config.has_vace else None  # the VACE blocks' own text K/V
  return TextKV(k_ZBLNH=kv(text_len), v_ZBLNH=kv(text_len), image_k_ZBPNH=None if image is None else kv(image),
                image_v_ZBPNH=None if image is None else kv(image),
                vace_k_VBLNH=None if vace is None else kv(text_len, vace),
                vace_v_VBLNH=None if vace is None else kv(text_len, vace))


def _condition_spec(config: Any, latent_shape: tuple[int, ...], dtype: Any, spec: Any, *, ti2v: bool) -> Any:
  """The step's condition argument for one video (`pipeline.run.step.denoise_step`): None for
  text-to-video; VACE's context [1, Cv, F, Hl, Wl] and scales [V]; TI2V's first-frame latents
  [1, C, 1, Hl, Wl] (per-token timesteps); image-to-video's mask + condition latents
  [1, in - out channels, F, Hl, Wl] and (Wan 2.1 I2V) the CLIP states [1 or 2, J, I] (unused by
  the step when the text K/V hold the image's)."""
  import jax
  import jax.numpy as jnp

  from pipelines.pipeline.checked.model_facts import image_tokens
  from pipelines.wan.conditioning import ImageConditioning, TI2VConditioning, VACEConditioning

  b, _, f, hl, wl = latent_shape
  if config.has_vace:  # the VACE context on the latents' grid and one scale per VACE block
    return VACEConditioning(
        context_BCFHW=spec(jax.ShapeDtypeStruct((b, config.vace_in_channels, f, hl, wl), jnp.float32)),
        scale_V=spec(jax.ShapeDtypeStruct((len(config.vace_layers),), jnp.float32)))
  if ti2v:
    return TI2VConditioning(patch_size=config.patch_size,
                            first_frame_BCFHW=spec(jax.ShapeDtypeStruct((b, config.out_channels, 1, hl, wl), jnp.float32)))
  if config.in_channels == config.out_channels:
    return None
  video = spec(jax.ShapeDtypeStruct((b, config.in_channels - config.out_channels, f, hl, wl), jnp.float32))
  image = None
  if config.has_image_branch:
    rows = b * (1 if config.pos_embed_seq_len is None else 2)
    tokens = image_tokens(config) // (rows // b)  # J of one frame
    image = spec(jax.ShapeDtypeStruct((rows, tokens, config.image_dim), dtype))
  return ImageConditioning(video_BCFHW=video, image_BJI=image)


MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                 "generated_code_size_in_bytes", "alias_size_in_bytes")


def compiled_analysis(compiled: Any) -> dict[str, Any]:
  """XLA's per-device analysis of a compiled program: memory_analysis (bytes, `MEMORY_FIELDS`),
  cost_analysis (flops, bytes accessed, transcendentals), collectives ({op: {count, bytes}}) and
  estimated_cycles (`estimated_cycles`); a key is absent where the backend gives no such analysis."""
  from end_to_end.aot.collectives import estimated_cycles, hlo_collectives

  text = compiled.as_text()
  out: dict[str, Any] = dict(collectives=hlo_collectives(text))
  cycles = estimated_cycles(text)
  if cycles is not None:
    out["estimated_cycles"] = cycles
  memory = compiled.memory_analysis()
  if memory is not None:
    out["memory_analysis"] = {f: int(getattr(memory, f, 0)) for f in MEMORY_FIELDS}
  cost = compiled.cost_analysis()
  if cost:
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    out["cost_analysis"] = {k: float(v) for k, v in cost.items()
                            if k in ("flops", "bytes accessed", "transcendentals")}
  return out


def compile_denoise_step(devices: list[Any], *, breakdown: bool = False, lower_only: bool = False,
                         **options: Any) -> dict[str, Any]:
  """AOT-compiles `denoise_step` for a Wan transformer on `devices`: `lower_denoise_step(devices,
  **options)`, then XLA's compile and its analyses.

  Args:
    breakdown: also the step's modelled time by op class (`end_to_end.aot.breakdown.analyse`).
    lower_only: trace and lower the step, no compile (checks that the arguments fit the step; the
      report then has no compile time, collectives, memory or cost analysis).
    options: `lower_denoise_step`'s keyword arguments (preset, video, dtype, mesh, ...).

  Returns:
    dict: `lower_denoise_step`'s report, plus compile_s (wall, lowering included), compile_cpu_s
    (this process's CPU seconds: steadier than wall time on a shared host), `compiled_analysis`'s
    memory_analysis (bytes per device), cost_analysis, collectives ({op: {count, bytes}}) and
    estimated_cycles, and resident_bytes_per_device (what one device holds while a step runs).

  Raises:
    ValueError: a mesh that does not fit the devices or heads.
  """
  lowered, report = lower_denoise_step(devices, **options)
  if lower_only:
    return report
  start, cpu_start = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  report.update(compile_s=report.pop("lower_s") + time.perf_counter() - start,
                compile_cpu_s=report.pop("lower_cpu_s") + time.process_time() - cpu_start,
                **compiled_analysis(compiled))
  if breakdown:
    from end_to_end.aot.breakdown import analyse
    report["breakdown"] = analyse(compiled.as_text(), devices[0].device_kind, len(devices))
  m = report.get("memory_analysis")
  if m is not None:
    # What one device holds while a step runs: the step's arguments (this expert's weights, the
    # latents, solver state and text; those the step does not read too), its temporaries and
    # outputs not aliased to donated inputs, plus the other expert's weights, which stay resident
    # (same shardings) in a two-expert model.
    arguments = max(m["argument_size_in_bytes"], report["arguments_bytes_per_device"])
    report["resident_bytes_per_device"] = (arguments + m["temp_size_in_bytes"]
                                           + m["output_size_in_bytes"] - m["alias_size_in_bytes"]
                                           + (report["experts"] - 1) * report["weights_bytes_per_device"])
  return report


def lower_denoise_step(devices: list[Any], *, preset: Any, height: int, width: int, frames: int, dtype: str,
                       text_len: int, flow_shift: float, mesh_spec: Any = None, attention_backend: str = "auto",
                       quantize: str | None = None, ti2v: bool = False, text_kv_once: bool = True,
                       context: tuple[int, int] | None = None) -> tuple[Any, dict[str, Any]]:
  """Lowers `denoise_step` for the Wan transformer `preset` on `devices`, its arguments abstract and
  placed as the pipeline places them.

  The step's conditioning follows the preset: a 36-channel transformer (image-to-video) gets the
  mask and condition latents (`ImageConditioning`) and, with an image branch (Wan 2.1 I2V), the CLIP
  image tokens' K/V held with the text's; `ti2v` gives Wan 2.2 TI2V's first-frame latents and
  per-token timesteps on latents of the 16x Wan 2.2 VAE.

  Args:
    preset: a transformer preset's name, or a `WanTransformerConfig` (reported as "custom").
    mesh_spec: an `attention.MeshSpec` (CFG split, weight sharding) or None for the default
      (U as large as the heads allow, no CFG split, weights replicated).
    attention_backend: "auto" (resolved for the devices' platform: the Pallas kernels on TPU),
      "xla" or "pallas".
    quantize: None or a `pipelines.wan.transformer.QUANTIZATION_MODES` mode: the block Linear weights
      are int8 / fp8 arguments (with their fp32 scales) of the compiled step.
    ti2v: Wan 2.2 TI2V (`AotTarget.ti2v`).
    text_kv_once: the step receives the text (and image) K/V computed before the loop (the
      pipeline's default); False: the step computes them from the text and image states.
    context: None (one clip of `frames`), or (context_frames, context_overlap) in video frames: the
      step runs the transformer on context windows of the video (`wan.conditioning.windows`), W of
      them at once on a mesh with a windows axis.

  Returns:
    (the lowered step, its report: model, mesh (`MeshSpec.describe()`), latent shape, tokens,
    text_bytes_per_device (the held K/V, or the text states), weights_bytes_per_device,
    arguments_bytes_per_device, experts, lower_s and lower_cpu_s).
  """
  import numpy as np

  import attention
  from pipelines.wan.transformer import PRESETS

  config = PRESETS[preset] if isinstance(preset, str) else preset
  preset = preset if isinstance(preset, str) else "custom"
  mesh_spec, mesh = _mesh(devices, config, mesh_spec)
  graphdef, placed, latent_shape, args = _step_arguments(
      config, mesh_spec, mesh, dtype=dtype, quantize=quantize, frames=frames, height=height, width=width,
      text_len=text_len, flow_shift=flow_shift, ti2v=ti2v, text_kv_once=text_kv_once)
  backend = attention.resolve_backend(attention_backend, devices[0].platform)
  step, plan, windows = _jitted_step(mesh_spec, mesh, backend, context, frames)
  start, cpu_start = time.perf_counter(), time.process_time()
  lowered = step.lower(graphdef, *args, plan=plan)
  # Every argument as the pipeline holds it: jit drops the arguments a step does not read (with the
  # K/V held: every block's cross-attention to_k / to_v, and add_k_proj / add_v_proj and the image
  # embedder of Wan 2.1 I2V; 3.9 + 3.9 GiB for the 14B I2V) from XLA's argument size, but the
  # pipeline keeps those weights on the devices.
  return lowered, dict(
      model=preset, dtype=dtype, quantize=quantize, height=height, width=width, frames=frames, text_len=text_len,
      ti2v=ti2v, text_kv_once=text_kv_once, context_windows=None if windows is None else windows.describe(),
      latent_shape=list(latent_shape), tokens=int(np.prod(latent_shape[2:]) // int(np.prod(config.patch_size))),
      mesh=mesh_spec.describe(), devices=len(devices), attention_backend=backend,
      text_bytes_per_device=_bytes_per_device(args[3]), weights_bytes_per_device=int(_bytes_per_device(placed)),
      arguments_bytes_per_device=int(_bytes_per_device(args)), experts=EXPERTS.get(preset, 1),
      lower_s=time.perf_counter() - start, lower_cpu_s=time.process_time() - cpu_start)


def _jitted_step(mesh_spec: Any, mesh: Any, backend: str, context: tuple[int, int] | None, frames: int):
  """(the jitted `denoise_step` with CFG on, its `ParallelPlan`, the context windows or None)."""
  import jax

  from pipelines.parallel.plan import ParallelPlan
  from pipelines.pipeline.run.step import denoise_step

  # Built directly (not `ParallelPlan.build`): the topology's devices are not this host's.
  plan = ParallelPlan(spec=mesh_spec, mesh=mesh, attention_backend=backend)
  windows = None
  if context is not None:
    from pipelines.pipeline.checked.window_inputs import context_windows
    windows = context_windows(context[0], context[1], "pyramid", num_frames=frames)
  step = jax.jit(functools.partial(denoise_step, cfg=True, windows=windows), static_argnums=0,
                 static_argnames="plan", donate_argnums=(2, 3))
  return step, plan, windows


def _mesh(devices: list[Any], config: Any, mesh_spec: Any) -> tuple[Any, Any]:
  """(the mesh spec, the mesh built on `devices`): `mesh_spec` checked against the devices and the
  heads, or the default one (`default_degrees`)."""
  import attention

  if mesh_spec is None:
    ulysses, ring = default_degrees(len(devices), config.num_attention_heads)
    mesh_spec = attention.MeshSpec(ulysses=ulysses, ring=ring)
  if mesh_spec.devices != len(devices):
    raise ValueError(f"mesh {mesh_spec} needs {mesh_spec.devices} devices; the topology has {len(devices)}")
  mesh_spec.check(num_heads=config.num_attention_heads, device_count=len(devices), cfg_active=True)
  return mesh_spec, mesh_spec.build(devices)


def _step_arguments(config: Any, mesh_spec: Any, mesh: Any, *, dtype: str, quantize: str | None, frames: int,
                    height: int, width: int, text_len: int, flow_shift: float, ti2v: bool,
                    text_kv_once: bool) -> tuple[Any, Any, tuple[int, ...], tuple]:
  """(graphdef, the placed weights, the latent shape, the step's arguments after the graphdef): the
  transformer's weights from `nnx.eval_shape` (quantized as `quantize` says), placed as
  `weight_shardings` places them; latents, solver state and timestep replicated; the text and the
  condition as the pipeline passes them (`_text_spec`, `_condition_spec`). Nothing is allocated."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P

  from pipelines.wan import schedulers
  from pipelines.wan.transformer import build_transformer, param_shapes, quantize_transformer, weight_shardings

  replicated = NamedSharding(mesh, P())
  model_dtype = jnp.dtype(dtype)

  def zeros(tree):
    return {k: zeros(v) if isinstance(v, dict) else jnp.zeros(v, jnp.float32) for k, v in tree.items()}

  def spec(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)

  abstract = nnx.eval_shape(lambda: quantize_transformer(
      build_transformer(config, zeros(param_shapes(config)), model_dtype), quantize))
  graphdef, state = nnx.split(abstract)
  spatial = 16 if ti2v else 8  # the Wan 2.2 VAE of TI2V-5B: 16x spatial
  latent_shape = (1, config.out_channels, (frames - 1) // 4 + 1, height // spatial, width // spatial)
  solver = schedulers.UniPCConfig(flow_shift=flow_shift).set_timesteps(50).init_state(latent_shape, jnp.float32)
  placed = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state,
                        weight_shardings(state, mesh, mesh_spec.shard_weights))
  args = (placed, spec(jax.ShapeDtypeStruct(latent_shape, jnp.float32)),
          jax.tree.map(lambda x: spec(jnp.asarray(x)), solver),
          _text_spec(config, text_len, model_dtype, spec, mesh, once=text_kv_once),
          spec(jax.ShapeDtypeStruct((), jnp.float32)), None,
          _condition_spec(config, latent_shape, model_dtype, spec, ti2v=ti2v))
  return graphdef, placed, latent_shape, args


def _bytes_per_device(tree: Any) -> int:
  """Bytes one device holds of a pytree of `ShapeDtypeStruct`s with shardings."""
  import jax

  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def format_header(topology: str) -> str:
  """The AOT table's title and column names."""
  return "\n".join([
      f"AOT compile for TPU {topology} (compile-time analysis on this machine; NOT a runtime "
      "measurement). Denoise step = transformer on 2 rows (CFG) + guidance + UniPC; per device:",
      f"{'model':22s} {'video':>14s} {'tokens':>7s} {'mesh':>8s} {'compile s':>11s} {'args GiB':>9s} "
      f"{'temp GiB':>9s} {'held GiB':>9s} {'code MiB':>8s} {'TFLOP':>8s} {'GB accessed':>11s}  "
      "collectives (count / MiB)",
      "(compile s: wall / CPU seconds of this process; args: XLA's, without the arguments the step does not read; held = every argument the pipeline "
      "holds + temp + outputs not aliased to donated inputs + a second expert's weights where the "
      "model has two; 'kv/step': the step computes the text (and image) K/V itself instead of receiving them)",
      "(TFLOP, GB accessed and collectives count each loop body ONCE: the blocks run in one lax.scan "
      "and attention in block loops, so these are per program text, not per step)"])


def format_row(r: dict[str, Any]) -> str:
  """One row of the AOT table (GiB per device, TFLOP per device, collective counts / MiB)."""
  label = r["model"] + ("" if r.get("text_kv_once", True) else " kv/step")
  if "error" in r:
    return f"{label:22s} {r['frames']}x{r['height']}x{r['width']:<6d} failed: {r['error']}"
  mem, cost = r.get("memory_analysis", {}), r.get("cost_analysis", {})
  from end_to_end.aot.collectives import summary

  return (f"{label:22s} {r['frames']:>3d}x{r['height']}x{r['width']:<5d} {r['tokens']:7d} "
          f"{r['mesh']['spec'] + (' sw' if r['mesh']['shard_weights'] else ''):>8s} "
          f"{r['compile_s']:5.0f}/{r.get('compile_cpu_s', 0):<5.0f} "
          f"{mem.get('argument_size_in_bytes', 0) / 2**30:9.2f} {mem.get('temp_size_in_bytes', 0) / 2**30:9.2f} "
          f"{r.get('resident_bytes_per_device', 0) / 2**30:9.2f} {mem.get('generated_code_size_in_bytes', 0) / 2**20:8.1f} "
          f"{cost.get('flops', 0) / 1e12:8.1f} {cost.get('bytes accessed', 0) / 1e9:11.1f}  {summary(r['collectives'])}")
