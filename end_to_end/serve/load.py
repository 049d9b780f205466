"""The load acceptance of `serve`: a real server process under concurrent clients, every video checked.

  python -m end_to_end.serve.load [--clients 4] [--jobs-per-client 5] [--max-batch 4] [--steps 8]
      [--shapes 64x64x17,48x32x9,32x32x5] [--json F]

One `serve` process of the embedded tiny default (uvicorn on 127.0.0.1, a free port, a temporary
--data-dir and compile cache, every shape warmed up at every batch size before the clock starts).
Each of `--clients` threads (httpx) submits its jobs at once, then polls them every 20 ms until
finished and fetches each mp4. Job j of client c takes shape (c + j) mod the shapes, its own prompt
and seed, so queued jobs of one shape run as a batch and others do not. Checked for every job:

- it completed, and its id is unique;
- its status (queued < in_progress < finished) and its step never went backwards while polled;
- its mp4 decodes (imageio-ffmpeg) to the requested number of frames, width and height;
- its video equals the same request run alone in this process through `WanPipeline`: its PSNR
  against those frames is at most `MAX_LOSS_DB` under the PSNR of their own mp4 (written by the
  server's writer, `video_io.write_video`), i.e. no further from them than H.264 itself puts them.
  Control: against another job's frames of the same shape it must lose more, or the check could not
  tell videos apart. Also reported: the PSNR between the two mp4s (inf: identical files);
- its `warnings` name the trained size exactly when it asks for another (the tiny default knows
  64x64 x 17 frames only).

Prints one line per job and the summary (wall time, jobs/s, min PSNR); exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import numpy as np

from pipelines.storage.video_io import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ("a red square moving right", "a blue circle moving up", "a green triangle moving left",
           "a yellow square standing still", "a white circle moving down", "a red triangle moving up",
           "a blue square moving left")
ORDER = {"queued": 0, "in_progress": 1, "completed": 2, "failed": 2, "cancelled": 2}
# How much further from the request run alone the server's mp4 may be than the alone video's own mp4
# (`check`): H.264 at crf 10 loses 34-38 dB on these videos; frames equal up to float rounding (a
# 1e-5 perturbation flips ~1% of the uint8 values) change that by <= 0.03 dB, while a difference
# of the frames at 50 dB PSNR would cost ~0.2 dB. Another job's video costs > 10 dB (the control).
MAX_LOSS_DB = 0.2
FPS = 16


@dataclasses.dataclass
class JobRun:
  """One job as a client saw it.

  Attributes:
    client: the client thread's index.
    body: the POST body.
    job: the last video object polled (None: the POST was refused).
    seen: (status, step) of every poll, in order.
    video: the mp4's bytes (None unless completed).
    latency_s: submit to finished, seconds.
    problems: what failed, one line each.
    result: the checks' numbers (`compare`) and batch (the batch size it ran in).
  """
  client: int
  body: dict[str, Any]
  job: dict[str, Any] | None = None
  seen: list[tuple[str, int]] = dataclasses.field(default_factory=list)
  video: bytes | None = None
  latency_s: float = 0.0
  problems: list[str] = dataclasses.field(default_factory=list)
  result: dict[str, Any] = dataclasses.field(default_factory=dict)


def parse_shape(text: str) -> tuple[int, int, int]:
  """"48x32x9" -> (width 48, height 32, frames 9)."""
  width, height, frames = (int(n) for n in text.split("x"))
  return width, height, frames


def plan(clients: int, per_client: int, shapes: list[tuple[int, int, int]], steps: int) -> list[list[dict]]:
  """Each client's POST bodies: job (c, j) has shape (c + j) mod len(shapes), and its own prompt and seed."""
  plans = []
  for c in range(clients):
    bodies = []
    for j in range(per_client):
      width, height, frames = shapes[(c + j) % len(shapes)]
      index = c * per_client + j
      bodies.append({"prompt": PROMPTS[index % len(PROMPTS)], "seed": 1000 + index, "size": f"{width}x{height}",
                     "num_frames": frames, "num_inference_steps": steps, "guidance_scale": 5.0, "fps": FPS,
                     "output_format": "mp4"})
    plans.append(bodies)
  return plans


