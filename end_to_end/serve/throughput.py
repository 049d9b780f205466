"""Throughput and latency of `serve`: videos per minute and p50 / p95 latency at several client
concurrencies, with and without batching.

  python -m end_to_end.serve.throughput [--model tiny] [--mesh U=2,R=2] [--concurrency 1,4,8] [--jobs 16]
      [--max-batch 4] [--size 64x64] [--frames 17] [--steps 8] [--json F]

For each setting (`--max-batch 1`: no batching; `--max-batch N`) one real server process is started
(`python -m pipelines.serve.main`, a fresh data folder, the shape warmed up so compiling is not
timed; `--compile-cache` shared between settings). For each concurrency C, C clients each submit a
job, poll it every 20 ms until it is completed, and submit the next, until `--jobs` jobs are done:
latency is submit to completed as the client sees it; videos/min is jobs over the wall time of the
round. Prompts and seeds differ per job (each job keeps its own noise in a batch).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from pipelines.storage.video_io import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ("a red square moving right", "a blue circle moving up", "a green triangle moving left",
           "a yellow square standing still", "a white circle moving down")


def free_port() -> int:
  """A TCP port free on 127.0.0.1 now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch_server(flags: list[str], data: str, start_timeout: float, tool: str) -> tuple[subprocess.Popen, str]:
  """A `serve` process on a free 127.0.0.1 port with `flags` (its log in `data`/server.log) and its
  base URL, once /health answers 200; SystemExit naming `tool` when it exits or is not ready in
  `start_timeout` seconds (the process is then killed)."""
  import httpx

  port = free_port()
  command = [sys.executable, "-m", "pipelines.serve.main", "--port", str(port), "--data-dir", data, *flags]
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=open(os.path.join(data, "server.log"), "w"))
  url = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + start_timeout
  while time.monotonic() < deadline and process.poll() is None:
    try:
      if httpx.get(url + "/health", timeout=5).status_code == 200:
        return process, url
    except httpx.HTTPError:
      pass
    time.sleep(0.2)
  process.kill()
  raise SystemExit(f"{tool}: the server exited or was not ready in {start_timeout} s; see {data}/server.log")


def start_server(args: argparse.Namespace, max_batch: int, data: str, cache: str) -> tuple[subprocess.Popen, str]:
  """A server process and its base URL, once /health says ready."""
  flags = ["--model", args.model, "--max-batch", str(max_batch), "--max-queue", "1000", "--compile-cache", cache,
           "--warmup", f"{args.size}x{args.frames}x{args.steps}"] + (["--mesh", args.mesh] if args.mesh else [])
  return launch_server(flags, data, args.start_timeout, "bench_serve")


def one_job(client, args: argparse.Namespace, index: int) -> float:
  """Submits job `index`, polls until it is completed; returns its latency in seconds."""
  start = time.perf_counter()
  body = {"prompt": PROMPTS[index % len(PROMPTS)], "seed": index, "size": args.size, "num_frames": args.frames,
          "num_inference_steps": args.steps}
  job = client.post("/v1/videos", json=body).json()
  if "id" not in job:
    raise SystemExit(f"bench_serve: the server refused a job: {job}")
  while True:
    status = client.get(f"/v1/videos/{job['id']}").json()["status"]
    if status == "completed":
      return time.perf_counter() - start
    if status in ("failed", "cancelled"):
      raise SystemExit(f"bench_serve: job {job['id']} {status}")
    time.sleep(0.02)


def round_at(url: str, args: argparse.Namespace, concurrency: int) -> dict:
  """`args.jobs` jobs by `concurrency` closed-loop clients: videos/min, p50 / p95 latency."""
  import httpx

  counter, lock, latencies = [0], threading.Lock(), []

  def client_loop() -> None:
    with httpx.Client(base_url=url, timeout=600) as client:
      while True:
        with lock:
          if counter[0] >= args.jobs:
            return
          counter[0] += 1
          index = counter[0]
        seconds = one_job(client, args, index)
        with lock:
          latencies.append(seconds)

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
    for future in [pool.submit(client_loop) for _ in range(concurrency)]:
      future.result()
  wall = time.perf_counter() - start
  ordered = sorted(latencies)
  return {"concurrency": concurrency, "jobs": len(ordered), "wall_s": wall, "videos_per_min": 60 * len(ordered) / wall,
          "p50_s": statistics.median(ordered), "p95_s": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]}


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--model", default="tiny")
  p.add_argument("--mesh", default=None)
  p.add_argument("--concurrency", default="1,4,8", help="comma-separated client counts")
  p.add_argument("--jobs", type=int, default=16, help="jobs per concurrency level")
  p.add_argument("--max-batch", type=int, default=4, help="the batching setting (compared with 1)")
  p.add_argument("--size", default="64x64")
  p.add_argument("--frames", type=int, default=17)
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--start-timeout", type=float, default=900)
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  levels = [int(c) for c in args.concurrency.split(",")]
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    cache = os.path.join(tmp, "cache")
    for max_batch in sorted({1, args.max_batch}):
      data = os.path.join(tmp, f"data-{max_batch}")
      os.makedirs(data)
      process, url = start_server(args, max_batch, data, cache)
      try:
        for level in levels:
          row = {"max_batch": max_batch, **round_at(url, args, level)}
          print(f"max_batch {max_batch:2d}  concurrency {level:2d}: {row['videos_per_min']:7.1f} videos/min  "
                f"p50 {row['p50_s']:6.2f} s  p95 {row['p95_s']:6.2f} s  ({row['jobs']} jobs, {row['wall_s']:.1f} s)",
                flush=True)
          results.append(row)
      finally:
        process.terminate()
        process.wait(30)
  if args.json:
    write_json({"settings": vars(args), "results": results}, args.json, overwrite=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
