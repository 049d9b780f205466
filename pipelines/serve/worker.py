"""The one thread that owns the devices: takes batches from the job table, runs each through
`WanPipeline.generate` with a progress-and-cancel hook and a denoising checkpoint, writes each job's
video and sidecar atomically, then marks the job completed.

A batch is up to `max_batch` queued jobs of one batch key (`api.batch_key`: same size, frames, steps,
guidance, LoRAs); each job keeps its prompt and its own seed (the batch's request is seeded with one
seed per video, `seed.video_seeds`), so each video equals its request run alone up to the batch's
rounding, and its sidecar records its own prompt and seed (`GenerationRequest.video_settings`).

Cancelling: a cancelled job is marked at once (`store.cancel`); a running batch stops at the next
step once none of its jobs is still wanted (a member cancelled alone is dropped when the batch ends).
A job deleted while its batch runs is dropped the same way, and forgotten with its files when the
batch ends (`JobStore.purge`); one cancelled or deleted while its files are written has them removed
again and never counts as failed.
A job that raises fails with its message; the worker goes on with the next batch. In a
multi-process server every process prepares the batch (LoRAs, request) and all agree before any
runs it (`Worker._prepare`), so one process's failure there fails the jobs without stranding the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import shutil
import threading
import time
import traceback
from typing import Any

import numpy as np

from pipelines.commands.versions import versions
from pipelines.pipeline.run.call_options import CallOptions
from pipelines.pipeline.run.loop import LoopState, StepHook
from pipelines.pipeline.checked.request import GenerationRequest
from pipelines.pipeline.run.resume import ResumeConfig, holds_checkpoint
from pipelines.serve import api, events, multihost, previews, references, streams
from pipelines.serve.store import HIDDEN
from pipelines.storage import video_io
from pipelines.storage import video_tags


class BatchCancelled(Exception):
  """Every job of the running batch was cancelled: the loop stops before its next step."""


class BatchNotPrepared(RuntimeError):
  """Another process of a multi-process server failed to prepare the batch: no process runs it."""


class ServerStopping(Exception):
  """The server is shutting down: the batch stops before its next step and stays in_progress, its
  checkpoint kept, so the next start resumes it."""


class JobProgress(StepHook):
  """Writes each step's progress into the job table and stops the batch once all of it is cancelled
  (or the server is stopping).

  Args:
    store: the `JobStore`.
    job_ids: the batch's jobs still wanted when it started.
    observe_step: called with each step's seconds (the metrics' histogram).
    stopping: set when the server shuts down.
    channel: a multi-process server's `multihost.Channel` (the decision is broadcast), or None.
  """

  def __init__(self, store: Any, job_ids: list[str], observe_step: Any, stopping: threading.Event,
               channel: Any = None):
    self.store, self.job_ids, self.observe_step, self.stopping = store, job_ids, observe_step, stopping
    self.channel = channel

  def before_step(self, state: LoopState) -> None:
    code = multihost.STOPPING if self.stopping.is_set() else multihost.GO
    if code == multihost.GO:
      statuses = self.store.statuses(self.job_ids)
      if not any(statuses.get(j) == "in_progress" for j in self.job_ids):
        code = multihost.CANCELLED
    if self.channel is not None:
      self.channel.action(code)
    _stop_for(code, state)

  def after_step(self, state: LoopState) -> None:
    self.observe_step(state.step_times[-1])
    self.store.progress(self.job_ids, state.step + 1, state.steps)


class FollowStep(StepHook):
  """On a process other than 0: before each step, process 0's decision (go on, cancelled, stopping)."""

  def __init__(self, channel: Any):
    self.channel = channel

  def before_step(self, state: LoopState) -> None:
    _stop_for(self.channel.action(None), state)


def _stop_for(code: int, state: LoopState) -> None:
  if code == multihost.STOPPING:
    raise ServerStopping(f"stopped before step {state.step + 1}/{state.steps}")
  if code == multihost.CANCELLED:
    raise BatchCancelled(f"cancelled before step {state.step + 1}/{state.steps}")