def poll(client: Any, run: JobRun) -> bool:
  """One GET of the job; notes a step back in status or step as a problem; True once it is finished."""
  job = client.get(f"/v1/videos/{run.job['id']}").json()
  status, step = job["status"], job["step"]
  last_status, last_step = run.seen[-1]
  if ORDER[status] < ORDER[last_status] or (status == last_status and step < last_step):
    run.problems.append(f"went back from {last_status} step {last_step} to {status} step {step}")
  run.seen.append((status, step))
  run.job = job
  return ORDER[status] == 2


def client_loop(url: str, index: int, bodies: list[dict], poll_s: float, timeout: float) -> list[JobRun]:
  """One client: its jobs submitted at once (so the queue holds several shapes and batches form),
  then each polled every `poll_s` until finished, and its video fetched."""
  import httpx

  runs = [JobRun(index, body) for body in bodies]
  with httpx.Client(base_url=url, timeout=60) as client:
    started = {}
    for run in runs:
      started[id(run)] = time.perf_counter()
      response = client.post("/v1/videos", json=run.body)
      if response.status_code != 200:
        run.problems.append(f"POST refused ({response.status_code}): {response.text[:200]}")
        continue
      run.job = response.json()
      run.seen.append((run.job["status"], run.job["step"]))
    pending, deadline = [r for r in runs if r.job is not None], time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
      for run in [r for r in pending if poll(client, r)]:
        pending.remove(run)
        run.latency_s = time.perf_counter() - started[id(run)]
        fetch(client, run)
      time.sleep(poll_s)
    for run in pending:
      run.problems.append(f"still {run.job['status']} after {timeout} s")
  return runs


def fetch(client: Any, run: JobRun) -> None:
  """The finished job's mp4 into `run.video` (a problem unless it completed and is served as video/mp4)."""
  if run.job["status"] != "completed":
    run.problems.append(f"{run.job['status']}: {run.job.get('error')}")
    return
  got = client.get(f"/v1/videos/{run.job['id']}/content")
  if got.status_code != 200 or got.headers.get("content-type") != "video/mp4":
    run.problems.append(f"content: HTTP {got.status_code} {got.headers.get('content-type')}")
  else:
    run.video = got.content


def run_clients(url: str, plans: list[list[dict]], poll_s: float = 0.02, timeout: float = 600.0
                ) -> tuple[list[JobRun], float]:
  """Every client's jobs, the clients concurrent; (the runs in plan order, wall seconds)."""
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(len(plans)) as pool:
    futures = [pool.submit(client_loop, url, c, bodies, poll_s, timeout) for c, bodies in enumerate(plans)]
    runs = [run for future in futures for run in future.result()]
  return runs, time.perf_counter() - start


def decode_mp4(data: bytes) -> np.ndarray:
  """uint8 [F, H, W, 3]: every frame of an mp4 as imageio-ffmpeg's ffmpeg decodes it."""
  import imageio_ffmpeg

  with tempfile.NamedTemporaryFile(suffix=".mp4") as f, warnings.catch_warnings():
    # fork + exec of ffmpeg is safe; Python's generic warning about forking a JAX process does not apply
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
    f.write(data)
    f.flush()
    reader = imageio_ffmpeg.read_frames(f.name)
    width, height = next(reader)["size"]
    frames = [np.frombuffer(frame, np.uint8).reshape(height, width, 3) for frame in reader]
  return np.stack(frames) if frames else np.zeros((0, height, width, 3), np.uint8)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
  """dB between two uint8 videos of one shape (peak 255); inf when equal."""
  mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
  return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def reference(pipe: Any, body: dict[str, Any], folder: str) -> tuple[np.ndarray, np.ndarray]:
  """(frames, mp4), each uint8 [F, H, W, 3]: the request run alone through `pipe` (as `video_io`
  rounds frames to uint8), and those frames written as the server writes its mp4
  (`video_io.write_video` at the request's fps) and decoded."""
  from pipelines.storage import video_io

  width, height = (int(n) for n in body["size"].split("x"))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the size warning: the server's job carries it (checked in `check`)
    frames = pipe(body["prompt"], height=height, width=width, num_frames=body["num_frames"],
                  num_inference_steps=body["num_inference_steps"], guidance_scale=body["guidance_scale"],
                  seed=body["seed"])[0]
  path = os.path.join(folder, f"reference_{body['seed']}.mp4")
  video_io.write_video(frames, path, fps=body["fps"], overwrite=True)
  with open(path, "rb") as f:
    return video_io.to_uint8(frames), decode_mp4(f.read())


