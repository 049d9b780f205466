"""Tests for pipelines/serve/worker.py: a multi-process server's batch that one process cannot
prepare (its LoRA file missing there) or none can (a queued request that fails to build) is failed
on process 0 and skipped by all, and the processes go on together.

Two processes are simulated by two threads whose collectives (`multihost.Channel`'s broadcast and
all-gather) meet at a barrier that also checks both made the same call (a mismatch or a process left
waiting fails the test instead of hanging it). The pipeline is a stand-in that runs the hooks of
each step (no model). A batch is seeded one seed per job, and each job's sidecar records its own
run.
"""

from __future__ import annotations

import json
import threading
import types

import numpy as np
import pytest

from pipelines.pipeline.run.loop import LoopState
from pipelines.pipeline.checked.request import GenerationRequest
from pipelines.serve import api
from pipelines.serve.main import model_facts
from pipelines.serve.multihost import Channel
from pipelines.serve.options import ServeConfig
from pipelines.serve.service import Service
from pipelines.serve.worker import Worker, batch_request, write_job
from pipelines.storage import video_tags


class Hub:
  """JAX's `broadcast_one_to_all` and `process_allgather` between threads, one per process."""

  def __init__(self, processes: int):
    self.barrier = threading.Barrier(processes, timeout=30)
    self.slots: list = [None] * processes
    self.mismatch: list[str] = []

  def _exchange(self, index: int, kind: str, value) -> list:
    self.slots[index] = (kind, np.asarray(value))
    self.barrier.wait()
    got = list(self.slots)
    self.barrier.wait()
    if len({k for k, _ in got}) > 1:
      self.mismatch.append(str([(k, v.shape) for k, v in got]))
      raise RuntimeError(f"collectives do not match: {self.mismatch[-1]}")
    return [v for _, v in got]

  def channel(self, index: int) -> Channel:
    return Channel(broadcast=lambda x: self._exchange(index, f"broadcast{np.shape(x)}", x)[0],
                   allgather=lambda x: np.stack(self._exchange(index, "allgather", x)), process_index=index)


class StandInPipe:
  """Runs each step's hooks; LoRAs named in `broken` fail to load (as a file missing on this host)."""

  def __init__(self, facts, broken: tuple[str, ...] = ()):
    self.facts, self.broken, self.runs = facts, broken, []

  def set_progress_bar_config(self, **options) -> None:
    pass

  def unload_lora_weights(self) -> None:
    pass

  def load_lora_weights(self, path: str, adapter_name: str, scale: float) -> None:
    if adapter_name in self.broken:
      raise FileNotFoundError(f"no LoRA file {path!r} on this host")

  def lora_info(self) -> dict:
    return {}

  def generate(self, request, options, resume=None):
    self.runs.append(request.prompts)
    state = LoopState(timesteps=np.zeros(request.steps), experts=[0] * request.steps, latents=None, solver=None,
                      text=None)
    for step in range(request.steps):
      state.step = step
      for hook in options.hooks:
        hook.before_step(state)
      state.step_times.append(0.0)
      for hook in options.hooks:
        hook.after_step(state)
    frames = np.zeros((request.videos, request.num_frames, request.height, request.width, 3), np.float32)
    return types.SimpleNamespace(frames=frames, timings={}, settings={"negative_prompts": None})


def test_a_batch_one_process_cannot_prepare_fails_everywhere_and_both_go_on(tmp_path):
  config = ServeConfig(model="tiny", data_dir=str(tmp_path), max_batch=1,
                       loras=(("fox", str(tmp_path / "fox.safetensors"), 1.0),
                              ("owl", str(tmp_path / "owl.safetensors"), 1.0)))
  facts = model_facts(config)
  hub = Hub(2)
  leader, follower = StandInPipe(facts, broken=("fox",)), StandInPipe(facts, broken=("owl",))
  service = Service(config, facts, load=lambda: leader, channel=hub.channel(0))
  small = {"size": "32x32", "num_frames": 5, "num_inference_steps": 2, "output_format": "npy"}
  jobs = {name: service.submit(api.VideoCreate(prompt=name, lora=lora, **small))["id"]
          for name, lora in (("fox on 0", ["fox"]), ("owl on 1", ["owl"]), ("plain", []))}
  bad = {**service.store.get(jobs["plain"])["params"], "width": 40}  # queued as if checked, fails to build
  jobs = {"bad": service.store.add(bad, api.batch_key(bad), 64)["id"], **jobs}
  other = Worker(follower, config, store=None, metrics=None, channel=hub.channel(1))
  following = threading.Thread(target=other.follow, daemon=True)
  following.start()
  service.start(block=True)
  try:
    rows = {name: wait_finished(service, job_id) for name, job_id in jobs.items()}
  finally:
    service.stop()
    following.join(30)
  assert not following.is_alive(), "process 1 did not stop with process 0"
  assert not hub.mismatch, hub.mismatch
  assert rows["fox on 0"]["status"] == "failed" and "no LoRA file" in rows["fox on 0"]["error"], rows["fox on 0"]
  assert rows["owl on 1"]["status"] == "failed", rows["owl on 1"]
  assert "process(es) [1] could not prepare the batch" in rows["owl on 1"]["error"], rows["owl on 1"]
  assert rows["bad"]["status"] == "failed" and "width=40" in rows["bad"]["error"], rows["bad"]
  assert rows["plain"]["status"] == "completed", rows["plain"]
  assert leader.runs == follower.runs == [["plain"]]  # the failed batches ran nowhere, the next one on both