@dataclasses.dataclass
class Worker:
  """The scheduling loop (`start` runs it on a daemon thread; `stop` ends it at the running batch's next
  step, the batch left to resume).

  Attributes:
    pipe: the loaded `WanPipeline` (only this thread calls it after warm-up).
    config: the `ServeConfig`.
    store: the `JobStore`.
    metrics: the service's `Metrics`.
    wake: set when a job is queued (the loop otherwise polls every `poll_s`).
    paused: while set, no new batch starts (the running one finishes).
    running: the id of the batch running now, or None.
    channel: a multi-process server's `multihost.Channel` (process 0 broadcasts what it runs; the
      other processes run `follow`), or None.
  """
  pipe: Any
  config: Any
  store: Any
  metrics: Any
  wake: threading.Event = dataclasses.field(default_factory=threading.Event)
  poll_s: float = 0.5
  paused: threading.Event = dataclasses.field(default_factory=threading.Event)
  stopping: threading.Event = dataclasses.field(default_factory=threading.Event)
  thread: threading.Thread | None = None
  active_loras: tuple[str, ...] = ()
  running: str | None = None
  channel: Any = None
  streams: queue.Queue = dataclasses.field(default_factory=queue.Queue)  # `streams.StreamSession`s to run

  def start(self) -> None:
    """Runs `loop` on a daemon thread."""
    self.thread = threading.Thread(target=self.loop, name="wan-serve-worker", daemon=True)
    self.thread.start()

  def stop(self, timeout: float | None = None) -> None:
    """Stops the loop (the running batch at its next step, left in_progress to resume) and joins it."""
    self.stopping.set()
    self.wake.set()
    if self.thread is not None:
      self.thread.join(timeout)

  def loop(self) -> None:
    """Runs batch after batch until stopped; waits for `wake` (or `poll_s`) when nothing is queued."""
    while not self.stopping.is_set():
      if not self.streams.empty():  # a streamed video, between batches
        streams.run_session(self.pipe, self.streams.get(), self.config.data_dir, self.pipe.facts.defaults.fps or 16.0)
        continue
      picked = None if self.paused.is_set() else self.store.next_batch(self.config.max_batch)
      if picked is None:
        self.wake.wait(self.poll_s)
        self.wake.clear()
        if self.channel is not None:
          self.channel.message({"kind": "idle"})
        continue
      self.running = picked[0]
      try:
        self.run_batch(*picked)
      finally:
        self.running = None
    if self.channel is not None:
      self.channel.message({"kind": "stop"})

  def follow(self) -> None:
    """A process other than 0: runs what process 0 broadcasts, until it says stop."""
    while True:
      message = self.channel.message(None)
      if message["kind"] == "stop":
        return
      if message["kind"] != "batch":
        continue
      folder = os.path.join(self.config.data_dir, "checkpoints", message["id"])
      try:
        request, resume = self._prepare(message["jobs"], folder, message["resume"])
        options = CallOptions(progress=False, hooks=(FollowStep(self.channel),),
                              decode_compile_effort=self.config.decode_compile_effort)
        self.pipe.generate(request, options, resume=resume)
      except (BatchCancelled, ServerStopping):
        pass
      except Exception:  # noqa: BLE001 -- process 0 reports the job's failure
        traceback.print_exc()

  def run_batch(self, batch_id: str, rows: list[dict[str, Any]]) -> None:
    """Runs one batch to its end: completed, failed or cancelled (never raises); then forgets the jobs
    deleted while it ran (`JobStore.purge`) with their files."""
    live = [r["id"] for r in rows if r["status"] == "in_progress"]
    folder = os.path.join(self.config.data_dir, "checkpoints", batch_id)
    if not live:
      self._end(folder)
      return
    started = time.perf_counter()
    running = [r for r in rows if r["id"] in live]
    for row in running:
      events.log().info(events.job_line(row, "started", batch=len(running)))
    try:
      request, result = self._generate(rows, live, folder)
    except ServerStopping:
      return  # in_progress with its checkpoint: the next start resumes it
    except BatchCancelled:
      self.metrics.finished("cancelled", len(live))
      for row in running:
        events.log().info(events.job_line(row, "cancelled", seconds=time.perf_counter() - started))
    except Exception as e:  # noqa: BLE001 -- a failing job must not stop the server; its message is kept
      traceback.print_exc()
      self.store.fail(live, f"{type(e).__name__}: {e}")
      now = self.store.statuses(live)
      failed = [row for row in running if now.get(row["id"]) == "failed"]  # not those cancelled or deleted
      self.metrics.finished("failed", len(failed))
      for row in failed:
        events.log().error(events.job_line(row, "failed", seconds=time.perf_counter() - started,
                                           batch=len(running), error=f"{type(e).__name__}: {e}"))
    else:
      self._write_outputs(rows, request, result, time.perf_counter() - started)
    self._end(folder)

  def _end(self, folder: str) -> None:
    """An ended batch: its checkpoint folder removed, the jobs deleted while it ran forgotten with
    their files (`JobStore.purge`)."""
    shutil.rmtree(folder, ignore_errors=True)
    for row in self.store.purge():
      remove_job_files(self.config.data_dir, self.store, row)

  def _generate(self, rows: list[dict[str, Any]], live: list[str], folder: str) -> tuple[GenerationRequest, Any]:
    """The batch's request and its `GenerationResult`, resumed from `folder` when a checkpoint is there."""
    resume = holds_checkpoint(folder)
    jobs = [r["params"] for r in rows]
    if self.channel is not None:
      self.channel.message({"kind": "batch", "id": os.path.basename(folder), "jobs": jobs, "resume": resume})
    request, config = self._prepare(jobs, folder, resume)
    hook = JobProgress(self.store, live, self.metrics.step_seconds.observe, self.stopping, self.channel)
    options = CallOptions(progress=False, hooks=(hook,), decode_compile_effort=self.config.decode_compile_effort)
    result = self.pipe.generate(request, options, resume=config)
    self.metrics.compile_seconds.observe(result.timings.get("compile", 0.0))
    events.log().info(f"batch {os.path.basename(folder)}: {result.settings.get('memory_plan')}")
    return request, result

  def _prepare(self, jobs: list[dict[str, Any]], folder: str, resume: bool) -> tuple[GenerationRequest, ResumeConfig]:
    """Every process: the batch's LoRAs fused and its request built; a multi-process server's
    processes then agree (`Channel.agree`), so a failure on any of them skips the batch on all.

    Raises:
      BatchNotPrepared: another process failed to prepare it.
      Exception: what preparing raised on this process.
    """
    error = None
    try:
      self._use_loras(tuple(jobs[0]["lora"]))
      request = batch_request(self.pipe.facts, jobs, self.config.mesh)
    except Exception as e:  # noqa: BLE001 -- raised below, once every process knows
      error = e
    failed = [] if self.channel is None else self.channel.agree(error is None)
    if error is not None:
      raise error
    if failed:
      raise BatchNotPrepared(f"process(es) {failed} could not prepare the batch (see their logs)")
    return request, ResumeConfig(folder, every=self.config.checkpoint_every, resume=resume, keep=True)

  def _use_loras(self, names: tuple[str, ...]) -> None:
    """Fuses exactly the named server LoRAs (re-read from their files when the set changes)."""
    if names == self.active_loras:
      return
    self.pipe.unload_lora_weights()
    self.active_loras = ()
    paths = {name: (path, scale) for name, path, scale in self.config.loras}
    for name in names:
      self.pipe.load_lora_weights(paths[name][0], adapter_name=name, scale=paths[name][1])
    self.active_loras = names

  def _write_outputs(self, rows: list[dict[str, Any]], request: GenerationRequest, result: Any,
                     seconds: float) -> None:
    """Each wanted job's video and sidecar (atomic), then its row marked completed; a job cancelled or
    deleted while its files were written (a request racing the write) has them removed again, whether
    the write finished or failed, so no file is left that no route serves."""
    statuses = self.store.statuses([r["id"] for r in rows])
    for index, row in enumerate(rows):
      if statuses.get(row["id"]) != "in_progress":
        continue
      try:
        path, timings = write_job(self.config.data_dir, row, request, result, index, self.pipe, self.config)
      except Exception as e:  # noqa: BLE001 -- the encoder failing fails this job only
        if self.store.fail([row["id"]], f"{type(e).__name__}: {e}"):
          self.metrics.finished("failed", 1)
          events.log().error(events.job_line(row, "failed", seconds=seconds, error=f"{type(e).__name__}: {e}"))
          continue
      else:
        if self.store.complete(row["id"], path, timings):
          self.metrics.finished("completed", 1, seconds=seconds)
          events.log().info(events.job_line(row, "completed", seconds=seconds, batch=len(rows)))
          continue
      # Cancelled or deleted while its files were written: they go, whether the write finished or not.
      remove_outputs(self.config.data_dir, row)
      now = self.store.statuses([row["id"]]).get(row["id"], HIDDEN)  # cancelled, or deleted
      events.log().info(events.job_line(row, now, seconds=seconds))


