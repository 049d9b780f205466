"""The checks of `generate` that need JAX up (still no weights): the model's facts from its JSON
files, joining a multi-process run, --devices against the backend, the drawn seed, --mesh auto and
the device note of the summary line. The mesh rules themselves are `pipelines.parallel.plan`'s
(through the request, `run_plan.build_request`).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from attention.mesh_spec import DEVICE_FLAG as _DEVICE_FLAG, MeshSpec
from pipelines.cli.flags import flag_error
from pipelines.commands.flags import UsageError
from pipelines.commands.model_files import read_facts
from pipelines.commands.presets import TINY_MODELS
from pipelines.parallel import distributed
from pipelines.parallel.mesh_rules import check_spec
from pipelines.wan.pretrained import download_snapshot, hub_id

from pipelines.cli.plan import Plan


def fetch_model(plan: Plan) -> Plan:
  """A Hugging Face Hub --model (org/name[@revision]) downloaded into the Hub cache where missing
  (`pretrained.download_snapshot`: the files the pipeline loads; processes of one host download once):
  the plan with its snapshot folder and commit. Any other --model: the plan as it is.

  Raises:
    weights.CheckpointError: no such repo or revision, not a Wan pipeline, not cached while offline.
  """
  parsed = hub_id(plan.model)
  if parsed is None:
    return plan
  snapshot = download_snapshot(*parsed)
  return dataclasses.replace(plan, model_folder=snapshot.folder, model_commit=snapshot.commit)


def model_facts(plan: Plan) -> tuple[Any, dict[str, str] | None]:
  """(the `ModelFacts` of --model or of the single files (`pipelines.pipeline.checked.model_facts`), named as
  the pipeline names it ("tiny" for both tiny models, a Hub model's repo id); the single files' layouts, or None).
  A folder's weight files are checked too (safetensors present, headers intact), and the single
  files' (and an official Wan folder's) headers give their configs (`model_files.read_facts`); no tensor
  data is read.

  Raises:
    weights.CheckpointError: a folder that is not a Wan pipeline, or a bad weight file.
    UsageError: a tokenizer folder that cannot be read.
  """
  from pipelines.pipeline.checked.model_facts import ModelFacts
  from pipelines.wan.pretrained import PipelineIndex, Sources, folder_layout

  found = None
  if plan.files is not None:
    facts, found = read_facts(plan.files, plan.dtype)
  elif plan.model in TINY_MODELS:
    facts = ModelFacts.of_model(plan.model, plan.dtype)
  elif folder_layout(plan.model_folder or plan.model) == "official":  # Wan's own layout: as single files
    facts, _ = read_facts(Sources.official(plan.model_folder or plan.model), plan.dtype)
  else:
    folder = plan.model_folder or plan.model
    PipelineIndex.read(folder).check_weights()
    name = None if plan.model_folder is None else hub_id(plan.model)[0]  # a Hub model: its repo id
    facts = ModelFacts.from_folder(folder, plan.dtype, name=name)
  return dataclasses.replace(facts, quantize=plan.quantize), found


def join(plan: Plan, facts: Any) -> None:
  """A multi-process run: checks the heads first (no need to wait for the other processes to learn
  that), joins JAX's distributed runtime, and checks that every process runs the same command.

  Raises:
    UsageError: heads that U does not split, or settings that differ between the processes.
    distributed.DistributedError: the coordinator was not reached in time.
  """
  if plan.mesh is not None:
    try:
      check_spec(plan.mesh, cfg_active=None, heads=facts.transformer.num_attention_heads)
    except ValueError as e:
      raise flag_error(e) from e
  print(f"generate: process {plan.processes.process_id} of {plan.processes.num_processes}: joining "
        f"{plan.processes.coordinator} (waiting up to {plan.processes.timeout_s} s)", file=sys.stderr)
  distributed.initialize(plan.processes)
  try:  # the same command on every process (only the id differs)
    own = ("processes", "compile_cache", "model_folder", "request", "recorded")  # per-host paths; the flags below
    distributed.check_same_settings({k: v for k, v in dataclasses.asdict(plan).items() if k not in own}
                                    | plan.request)  # each request argument by name
  except ValueError as e:
    raise UsageError(str(e)) from e


def check_device_flag(plan: Plan) -> None:
  """--devices simulates CPU devices: only on the CPU backend, and only if JAX honoured the count.

  Raises:
    UsageError: --devices on an accelerator backend, or a device count JAX did not honour.
  """
  import jax

  if plan.devices is None:
    return
  backend, count = jax.default_backend(), jax.device_count()
  if backend != "cpu":
    raise UsageError(f"--devices simulates CPU devices, but JAX runs on {backend} with {count} devices; "
                     "drop --devices (or set JAX_PLATFORMS=cpu to simulate on the CPU)")
  if count != plan.devices:
    raise UsageError(f"--devices {plan.devices} asked for {plan.devices} CPU devices but JAX sees {count} "
                     "(its backend started before generate could set XLA_FLAGS); run generate in a "
                     f"fresh process or set XLA_FLAGS=--{_DEVICE_FLAG}={plan.devices}")


def draw_seed(plan: Plan) -> int:
  """--seed, or for --seed -1 / none one drawn here (`seed.random_seed`; process 0's in a
  multi-process run), so that it is printed before any compute."""
  import jax
  import numpy as np

  from pipelines.pipeline.checked.seed import random_seed

  if plan.asked("seed") is not None:
    return plan.asked("seed")
  seed = random_seed()
  if jax.process_count() > 1:  # one random seed for all: process 0's
    from jax.experimental import multihost_utils
    seed = int(multihost_utils.broadcast_one_to_all(np.int32(seed)))
  return seed


def device_note(plan: Plan, requested: int | None) -> str:
  """The devices the run uses, for the summary line and the sidecar."""
  import jax

  backend, count, local = jax.default_backend(), jax.device_count(), jax.local_device_count()
  if backend == "cpu" and requested is not None and local == requested:
    note = f"simulating {local} CPU devices for the mesh (--{_DEVICE_FLAG}={local})"
  else:
    note = f"{local} {backend} device(s)"
  if jax.process_count() > 1:
    note += (f" in each of {jax.process_count()} processes ({count} in all; this is process "
             f"{jax.process_index()})")
  if plan.mesh.devices < count:
    note += f"; the mesh uses the first {plan.mesh.devices}"
  return note


def auto_mesh(plan: Plan, request: Any) -> tuple[Plan, Any]:
  """--mesh auto: the planner's pick for the visible devices (`_pick`), printed, in the plan and in
  the request (its `ParallelPlan` built again for that mesh).

  Raises:
    UsageError: no mesh of the visible devices fits the model.
  """
  from pipelines.parallel.plan import ParallelPlan

  best = _pick(plan, request)
  several = best.devices > 1
  try:
    parallel = ParallelPlan.build(best if several else None, heads=request.model.transformer.num_attention_heads,
                                  cfg_active=request.cfg, shard_weights=several and best.shard_weights,
                                  attention_backend=plan.asked("attention_backend"),
                                  vae_parallel=plan.asked("vae_parallel"),
                                  attention_exchange=plan.asked("attention_exchange"))
  except ValueError as e:
    raise flag_error(e) from e
  return dataclasses.replace(plan, mesh=best), dataclasses.replace(request, plan=parallel)


def _pick(plan: Plan, request: Any) -> MeshSpec:
  """The planner's pick (`pipelines.parallel.planner`) for the visible devices, printed (process 0).

  The chip is read from JAX's device kind (TPU v5e / v6e, NVIDIA H100 / H200); on other devices
  (the CPU) the memory is not modelled and the pick is by the modelled step time alone.

  Raises:
    UsageError: no mesh of the visible devices fits the model.
  """
  import jax

  from pipelines.parallel import planner

  kind = jax.devices()[0].device_kind.lower()
  chip = planner.chip_of(kind)
  modelled = chip or planner.Chip(kind or "device", float("inf"), 1e12, 1e10, "not modelled")
  from pipelines.wan.transformer import param_counts, quantized_counts

  config = request.model.transformer
  quantized = quantized_counts(config) if request.model.quantize else (0, 0)
  found = planner.candidates(config, request.token_facts, param_counts=param_counts(config), quantized=quantized,
                             devices=jax.device_count(), frames=request.num_frames,
                             height=request.height, width=request.width, cfg=request.cfg,
                             dtype=request.model.dtype, experts=request.model.experts, chip=modelled,
                             windows=None if request.windows is None else (request.clip_frames, _parallel_windows(request)))
  best = planner.recommend(found)
  if best is None:
    raise UsageError(f"--mesh auto: no mesh of the {jax.device_count()} visible {kind} devices fits this model "
                     "and video (python -m end_to_end.plan shows the candidates); use more devices or a "
                     "smaller --size / --frames")
  if plan.writes:
    print(f"generate: --mesh auto: {best.mesh}{' with --shard-weights' if best.mesh.shard_weights else ''} "
          f"for {jax.device_count()} {kind} device(s) (planner: modelled {best.step_s_model:.3g} s/step"
          + (f", {best.bytes_per_device / planner.GiB:.1f} GiB per device on {chip.name})" if chip else
             "; memory not modelled on this device kind)"), file=sys.stderr)
  return best.mesh


def _parallel_windows(request: Any) -> int:
  """The context windows a mesh's W could run at once: all of them when blended at every step, one
  when they continue one another (each waits for the one before)."""
  return 1 if request.windows.fuse == "continue" else len(request.windows.starts)