def check(runs: list[JobRun], pipe: Any, trained: tuple[int, int, int] | None) -> None:
  """Checks every run (module docstring) and fills `run.result` and `run.problems`.

  Args:
    pipe: the `WanPipeline` the references run on (the server's model, loaded in this process).
    trained: (height, width, frames) the model warns outside of, or None.
  """
  ids = [r.job["id"] for r in runs if r.job is not None]
  if len(set(ids)) != len(ids):
    runs[0].problems.append(f"ids repeat: {len(ids)} jobs, {len(set(ids))} ids")
  with tempfile.TemporaryDirectory() as folder:
    references = {r.body["seed"]: reference(pipe, r.body, folder) for r in runs if r.video is not None}
  for run in runs:
    if run.video is None:
      continue
    body = run.body
    try:
      got = decode_mp4(run.video)
    except (OSError, RuntimeError, StopIteration) as e:  # imageio-ffmpeg's errors for a file it cannot read
      run.problems.append(f"the mp4 does not decode: {type(e).__name__}: {e}")
      continue
    width, height = (int(n) for n in body["size"].split("x"))
    if got.shape != (body["num_frames"], height, width, 3):
      run.problems.append(f"the mp4 decodes to {got.shape}, asked {body['num_frames']} x {height}x{width}")
      continue
    warned = any("was trained at" in w for w in run.job.get("warnings", []))
    if trained is not None and warned != ((height, width, body["num_frames"]) != trained):
      run.problems.append(f"warnings {run.job.get('warnings')} for {width}x{height} x {body['num_frames']} frames "
                          f"(the model was trained at {trained[1]}x{trained[0]} x {trained[2]})")
    compare(run, got, references)