def batch_request(facts: Any, jobs: list[dict[str, Any]], mesh: Any) -> GenerationRequest:
  """One `GenerationRequest` for jobs of one batch key: their prompts, each video seeded with its
  job's seed (the noise of the job run alone).

  Raises:
    ValueError: as `GenerationRequest.build` (a job's values were checked when it was queued).
  """
  record = jobs[0].get("input_reference")  # one per batch (`api.batch_key`)
  reference = None if record is None else references.Decoded(record.get("kind", "image"), references.load(record))
  if reference is None and facts.image_to_video:  # the warm-up: any first frame compiles the same programs
    reference = references.Decoded("image", np.full((jobs[0]["height"], jobs[0]["width"], 3), 128, np.uint8))
  return GenerationRequest.build(facts, [p["prompt"] for p in jobs], [p["negative_prompt"] for p in jobs],
                                 seed=[p["seed"] for p in jobs], **api.reference_kwargs(jobs[0], reference),
                                 **api.build_kwargs(jobs[0], mesh))


def output_paths(data_dir: str, row: dict[str, Any]) -> tuple[str, str]:
  """(video, sidecar) where `write_job` writes a job's outputs: videos/<id>.<format> and its .json."""
  path = os.path.join(data_dir, "videos", f"{row['id']}.{row['params']['output_format']}")
  return path, video_io.sidecar_path(path)


