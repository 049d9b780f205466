"""The service behind the routes: the model (loaded once, warmed up on a thread), the job table, the
worker and the Prometheus metrics (`Service`). The app (`app.create_app`) only translates HTTP.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pipelines.commands.presets import model_fps
from pipelines.serve import api, events, previews, references
from pipelines.serve.store import JobStore
from pipelines.serve.worker import Worker, remove_job_files, warm

# A remix's own values (the rest of its body comes from the finished job): the new prompt and
# strength, the size as one field, and the length, which the finished video gives.
REMIXED = ("prompt", "strength", "size", "num_frames", "seconds", "input_reference")
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
  """The service's Prometheus metrics, in a registry of its own (no process-wide state).

  Queue depth and jobs by status are read from the job table when scraped."""

  def __init__(self, store: JobStore):
    self.registry = CollectorRegistry()
    Gauge("wan_serve_queue_depth", "jobs queued", registry=self.registry).set_function(
        lambda: store.counts()["queued"])
    jobs = Gauge("wan_serve_jobs", "jobs in the table by status", ["status"], registry=self.registry)
    for status in api.STATUSES:
      jobs.labels(status=status).set_function(lambda s=status: store.counts()[s])
    self.finished_total = Counter("wan_serve_jobs_finished", "jobs finished by this process, by outcome",
                                  ["status"], registry=self.registry)
    self.step_seconds = Histogram("wan_serve_step_seconds", "one denoising step of a batch",
                                  buckets=SECONDS_BUCKETS, registry=self.registry)
    self.compile_seconds = Histogram("wan_serve_compile_seconds", "compiling a batch's step (0: cached)",
                                     buckets=SECONDS_BUCKETS, registry=self.registry)
    self.batch_seconds = Histogram("wan_serve_batch_seconds", "a batch from start to its videos written",
                                   buckets=SECONDS_BUCKETS, registry=self.registry)

  def finished(self, status: str, count: int, seconds: float | None = None) -> None:
    self.finished_total.labels(status=status).inc(count)
    if seconds is not None:
      self.batch_seconds.observe(seconds)


class Service:
  """One model served: the job table in `config.data_dir`, a worker thread, metrics.

  Args:
    config: the `ServeConfig`.
    facts: the model's `ModelFacts` (what requests are checked against; known before the weights).
    load: returns the `WanPipeline` (called on the loading thread by `start`).
    channel: process 0's `multihost.Channel` in a multi-process server, else None.
  """

  def __init__(self, config: Any, facts: Any, load: Any, channel: Any = None):
    self.config, self.facts, self.load, self.channel = config, facts, load, channel
    self.store = JobStore(config.data_dir)
    for row in self.store.purge():  # jobs deleted while their batch ran, in a server that then stopped
      remove_job_files(config.data_dir, self.store, row)
    self.metrics = Metrics(self.store)
    self.worker: Worker | None = None
    self.ready = threading.Event()
    self.state = "starting"
    self.error: str | None = None

  def start(self, block: bool = False) -> None:
    """Loads the model and compiles the warm-up shapes (on a thread unless `block`), then starts
    the worker; /health says ready after that."""
    if block:
      self._boot()
    else:
      threading.Thread(target=self._boot, name="wan-serve-load", daemon=True).start()

  def _boot(self) -> None:
    log = events.log()
    try:
      self.state = "loading"
      log.info(f"loading model {self.facts.name} ({self.config.dtype}) ...")
      started = time.perf_counter()
      pipe = self.load()
      pipe.set_progress_bar_config(disable=True)
      log.info(f"model loaded in {time.perf_counter() - started:.1f} s")
      self.worker = Worker(pipe, self.config, self.store, self.metrics, channel=self.channel)
      self.state = "warming up"
      warm(pipe, self.config)
      self.worker.start()
      self.state = "ready"
      self.ready.set()
      docs = ", schema at /docs" if self.config.docs else ""
      log.info(f"ready at {self.url} (model {self.facts.name}, mesh {self.config.mesh or 'one device'}): "
               f"POST /v1/videos{docs}; {self.store.counts()['queued']} job(s) queued")
    except Exception as e:  # noqa: BLE001 -- reported by /health, the server stays up to say so
      traceback.print_exc()
      self.state, self.error = "failed", f"{type(e).__name__}: {e}"
      log.error(f"the model failed to load ({self.error}); /health says so, POST /v1/videos answers 503")

  @property
  def url(self) -> str:
    """The page's URL, as the server listens (`config.host`, `config.port`)."""
    host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
    return f"http://{host}:{self.config.port}/"

  def stop(self) -> None:
    if self.worker is not None:
      self.worker.stop(timeout=60)
    self.store.close()

  # --- what the routes call ---

  def submit(self, body: api.VideoCreate, upload: Any = None, *, given: Any = None,
             remixed_from: str | None = None) -> dict[str, Any]:
    """Checks a request (its text, values and `input_reference`: `upload`, a `forms.Upload`, or
    `given`, already decoded) and queues it; returns the job row. Nothing is stored for a request
    that is refused.

    Raises:
      api.ApiError: 400 naming the field; 429 when the queue is full; 503 when the model failed to load.
    """
    if self.state == "failed":
      raise api.ApiError(503, f"the model failed to load: {self.error}", code="model_unavailable")
    fps = self.facts.defaults.fps or model_fps(self.facts.expand_timesteps)  # the model's own, else its kind's
    params = api.job_params(body, model=self.facts.name, loras=self.config.lora_names,
                            max_prompt_chars=self.config.max_prompt_chars, fps=fps)
    if given is None:
      reference = references.from_body(body.input_reference, upload)
      given = None if reference is None else references.decode(reference, self.facts, api.MAX_FRAMES)
    references.require(self.facts, given)
    if body.strength is not None and (given is None or given.kind != "video" or self.facts.transformer.has_vace):
      raise api.ApiError(400, f"strength={body.strength!r} applies to video-to-video only (a text-to-video model "
                         "given a video as input_reference; a VACE model conditions on its video at every step); "
                         "leave strength out", "strength")
    if given is not None and given.kind == "video" and body.num_frames is None:
      params["num_frames"] = (len(given.pixels) - 1) // self.facts.temporal_factor * self.facts.temporal_factor + 1
    _, notes = api.check_request(params, self.facts, self.config.mesh, given)
    if given is not None:
      params["input_reference"] = references.store(self.config.data_dir, given)
    if remixed_from is not None:
      params["remixed_from_video_id"] = remixed_from
    row = self.store.add(params, api.batch_key(params), self.config.max_queue, warnings=notes)
    if row is None:
      raise api.ApiError(429, f"the queue is full ({self.config.max_queue} jobs); retry later", code="queue_full")
    if self.worker is not None:
      self.worker.wake.set()
    return row

  def remix(self, row: dict[str, Any], remix: api.VideoRemix) -> dict[str, Any]:
    """A new job from finished job `row`'s video (video-to-video; on a VACE model, the video VACE
    conditions on) with `remix.prompt` and `remix.strength`, and the row's other settings (size,
    steps, guidance, shift, seed, LoRAs, context windows, format); returns its row.

    Raises:
      api.ApiError: 409 unless `row` is completed; 410 when its video is gone; 400 on a model that
        cannot start from a video (image-to-video, TI2V), for an mp4 where ffmpeg is missing, or as
        `submit`.
    """
    from pipelines.storage import video_io, video_reading

    video_id = row["id"]
    if row["status"] != "completed":
      raise api.ApiError(409, f"video {video_id!r} is {row['status']}; only a completed video can be remixed",
                         "video_id", code="not_ready")
    if self.facts.image_to_video or self.facts.expand_timesteps:
      raise api.ApiError(400, f"remix needs video-to-video, and model {self.facts.name!r} starts from an image, "
                         "not a video; create a new video with POST /v1/videos", "video_id", code="unsupported")
    path = self.content_path(row)
    if path is None:
      raise api.ApiError(410, f"the file of video {video_id!r} is gone from the data folder", "video_id", code="gone")
    problem = video_io.mp4_encoder_problem() if path.endswith(".mp4") else None
    if problem is not None:  # reading it needs ffmpeg too (else a 500 from the reader's ImportError)
      raise api.ApiError(400, f"video {video_id!r} is an mp4 and this server cannot read one: {problem}; install "
                         "imageio-ffmpeg where the server runs", "video_id", code="unsupported")
    p = row["params"]
    kept = {name: p[name] for name in api.VideoCreate.model_fields if name in p and name not in REMIXED}
    body = api.VideoCreate(**kept, prompt=remix.prompt, size=f"{p['width']}x{p['height']}", strength=remix.strength)
    frames = video_reading.read_video(path, max_frames=api.MAX_FRAMES)
    return self.submit(body, given=references.Decoded("video", frames), remixed_from=video_id)

  def retry_after(self) -> int:
    """Seconds a client should wait when the queue is full: the queue over the batch size times the
    mean batch time so far (1 s when nothing ran yet)."""
    count, total = 0.0, 0.0
    for metric in self.metrics.batch_seconds.collect():
      for sample in metric.samples:
        count = sample.value if sample.name.endswith("_count") else count
        total = sample.value if sample.name.endswith("_sum") else total
    mean = total / count if count else 1.0
    return max(1, int(mean * self.config.max_queue / self.config.max_batch + 0.5))

  def content_path(self, row: dict[str, Any], variant: str = "video") -> str | None:
    """The finished video's file (`variant` "video") or one of its previews ("thumbnail",
    "spritesheet": `previews`), only when it lies inside the data folder's videos/."""
    folder = os.path.realpath(os.path.join(self.config.data_dir, "videos"))
    path = row.get("output") if variant == "video" else previews.preview_path(self.config.data_dir, row["id"], variant)
    if not path:
      return None
    real = os.path.realpath(path)
    return real if os.path.dirname(real) == folder and os.path.isfile(real) else None

  def delete(self, job_id: str) -> dict[str, Any] | None:
    """Forgets a job in any status (`JobStore.delete`); returns its row as it was, None when there is
    none. A job forgotten at once goes with its files (`remove_job_files`: where the worker writes them
    even if never completed, a cancel having raced the write); one whose batch runs is hidden, stops
    or is dropped as a cancelled one, and its files go when the batch ends (`Worker.run_batch`)."""
    found = self.store.delete(job_id)
    if found is None:
      return None
    row, gone = found
    if gone:
      remove_job_files(self.config.data_dir, self.store, row)
    return row

  def health(self) -> dict[str, Any]:
    return {"status": self.state, "ready": self.ready.is_set(), "model": self.facts.name, "mesh": self.config.mesh,
            "error": self.error, "jobs": self.store.counts(), "time": time.time()}