def wait_finished(service, job_id: str) -> dict:
  for _ in range(600):
    service.worker.wake.set()
    row = service.store.get(job_id)
    if row["status"] not in ("queued", "in_progress"):
      return row
    threading.Event().wait(0.05)
  raise AssertionError(f"job {job_id} still {row['status']} after 30 s")


def test_a_batch_is_seeded_per_job_and_each_sidecar_records_its_own_run(tmp_path):
  """Each job's video starts from its own seed's noise (the batch's request holds one seed per video,
  so its settings say seeded, not given latents), and its sidecar's settings are those of the job run
  alone: its prompt, its seed. Its mp4 carries its own prompt and seed as tags (`job_tags`)."""
  config = ServeConfig(model="tiny-random", data_dir=str(tmp_path), mesh="U=1,R=1")
  facts = model_facts(config)
  small = {"size": "32x32", "num_frames": 5, "num_inference_steps": 3, "output_format": "mp4"}
  jobs = [api.job_params(api.VideoCreate(prompt=p, seed=s, **small), model="tiny-random", loras=(),
                         max_prompt_chars=100) for p, s in (("a fox", 5), ("an owl", 2 ** 40))]
  batch = batch_request(facts, jobs, None)
  alone = [GenerationRequest.build(facts, j["prompt"], j["negative_prompt"], seed=j["seed"],
                                   **api.build_kwargs(j, None)) for j in jobs]
  np.testing.assert_array_equal(batch.noise(), np.concatenate([r.noise() for r in alone]))
  result = types.SimpleNamespace(frames=np.zeros((2, 5, 32, 32, 3), np.float32), timings={}, settings=batch.settings())
  pipe = types.SimpleNamespace(facts=facts, lora_info=dict)
  for index, (job, one) in enumerate(zip(jobs, alone)):
    row = {"id": f"video_{index}", "params": job, "started_at": 1.0, "created_at": 0.0, "batch_id": "batch_1",
           "batch_size": 2}
    path, _ = write_job(str(tmp_path), row, batch, result, index, pipe, config)
    sidecar = json.loads(open(path + ".json").read())
    assert sidecar["settings"] == json.loads(json.dumps(one.settings())), index  # (JSON: tuples as lists)
    assert (sidecar["settings"]["seed"], sidecar["settings"]["explicit_latents"]) == (job["seed"], False)
    tags = video_tags.read_metadata(path)
    comment = json.loads(tags["comment"])
    assert tags["title"] == job["prompt"] and (comment["seed"], comment["id"]) == (job["seed"], row["id"]), tags
    assert (comment["model"], comment["mesh"], comment["num_inference_steps"]) == ("tiny-random", "U=1,R=1", 3)


def test_a_cancel_racing_the_write_leaves_no_file_behind(tmp_path, monkeypatch):
  """A cancel that lands after the last step, while the job's files are written (forced: the store
  marks it cancelled from inside the write), ends `cancelled` with no video, sidecar or preview
  left in videos/; DELETE then reports deleted with nothing left. Positive control: an uncancelled job's
  files stay and DELETE removes them."""
  from pipelines.serve import worker as worker_module

  config = ServeConfig(model="tiny", data_dir=str(tmp_path), max_batch=1)
  facts = model_facts(config)
  service = Service(config, facts, load=lambda: StandInPipe(facts))
  small = {"size": "32x32", "num_frames": 5, "num_inference_steps": 2, "output_format": "npy"}
  raced, kept = (service.submit(api.VideoCreate(prompt=p, **small))["id"] for p in ("raced", "kept"))
  write = worker_module.write_job

  def write_then_cancelled(data_dir, row, *args):
    out = write(data_dir, row, *args)
    if row["id"] == raced:
      assert service.store.cancel(raced)  # the cancel arrives between the write and `complete`
    return out

  monkeypatch.setattr(worker_module, "write_job", write_then_cancelled)
  videos = tmp_path / "videos"
  service.start(block=True)
  try:
    rows = {job: wait_finished(service, job) for job in (raced, kept)}
    assert rows[raced]["status"] == "cancelled" and rows[kept]["status"] == "completed", rows
    assert sorted(p.name for p in videos.iterdir()) == [f"{kept}.npy", f"{kept}.npy.json",
                                                        f"{kept}.spritesheet.jpg", f"{kept}.thumbnail.webp"]
    for job in (raced, kept):
      service.delete(job)
    assert list(videos.iterdir()) == []
  finally:
    service.stop()