def compare(run: JobRun, got: np.ndarray, references: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
  """The decoded mp4 `got` against its request run alone (`reference`) and against another job's
  video of its shape (the control), into `run.result`: psnr (dB, against the alone frames), codec
  (the alone frames' own mp4 against them), loss (codec - psnr), same_mp4 (against the alone mp4;
  inf: identical), control_loss (the loss against the other job's frames; None without one)."""
  frames, mp4 = references[run.body["seed"]]
  codec, quality = psnr(mp4, frames), psnr(got, frames)
  others = [f for seed, (f, _) in references.items() if seed != run.body["seed"] and f.shape == got.shape]
  control = codec - psnr(got, others[0]) if others else None
  run.result.update(psnr=quality, codec=codec, loss=codec - quality, same_mp4=psnr(got, mp4), control_loss=control,
                    batch=run.job.get("batch_size"))
  if codec - quality > MAX_LOSS_DB:
    run.problems.append(f"PSNR {quality:.2f} dB against the request alone, {codec - quality:.2f} dB under its own "
                        f"mp4's {codec:.2f} dB (at most {MAX_LOSS_DB})")
  if control is not None and control <= MAX_LOSS_DB:
    run.problems.append(f"control: another job's video is only {control:.2f} dB further (the check cannot tell "
                        "videos apart)")


def report(runs: list[JobRun], wall_s: float) -> dict[str, Any]:
  """Prints a line per job and the summary; returns the summary."""
  def db(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"

  print(f"{'client':>6} {'id':>12} {'size':>7} {'frames':>6} {'seed':>5} {'batch':>5} {'latency s':>9} "
        f"{'PSNR dB':>8} {'codec dB':>8} {'loss dB':>8} {'mp4=mp4':>8} {'control':>8}  result")
  for run in runs:
    r, job_id = run.result, (run.job or {}).get("id", "-")
    print(f"{run.client:6d} {job_id[-12:]:>12} {run.body['size']:>7} {run.body['num_frames']:6d} "
          f"{run.body['seed']:5d} {r.get('batch') or '-':>5} {run.latency_s:9.2f} {db(r.get('psnr')):>8} "
          f"{db(r.get('codec')):>8} {db(r.get('loss')):>8} {db(r.get('same_mp4')):>8} {db(r.get('control_loss')):>8}  "
          f"{'; '.join(run.problems) or 'ok'}")
  results = [r.result for r in runs if "psnr" in r.result]
  controls = [r["control_loss"] for r in results if r["control_loss"] is not None]
  summary = {"jobs": len(runs), "failed": sum(bool(r.problems) for r in runs), "wall_s": wall_s,
             "batched": sum((r.get("batch") or 1) > 1 for r in results), "jobs_per_s": len(runs) / wall_s,
             "min_psnr_db": min((r["psnr"] for r in results), default=None),
             "max_loss_db": max((r["loss"] for r in results), default=None),
             "min_same_mp4_psnr_db": min((r["same_mp4"] for r in results), default=None),
             "min_control_loss_db": min(controls, default=None),
             "p50_latency_s": float(np.median([r.latency_s for r in runs]))}
  print(f"{summary['jobs']} jobs ({summary['batched']} in batches of 2 or more) in {wall_s:.1f} s: "
        f"{summary['jobs_per_s']:.2f} jobs/s, p50 latency {summary['p50_latency_s']:.2f} s; against each request "
        f"run alone: min PSNR {db(summary['min_psnr_db'])} dB, at most {db(summary['max_loss_db'])} dB under the "
        f"codec's own (limit {MAX_LOSS_DB}), mp4s min {db(summary['min_same_mp4_psnr_db'])} dB apart; control "
        f"(another job's video) at least {db(summary['min_control_loss_db'])} dB under; {summary['failed']} failed")
  return summary


def start_server(data: str, args: argparse.Namespace, shapes: list[tuple[int, int, int]]
                 ) -> tuple[subprocess.Popen, str]:
  """A `serve` process of the tiny default with every shape warmed up, and its URL once /health is 200."""
  from end_to_end.serve.throughput import launch_server

  warmup = [flag for w, h, f in shapes for flag in ("--warmup", f"{w}x{h}x{f}x{args.steps}")]
  flags = ["--model", "tiny", "--max-batch", str(args.max_batch), "--max-queue", "1000",
           "--compile-cache", os.path.join(data, "compile-cache"), *warmup]
  return launch_server(flags, data, args.start_timeout, "serve_load")


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="serve_load", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--clients", type=int, default=4)
  p.add_argument("--jobs-per-client", type=int, default=5)
  p.add_argument("--max-batch", type=int, default=4)
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--shapes", default="64x64x17,48x32x9,32x32x5", help="WxHxF, comma-separated")
  p.add_argument("--start-timeout", type=float, default=900)
  p.add_argument("--keep", default=None, help="keep the data folder here (default: a temporary one)")
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  shapes = [parse_shape(s) for s in args.shapes.split(",")]
  with tempfile.TemporaryDirectory() as tmp:
    data = args.keep or os.path.join(tmp, "data")
    os.makedirs(data, exist_ok=True)
    started = time.perf_counter()
    process, url = start_server(data, args, shapes)
    ready_s = time.perf_counter() - started
    try:
      runs, wall = run_clients(url, plan(args.clients, args.jobs_per_client, shapes, args.steps))
    finally:
      process.terminate()
      process.wait(60)
  from pipelines.pipeline.wan_pipeline import WanPipeline

  pipe = WanPipeline.tiny("float32")
  pipe.set_progress_bar_config(disable=True)
  check(runs, pipe, pipe.facts.trained_video)
  print(f"server ready (loaded, {len(shapes)} shapes x batch sizes 1..{args.max_batch} compiled) in {ready_s:.1f} s")
  summary = {**report(runs, wall), "ready_s": ready_s, "settings": vars(args)}
  if args.json:
    write_json(summary, args.json, overwrite=True)
  return 1 if summary["failed"] else 0


if __name__ == "__main__":
  sys.exit(main())
