"""`serve`: the HTTP contract of every route and status, hostile requests, cancelling, failures, the
full queue, auth, LoRAs by name, a graceful stop resumed; a real uvicorn server whose concurrent
videos equal the same requests run alone, and which, killed with SIGKILL mid-job and restarted,
finishes the job as an uninterrupted run; a two-process server that runs, cancels and stops together.

Every video is the trained tiny default at 32x32 x 5 frames and a few steps (one in-process server
per module; one server process started twice; one two-process server).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from tests.harness import REPO_ROOT, free_port, http_thread, serve_process, wait_healthy
from pipelines.commands.presets import PRESETS
from pipelines.serve.app import create_app
from pipelines.serve.main import build_service
from pipelines.serve.options import ServeConfig
from pipelines.serve.service import Service

ROOT = REPO_ROOT
STEPS = 150  # the server process's jobs: long enough (~1 s) to be killed mid-run
SMALL = {"size": "32x32", "num_frames": 5, "num_inference_steps": 3, "output_format": "npy"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """(service, client) of an in-process server of the tiny default, one device, batches of 2, and a
  LoRA named "fox" (random, on one layer)."""
  from safetensors.numpy import save_file

  from pipelines.pipeline.checked.model_facts import ModelFacts
  from pipelines.wan import lora
  from pipelines.wan.pretrained import TINY_DEFAULT_FOLDER

  root = tmp_path_factory.mktemp("serve")
  (out_dim, in_dim), _, _ = lora.linear_layers(ModelFacts.from_folder(TINY_DEFAULT_FOLDER, "float32").transformer)[
      "blocks.0.attn1.to_q"]
  rng = np.random.default_rng(0)
  save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": rng.standard_normal((2, in_dim), np.float32),
             "transformer.blocks.0.attn1.to_q.lora_B.weight": rng.standard_normal((out_dim, 2), np.float32)},
            str(root / "fox.safetensors"))
  config = ServeConfig(model="tiny", data_dir=str(root / "data"), max_batch=2, max_queue=3,
                       loras=(("fox", str(root / "fox.safetensors"), 0.5),), warmup=((32, 32, 5, 3),))
  service = build_service(config)
  service.start(block=True)
  yield service, TestClient(create_app(service))
  service.stop()


def wait(client, job_id: str, until=("completed", "failed", "cancelled"), timeout: float = 120.0,
         check=lambda job: True, every: float = 0.02) -> dict:
  """The job once its status is in `until` and `check(job)` holds."""
  deadline = time.monotonic() + timeout
  while True:
    job = client.get(f"/v1/videos/{job_id}").json()
    if job["status"] in until and check(job):
      return job
    assert time.monotonic() < deadline, f"job {job_id} still {job['status']} after {timeout} s: {job}"
    time.sleep(every)


def idle(service) -> None:
  """Waits until the worker runs nothing (no batch, no job in progress)."""
  deadline = time.monotonic() + 60
  while service.worker.running is not None or service.store.counts()["in_progress"]:
    assert time.monotonic() < deadline
    time.sleep(0.02)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
  mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
  return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def alone(pipe, prompt: str, seed: int, steps: int) -> np.ndarray:
  """float32 [5, 32, 32, 3]: the request run alone through the pipeline (one device), at serve's
  default guidance for the tiny models (their preset's)."""
  return pipe(prompt, height=32, width=32, num_frames=5, num_inference_steps=steps, seed=seed,
              guidance_scale=PRESETS["tiny"].guidance[0])[0]


def test_create_poll_content_list_metrics(served):
  service, client = served
  service.worker.paused.set()
  jobs = [client.post("/v1/videos", json={**SMALL, "prompt": p, "seed": s}).json()
          for p, s in (("a red square moving right", 1), ("a blue circle moving up", 2))]
  mp4 = client.post("/v1/videos", json={**SMALL, "prompt": "a green triangle standing still", "seed": 3,
                                        "output_format": "mp4", "guidance_scale": 4.0}).json()
  for job in jobs + [mp4]:
    assert job["object"] == "video" and job["status"] == "queued" and job["progress"] == 0, job
    assert job["model"] == "tiny" and job["id"].startswith("video_") and job["created_at"] > 0
  assert jobs[0]["size"] == "32x32" and jobs[0]["num_frames"] == 5
  service.worker.paused.clear()
  service.worker.wake.set()
  done = [wait(client, j["id"]) for j in jobs + [mp4]]
  assert [d["status"] for d in done] == ["completed"] * 3, done
  assert [d["batch_size"] for d in done] == [2, 2, 1]  # same settings batched, another guidance alone
  assert done[0]["progress"] == 100 and done[0]["step"] == 3 and done[0]["timings"]["denoise"] > 0
  assert max(d["timings"]["compile"] for d in done) < 0.5  # compiled by the warm-up
  service.worker.paused.set()  # the reference runs use the pipeline
  idle(service)
  for job, seed in zip(jobs, (1, 2)):
    got = client.get(f"/v1/videos/{job['id']}/content")
    assert got.status_code == 200 and got.headers["content-type"] == "application/octet-stream"
    frames = np.load(__import__("io").BytesIO(got.content))
    assert frames.shape == (5, 32, 32, 3)
    quality = psnr(frames, alone(service.worker.pipe, job["prompt"], seed, 3))
    print(f"video {seed} of a batch of 2 vs its request alone: PSNR {quality:.1f} dB")
    assert quality >= 60, quality
    sidecar = json.loads(open(os.path.join(service.config.data_dir, "videos", f"{job['id']}.npy.json")).read())
    assert sidecar["request"]["seed"] == seed and sidecar["settings"]["prompts"] == [job["prompt"]]
    assert sidecar["warnings"] == job["warnings"] and "trained at 64x64" in job["warnings"][0]
  service.worker.paused.clear()
  video = client.get(f"/v1/videos/{mp4['id']}/content")
  assert video.status_code == 200 and video.headers["content-type"] == "video/mp4" and video.content[4:8] == b"ftyp"
  page = client.get("/v1/videos", params={"limit": 2}).json()
  assert page["object"] == "list" and [v["id"] for v in page["data"]] == [mp4["id"], jobs[1]["id"]]
  assert page["has_more"] and page["last_id"] == jobs[1]["id"]
  rest = client.get("/v1/videos", params={"limit": 2, "after": page["last_id"]}).json()
  assert rest["data"][0]["id"] == jobs[0]["id"]
  health = client.get("/health")
  assert health.status_code == 200 and health.json()["ready"] is True
  metrics = client.get("/metrics").text
  assert "wan_serve_queue_depth 0.0" in metrics and 'wan_serve_jobs{status="completed"}' in metrics
  assert "wan_serve_step_seconds_count" in metrics and "wan_serve_compile_seconds_count" in metrics
  assert "<form" in client.get("/").text
  gone = client.delete(f"/v1/videos/{mp4['id']}").json()
  assert gone == {"id": mp4["id"], "object": "video.deleted", "deleted": True, "status": "completed"}
  assert client.get(f"/v1/videos/{mp4['id']}").status_code == 404
  assert not os.path.exists(os.path.join(service.config.data_dir, "videos", f"{mp4['id']}.mp4"))


HOSTILE = [  # (body or raw bytes, status, the field named (None: the message names it), words in the message)
    ({}, 400, "prompt", "field required"),
    ({"prompt": ""}, 400, "prompt", "empty"),
    ({"prompt": 5}, 400, "prompt", "string"),
    ({"prompt": "x", "bogus": 1}, 400, "bogus", "unknown field"),
    ({"prompt": "x", "size": "64"}, 400, "size", "WIDTHxHEIGHT"),
    ({"prompt": "x", "size": "33x32"}, 400, "size", "width=33 must be a positive multiple of 16"),
    ({"prompt": "x", "size": "99999x64"}, 400, "size", "at most"),
    ({"prompt": "x", "num_frames": 0}, 400, "num_frames", "num_frames=0"),
    ({"prompt": "x", "num_frames": "17"}, 400, "num_frames", "not a str"),
    ({"prompt": "x", "num_frames": 100000}, 400, "num_frames", "limit"),
    ({"prompt": "x", "num_inference_steps": -1}, 400, "num_inference_steps", "positive int"),
    ({"prompt": "x", "num_inference_steps": 2.5}, 400, "num_inference_steps", "not a float"),
    ({"prompt": "x", "guidance_scale": "high"}, 400, "guidance_scale", "finite number"),
    (b'{"prompt": "x", "guidance_scale": NaN}', 400, "guidance_scale", "finite number"),
    ({"prompt": "x", "seed": -1}, 400, "seed", "seed=-1"),
    ({"prompt": "x", "flow_shift": -3}, 400, "flow_shift", "> 0"),
    ({"prompt": "x", "fps": 0}, 400, "fps", "fps=0"),
    ({"prompt": "x", "seconds": "forever"}, 400, "seconds", "seconds="),
    ({"prompt": "x", "lora": ["../../etc/passwd"]}, 400, "lora", "server's LoRAs"),
    ({"prompt": "x", "output_format": "exe"}, 400, "output_format", "'mp4', 'gif' or 'npy'"),
    ({"prompt": "x", "model": "gpt-video"}, 400, "model", "serves 'tiny' only"),
    ({"prompt": "x" * 3000}, 400, "prompt", "at most 2000"),
    ({"prompt": "a\x00b"}, 400, "prompt", "NUL"),
    ({"prompt": "x", "negative_prompt": 5}, 400, "negative_prompt", "string"),
    (b"not json", 400, None, "not JSON"),
    (b'["a list"]', 400, None, "JSON object"),
    (b'{"prompt": "' + b"x" * 70000 + b'"}', 413, None, "limit of 65536 bytes"),
]


def test_concurrent_clients_get_their_videos(served, tmp_path):
  """`end_to_end.serve.load` in small (2 clients x 2 jobs over HTTP): its checks all pass."""
  from end_to_end.serve import load as serve_load

  service, _ = served
  service.worker.paused.set()
  idle(service)
  pipe = service.worker.pipe  # shared; the module's worker is paused
  load = Service(ServeConfig(model="tiny", data_dir=str(tmp_path), max_batch=2), service.facts, load=lambda: pipe)
  load.start(block=True)
  try:
    with http_thread(create_app(load)) as url:
      runs, _ = serve_load.run_clients(url, serve_load.plan(2, 2, [(32, 32, 5)], steps=3))
    serve_load.check(runs, pipe, service.facts.trained_video)
  finally:
    load.stop()
    service.worker.paused.clear()
  assert [r.problems for r in runs] == [[]] * 4, [r.problems for r in runs]
  assert max(r.result["loss"] for r in runs) <= serve_load.MAX_LOSS_DB  # each as its request alone
  assert min(r.result["control_loss"] for r in runs) > 5  # another job's video is far from it


@pytest.mark.parametrize("body,status,param,words", HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
def test_bad_request_is_refused_naming_the_field(served, body, status, param, words):
  service, client = served
  before = service.store.counts()
  if isinstance(body, bytes):
    response = client.post("/v1/videos", content=body, headers={"content-type": "application/json"})
  else:
    response = client.post("/v1/videos", json=body)
  error = response.json()["error"]
  assert response.status_code == status, error
  assert error["param"] == param and words.lower() in error["message"].lower(), error
  assert service.store.counts() == before  # nothing queued


@pytest.mark.parametrize("path,status", [("/v1/videos/../../etc/passwd", 404), ("/v1/videos/video_zz", 404),
                                         ("/v1/videos/video_" + "0" * 24, 404), ("/v1/videos?limit=0", 400),
                                         ("/v1/videos?limit=1000", 400), ("/v1/videos?after=video_x", 404)])
def test_bad_path_or_query(served, path, status):
  assert served[1].get(path).status_code == status


def test_cancel_queued_and_running(served, monkeypatch):
  service, client = served
  service.worker.paused.set()
  idle(service)
  # Each step takes 0.3 s more (through the step-time metric the worker calls after every step).
  monkeypatch.setattr(service.metrics.step_seconds, "observe", lambda seconds: time.sleep(0.3))
  running = client.post("/v1/videos", json={**SMALL, "prompt": "a red square moving right", "seed": 5}).json()
  queued = client.post("/v1/videos", json={**SMALL, "prompt": "a blue square moving left", "seed": 6,
                                           "guidance_scale": 4.0}).json()
  cancelled = client.post(f"/v1/videos/{queued['id']}/cancel").json()
  assert cancelled["status"] == "cancelled"
  service.worker.paused.clear()
  service.worker.wake.set()
  seen = wait(client, running["id"], until=("in_progress",), check=lambda j: j["step"] >= 1)
  assert client.post(f"/v1/videos/{running['id']}/cancel").json()["status"] == "cancelled"
  idle(service)
  after = client.get(f"/v1/videos/{running['id']}").json()
  assert after["status"] == "cancelled" and seen["step"] <= after["step"] < 3, after
  never = client.get(f"/v1/videos/{queued['id']}").json()
  assert never["status"] == "cancelled" and never["step"] == 0 and never["batch_size"] is None
  assert client.get(f"/v1/videos/{running['id']}/content").status_code == 409
  assert not os.listdir(os.path.join(service.config.data_dir, "checkpoints"))
  assert not os.path.exists(os.path.join(service.config.data_dir, "videos", f"{running['id']}.npy"))
  monkeypatch.undo()
  assert wait(client, client.post("/v1/videos", json={**SMALL, "prompt": "x", "seed": 7}).json()["id"])["status"] == \
      "completed"


def test_delete_of_a_running_job_stops_and_forgets_it(served, monkeypatch):
  """DELETE of a job mid-run: the answer says deleted (the status it had: in_progress), no route finds
  it, its batch stops at the next step, and once the batch ends no row, checkpoint or file is left.
  Control: the next job runs to completion."""
  service, client = served
  service.worker.paused.set()
  idle(service)
  monkeypatch.setattr(service.metrics.step_seconds, "observe", lambda seconds: time.sleep(0.3))
  running = client.post("/v1/videos", json={**SMALL, "prompt": "a red square moving right", "seed": 5}).json()
  service.worker.paused.clear()
  service.worker.wake.set()
  wait(client, running["id"], until=("in_progress",), check=lambda j: j["step"] >= 1)
  gone = client.delete(f"/v1/videos/{running['id']}")
  assert gone.json() == {"id": running["id"], "object": "video.deleted", "deleted": True, "status": "in_progress"}
  assert client.get(f"/v1/videos/{running['id']}").status_code == 404
  idle(service)
  assert service.store.statuses([running["id"]]) == {}  # forgotten once its batch ended
  assert not os.listdir(os.path.join(service.config.data_dir, "checkpoints"))
  videos = os.path.join(service.config.data_dir, "videos")
  assert not any(name.startswith(running["id"]) for name in (os.listdir(videos) if os.path.isdir(videos) else []))
  monkeypatch.undo()
  assert wait(client, client.post("/v1/videos", json={**SMALL, "prompt": "x", "seed": 7}).json()["id"])["status"] == \
      "completed"


def test_failing_job_is_failed_and_the_next_runs(served, monkeypatch):
  service, client = served
  pipe = service.worker.pipe
  original = pipe.generate

  def generate(request, *args, **kwargs):
    if "boom" in request.prompts:
      raise RuntimeError("the device caught fire")
    return original(request, *args, **kwargs)

  monkeypatch.setattr(pipe, "generate", generate)
  bad = wait(client, client.post("/v1/videos", json={**SMALL, "prompt": "boom", "seed": 1}).json()["id"])
  assert bad["status"] == "failed" and "the device caught fire" in bad["error"]["message"], bad
  good = wait(client, client.post("/v1/videos", json={**SMALL, "prompt": "fine", "seed": 1}).json()["id"])
  assert good["status"] == "completed", good


def test_lora_by_name_is_fused_for_its_job_only(served):
  service, client = served
  videos = []
  for names in ([], ["fox"], []):
    job = wait(client, client.post("/v1/videos", json={**SMALL, "prompt": "a red square", "seed": 9,
                                                       "lora": names}).json()["id"])
    assert job["status"] == "completed", job
    videos.append(np.load(os.path.join(service.config.data_dir, "videos", f"{job['id']}.npy")))
    sidecar = json.loads(open(os.path.join(service.config.data_dir, "videos", f"{job['id']}.npy.json")).read())
    assert [a["name"] for a in sidecar["lora"]["adapters"]] == names
  assert np.array_equal(videos[0], videos[2])  # the base weights back, bit for bit
  assert not np.array_equal(videos[0], videos[1])  # the LoRA changed the video


def test_stopped_server_resumes_its_batch_on_the_next_start(served, tmp_path, monkeypatch):
  """Shutting down stops the running batch at its next step, left in_progress with its checkpoint; the
  next start on the same data folder resumes it and makes the uninterrupted run's video."""
  service, _ = served
  service.worker.paused.set()
  idle(service)
  pipe = service.worker.pipe  # shared (its compiled programs too); the module's worker is paused
  config = ServeConfig(model="tiny", data_dir=str(tmp_path), max_batch=1)
  first = Service(config, service.facts, load=lambda: pipe)
  first.start(block=True)
  monkeypatch.setattr(first.metrics.step_seconds, "observe", lambda seconds: time.sleep(0.3))
  client = TestClient(create_app(first))
  job = client.post("/v1/videos", json={**SMALL, "prompt": "a white square moving left", "seed": 4}).json()
  wait(client, job["id"], until=("in_progress",), check=lambda j: j["step"] >= 1)
  with pytest.raises(OSError, match="another serve process is using --data-dir"):
    Service(config, service.facts, load=lambda: pipe)  # one server per data folder
  first.stop()
  second = Service(config, service.facts, load=lambda: pipe)
  try:
    assert second.store.get(job["id"])["status"] == "in_progress"
    second.start(block=True)
    done = wait(TestClient(create_app(second)), job["id"])
    assert done["status"] == "completed", done
    sidecar = json.loads(open(os.path.join(str(tmp_path), "videos", f"{job['id']}.npy.json")).read())
    assert 1 <= sidecar["settings"]["resumed_from_step"] < 3, sidecar["settings"]
    got = np.load(os.path.join(str(tmp_path), "videos", f"{job['id']}.npy"))
  finally:
    second.stop()
    service.worker.paused.clear()
  assert np.array_equal(got, alone(pipe, "a white square moving left", 4, 3))


def test_full_queue_is_429_with_retry_after(served):
  service, client = served
  service.worker.paused.set()
  idle(service)
  ids = [client.post("/v1/videos", json={**SMALL, "prompt": f"p{i}"}).json()["id"] for i in range(3)]
  full = client.post("/v1/videos", json={**SMALL, "prompt": "one too many"})
  assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1, full.text
  assert full.json()["error"]["code"] == "queue_full"
  for job_id in ids:
    client.delete(f"/v1/videos/{job_id}")
  assert client.post("/v1/videos", json={**SMALL, "prompt": "room again"}).status_code == 200
  client.delete(f"/v1/videos/{client.get('/v1/videos?limit=1').json()['first_id']}")
  service.worker.paused.clear()


def test_api_key_guards_every_route_but_health(tmp_path, served):
  config = ServeConfig(model="tiny", data_dir=str(tmp_path), api_key="secret-key-1")
  client = TestClient(create_app(Service(config, served[0].facts, load=None)))
  assert client.get("/health").status_code == 503  # answered without a key (not loaded: not ready)
  assert client.get("/").status_code == 200
  for method, path in (("get", "/v1/videos"), ("get", "/metrics"), ("get", "/v1/videos/video_" + "0" * 24),
                       ("delete", "/v1/videos/video_" + "0" * 24), ("post", "/v1/videos"),
                       ("post", "/v1/videos/video_" + "0" * 24 + "/cancel")):
    response = getattr(client, method)(path)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer", (path, response.text)
  assert client.get("/v1/videos", headers={"Authorization": "Bearer wrong-key"}).status_code == 401
  assert client.get("/v1/videos", headers={"Authorization": "Bearer secret-key-1"}).status_code == 200


# --- a real server process ------------------------------------------------------------------------

def _start(data: str, cache: str, port: int, extra: tuple[str, ...] = (f"32x32x5x{STEPS}",),
           log: str = "server.log") -> subprocess.Popen:
  """`serve` of the tiny default on a U=2 mesh, one batch at a time, `--warmup` the first of `extra`."""
  return serve_process(ROOT, data, port, "--mesh", "U=2", "--max-batch", "1", "--compile-cache", cache, "--warmup",
                       *extra, log=log)


def test_server_process_serves_concurrent_jobs_and_survives_kill_9(served, tmp_path):
  import httpx

  service, _ = served
  service.worker.paused.set()  # the reference runs below use the in-process pipeline
  idle(service)
  data, cache, port = str(tmp_path / "data"), str(tmp_path / "cache"), free_port()
  os.makedirs(data)
  process = _start(data, cache, port)
  try:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
      wait_healthy(client, process)
      asked = [("a red square moving right", 11), ("a yellow circle moving down", 12), ("a white triangle", 13)]
      with concurrent.futures.ThreadPoolExecutor(3) as pool:
        posted = list(pool.map(lambda a: client.post("/v1/videos", json={
            **SMALL, "prompt": a[0], "seed": a[1], "num_inference_steps": STEPS}).json(), asked))
      done = [wait(client, p["id"]) for p in posted]
      assert all(d["status"] == "completed" for d in done), done
      for (prompt, seed), job in zip(asked, done):
        got = np.load(__import__("io").BytesIO(client.get(f"/v1/videos/{job['id']}/content").content))
        quality = psnr(got, alone(service.worker.pipe, prompt, seed, STEPS))
        print(f"server video {seed} (mesh U=2) vs its request alone (one device): PSNR {quality:.1f} dB")
        assert quality >= 60, quality
      steps = STEPS
      long = client.post("/v1/videos", json={**SMALL, "prompt": "a green square moving up", "seed": 21,
                                             "num_inference_steps": steps}).json()
      # Step 4 reported: the checkpoint writer has finished step 2's (it takes step 3's only once step
      # 2's is written; step 4's save waits for that), so the resume starts at step 2 or later.
      wait(client, long["id"], until=("in_progress",), check=lambda j: j["step"] >= 4, timeout=60, every=0.002)
      behind = client.post("/v1/videos", json={**SMALL, "prompt": "a blue circle", "seed": 22,
                                               "num_inference_steps": STEPS}).json()
      os.kill(process.pid, signal.SIGKILL)
      process.wait()
      assert behind["status"] == "queued"
      process = _start(data, cache, port)
      wait_healthy(client, process)
      finished = wait(client, long["id"])
      assert finished["status"] == "completed" and wait(client, behind["id"])["status"] == "completed"
      sidecar = json.loads(open(os.path.join(data, "videos", f"{long['id']}.npy.json")).read())
      resumed = sidecar["settings"]["resumed_from_step"]
      assert 2 <= resumed < steps, resumed
      got = np.load(__import__("io").BytesIO(client.get(f"/v1/videos/{long['id']}/content").content))
      quality = psnr(got, alone(service.worker.pipe, "a green square moving up", 21, steps))
      print(f"killed at step >= {resumed}, resumed: PSNR {quality:.1f} dB vs an uninterrupted run")
      assert quality >= 60, quality
      assert client.get(f"/v1/videos/{done[0]['id']}/content").status_code == 200  # still served
  finally:
    process.kill()
    process.wait()
    service.worker.paused.clear()


def test_seconds_and_fps_give_frames(served):
  service, client = served
  service.worker.paused.set()
  job = client.post("/v1/videos", json={**{k: v for k, v in SMALL.items() if k != "num_frames"}, "prompt": "x",
                                        "seconds": "1", "fps": 8}).json()
  assert job["num_frames"] == 9 and job["seconds"] == "1", job  # 1 s x 8 fps + 1 = 4k + 1
  client.delete(f"/v1/videos/{job['id']}")
  service.worker.paused.clear()


def test_two_process_server_runs_cancels_and_stops_together(served, tmp_path):
  """Process 0 serves HTTP; process 1 follows its batches (a U=2 mesh over both), its cancel and its stop;
  a batch neither can prepare (its LoRA file gone) fails on both and they go on."""
  import httpx

  service, _ = served
  service.worker.paused.set()  # the reference run below uses the in-process pipeline
  idle(service)
  data, cache, port, coordinator = str(tmp_path / "data"), str(tmp_path / "cache"), free_port(), free_port()
  os.makedirs(data)
  fox = shutil.copy(service.config.loras[0][1], tmp_path / "fox.safetensors")
  flags = ("32x32x5x3", "--warmup", "32x32x5x20", "--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2",
           "--lora", f"fox={fox}")
  processes = [_start(data, cache, port, flags + ("--process-id", str(i)), f"process{i}.log") for i in (0, 1)]
  try:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
      wait_healthy(client, processes[0])
      os.remove(fox)  # its job fails to prepare on both processes: failed, and both go on
      lost = wait(client, client.post("/v1/videos", json={**SMALL, "prompt": "x", "lora": ["fox"]}).json()["id"])
      assert lost["status"] == "failed" and "fox.safetensors" in lost["error"]["message"], lost
      job = wait(client, client.post("/v1/videos", json={**SMALL, "prompt": "a red circle", "seed": 31}).json()["id"])
      assert job["status"] == "completed", job
      got = np.load(__import__("io").BytesIO(client.get(f"/v1/videos/{job['id']}/content").content))
      quality = psnr(got, alone(service.worker.pipe, "a red circle", 31, 3))
      print(f"two-process server (mesh U=2 over 2 processes) vs the request alone: PSNR {quality:.1f} dB")
      assert quality >= 60, quality
      long = client.post("/v1/videos", json={**SMALL, "prompt": "a red circle", "seed": 32,
                                             "num_inference_steps": 20}).json()
      wait(client, long["id"], until=("in_progress",), check=lambda j: j["step"] >= 2, every=0.002)
      assert client.post(f"/v1/videos/{long['id']}/cancel").json()["status"] == "cancelled"
      after = wait(client, client.post("/v1/videos", json={**SMALL, "prompt": "x", "seed": 33}).json()["id"])
      assert after["status"] == "completed", after  # process 1 stopped the cancelled batch with process 0
      assert client.get(f"/v1/videos/{long['id']}").json()["step"] < 20
    processes[0].send_signal(signal.SIGTERM)
    assert [p.wait(timeout=120) for p in processes] == [0, 0]
  finally:
    for process in processes:
      process.kill()
      process.wait()
    service.worker.paused.clear()