@pytest.mark.parametrize("write_fails", [False, True], ids=["write-finishes", "write-fails-after"])
def test_a_delete_during_the_write_ends_the_job_deleted_never_failed(tmp_path, monkeypatch, caplog, write_fails):
  """DELETE landing while a job's files are written (forced: its video written, its previews wait on an
  event until the DELETE has answered): the answer says deleted, no route finds the job, and once its
  batch ends it left no row and no file, and nothing counted or logged it failed, whether the write
  then finishes or raises (e.g. the disk filled meanwhile). Control: the other job of its batch
  completes with its files."""
  from fastapi.testclient import TestClient

  from pipelines.serve import previews
  from pipelines.serve.app import create_app

  config = ServeConfig(model="tiny", data_dir=str(tmp_path), max_batch=2)
  facts = model_facts(config)
  service = Service(config, facts, load=lambda: StandInPipe(facts))
  client = TestClient(create_app(service))
  small = {"size": "32x32", "num_frames": 5, "num_inference_steps": 2, "output_format": "npy"}
  deleted, kept = (service.submit(api.VideoCreate(prompt=p, **small))["id"] for p in ("deleted", "kept"))
  writing, answered = threading.Event(), threading.Event()
  write_previews = previews.write_previews

  def paused(data_dir, job_id, frames):
    if job_id == deleted:
      writing.set()
      assert answered.wait(30), "the DELETE did not answer"
      if write_fails:
        raise OSError(28, "No space left on device")
    return write_previews(data_dir, job_id, frames)

  monkeypatch.setattr(previews, "write_previews", paused)
  caplog.set_level("INFO", logger="wan.serve")
  service.start(block=True)
  try:
    assert writing.wait(30), "the write never started"
    answer = client.delete(f"/v1/videos/{deleted}")
    answered.set()
    assert answer.status_code == 200 and answer.json() == {"id": deleted, "object": "video.deleted", "deleted": True,
                                                           "status": "in_progress"}, answer.text
    assert wait_finished(service, kept)["status"] == "completed"
    for _ in range(600):
      if service.worker.running is None:
        break
      threading.Event().wait(0.05)
    assert client.get(f"/v1/videos/{deleted}").status_code == 404
    assert service.store.statuses([deleted, kept]) == {kept: "completed"}  # the deleted row is gone too
    assert sorted(p.name for p in (tmp_path / "videos").iterdir()) == [
        f"{kept}.npy", f"{kept}.npy.json", f"{kept}.spritesheet.jpg", f"{kept}.thumbnail.webp"]
    failed = service.metrics.registry.get_sample_value("wan_serve_jobs_finished_total", {"status": "failed"})
    assert not failed, failed
    lines = [r.getMessage() for r in caplog.records if r.name == "wan.serve"]
    assert not [line for line in lines if " failed" in line], lines
    assert any(line.startswith(f"job {kept} completed") for line in lines), lines
  finally:
    answered.set()
    service.stop()


def test_a_job_without_fps_takes_the_models_frame_rate(tmp_path):
  """serve's default fps is the model's (TI2V-5B: 24, `presets.model_fps`), as generate's; a given
  fps wins; positive control: a Wan 2.1-style model gets 16."""
  import dataclasses

  config = ServeConfig(model="tiny-random", data_dir=str(tmp_path))
  text = model_facts(config)
  small = {"size": "32x32", "num_frames": 5, "num_inference_steps": 2, "output_format": "npy"}
  for facts, want in ((text, 16.0), (dataclasses.replace(text, expand_timesteps=True), 24.0)):
    service = Service(config, facts, load=lambda: None)
    try:
      row = service.store.get(service.submit(api.VideoCreate(prompt="a fox", **small))["id"])
      given = service.store.get(service.submit(api.VideoCreate(prompt="a fox", fps=12, **small))["id"])
    finally:
      service.stop()
    assert (row["params"]["fps"], given["params"]["fps"]) == (want, 12)