def remove_outputs(data_dir: str, row: dict[str, Any]) -> None:
  """Removes a job's video, sidecar and previews where they exist (`output_paths`, `previews`); one
  another thread removes meanwhile (a DELETE racing the worker) is gone all the same."""
  shown = [previews.preview_path(data_dir, row["id"], variant) for variant in previews.VARIANTS]
  for name in (*(output_paths(data_dir, row) if row.get("params") else ()), *shown):
    with contextlib.suppress(FileNotFoundError):
      os.remove(name)


def remove_job_files(data_dir: str, store: Any, row: dict[str, Any]) -> None:
  """A forgotten job's files: its outputs (`remove_outputs`) and its input_reference once no job in
  `store` (a `JobStore`) uses it."""
  remove_outputs(data_dir, row)
  reference = (row.get("params") or {}).get("input_reference") or {}
  if reference.get("sha256") and not store.uses_reference(reference["sha256"]):
    references.discard(data_dir, reference)


def job_tags(row: dict[str, Any], model: str, mesh: str | None) -> dict[str, str]:
  """A job's video tags (`video_tags.metadata_tags`, as `generate` tags its video): the prompt, and as
  JSON the job's parameters (the input reference by its SHA-256, not its pixels), the model, the
  mesh ("U=2,R=2"; None: one device) and the job's id."""
  p = row["params"]
  reference = p.get("input_reference") or {}
  parameters = {**{k: v for k, v in p.items() if k != "input_reference"}, "model": model, "mesh": mesh,
                "id": row["id"], "input_reference_sha256": reference.get("sha256")}
  return video_tags.metadata_tags(p["prompt"], parameters)


def write_job(data_dir: str, row: dict[str, Any], request: GenerationRequest, result: Any, index: int, pipe: Any,
              config: Any) -> tuple[str, dict[str, float]]:
  """Writes video `index` of the batch's result as the job's output, tagged (`job_tags`), and its
  JSON sidecar (each atomically, `video_io`; the settings of that video as run alone,
  `GenerationRequest.video_settings`); returns (video path, the job's timings in seconds)."""
  p = row["params"]
  path, sidecar = output_paths(data_dir, row)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  start = time.perf_counter()
  video_io.write_video(result.frames[index], path, fps=p["fps"], overwrite=True,
                       metadata=job_tags(row, pipe.facts.name, config.mesh))
  previews.write_previews(data_dir, row["id"], result.frames[index])
  timings = {**{k: float(v) for k, v in result.timings.items()}, "write": time.perf_counter() - start,
             "queued": float((row["started_at"] or row["created_at"]) - row["created_at"])}
  settings = request.video_settings(result.settings, index)
  video_io.write_json({"id": row["id"], "output": path, "request": p, "model": pipe.facts.name, "mesh": config.mesh,
                       "batch": {"id": row["batch_id"], "index": index, "size": row["batch_size"]},
                       "settings": settings, "lora": pipe.lora_info(), "timings_s": timings,
                       "warnings": row.get("warnings") or [],
                       "versions": versions()}, sidecar, overwrite=True)
  return path, timings


def warm(pipe: Any, config: Any) -> None:
  """Compiles the step (and the decode) of every `config.warmup` shape and step count at every batch
  size up to max_batch (the step program is compiled per shape, batch size and step count) by
  running one step of it and decoding. Every process of a multi-process server calls it."""
  preset = api.defaults(config.model)

  def after_first_step(pipe: Any, step: int, timestep: Any, tensors: dict) -> dict:
    pipe._interrupt = True  # diffusers' documented early stop: the rest of the steps skipped, decode runs
    return {}

  shapes = [(shape, size) for shape in config.warmup for size in range(1, config.max_batch + 1)]
  for i, ((width, height, frames, steps), size) in enumerate(shapes):
    params = {"prompt": "warm-up", "negative_prompt": "", "width": width, "height": height, "num_frames": frames,
              "num_inference_steps": preset.steps if steps is None else steps, "guidance_scale": preset.guidance[0],
              "flow_shift": None, "seed": 0}
    started = time.perf_counter()
    request = batch_request(pipe.facts, [params] * size, config.mesh)
    pipe.generate(request, CallOptions(progress=False, callback=after_first_step,
                                       decode_compile_effort=config.decode_compile_effort))
    events.log().info(f"warm-up {i + 1}/{len(shapes)}: {width}x{height} x {request.num_frames} frames, "
                      f"{params['num_inference_steps']} steps, batch {size}: {time.perf_counter() - started:.1f} s")
