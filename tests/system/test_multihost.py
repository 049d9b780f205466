"""Tests for pipelines/parallel/distributed.py and pipelines/parallel/supervisor.py: `generate` on JAX's distributed runtime, 2 processes x 2 CPU devices (a run, a coordinator that is not there, a process lost mid-run and its run resumed).

The processes are fresh interpreters on 127.0.0.1 (a free port picked at run time, gloo CPU
collectives, XLA_FLAGS without the harness's device count: the command splits the mesh's 4 devices
over the 2 processes itself).
Their denoised latents (the kept checkpoint's) must equal, bit for bit, the single-process run of
the same command, which runs in this process meanwhile (8 fake devices; the mesh uses the first
ones): every collective of the step moves data or takes a max, and the one sum (the attention's
k sums) is gathered and added in mesh order, so no collective implementation reorders a sum
(DESIGN.md section 3). Both decode on one device (--no-vae-parallel): split by rows, a multi-process
run decodes over the writing process's devices only, another split than one process's (DESIGN.md
section 8). Their videos (.npy float32 frames, unquantised) agree to fp32 rounding, not bit for
bit: XLA's CPU client rounds the same one-device decode program differently with the number of
devices in its process (same latents, 2 / 4 / 8 / 16 devices: 0 / 14 / 4 / 10 of 15,360 values
one ulp apart on an AMD EPYC without AVX-512; equal on other hosts).
Every process started here is bounded by a timeout and killed by PID in a `finally`.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.harness import REPO_ROOT, child_env
from pipelines.parallel import distributed
from pipelines.cli import generate
from pipelines.pipeline.run import resume
from tests.numerics import FP32_VIDEO_PSNR_DB, assert_psnr_at_least

RESUME_PSNR_DB = 60.0  # issue acceptance; sharded and single-device runs agree to ~1e-7

ROOT = REPO_ROOT
ARGS = ["--prompt", "a red fox running through snow", "--mesh", "U=2,R=2", "--size", "32x32",
        "--frames", "5", "--steps", "2", "--seed", "3", "--max-sequence-length", "8"]
TIMEOUT_S = 150


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env() -> dict[str, str]:
  """This environment without the test harness's device count or any inherited distributed
  settings."""
  drop = {distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID}
  return {k: v for k, v in child_env().items() if k not in drop}


def _start(argv: list[str], log: str, cwd: str = ROOT, *, sigint_ignored: bool = False) -> subprocess.Popen:
  """`generate argv` with its output in `log`; `sigint_ignored`: started as `cmd &` in a
  non-interactive shell starts it, with SIGINT ignored (inherited by its children)."""
  ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
  with open(log, "w") as f:  # the child keeps its own descriptor
    return subprocess.Popen([sys.executable, "-m", "pipelines.cli.generate", *argv], cwd=cwd,
                            env={**_env(), "PYTHONPATH": ROOT}, stdout=f, stderr=subprocess.STDOUT,
                            preexec_fn=ignore)


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
  deadline = time.monotonic() + timeout_s
  return [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in procs]


def _end(procs: list[subprocess.Popen]) -> None:
  for p in procs:
    if p.poll() is None:
      p.kill()  # by PID (SIGKILL to p.pid)
      p.wait()


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # fork + exec of a child process is safe
@pytest.mark.parametrize("mesh,per_process", [("U=2,R=2", 2), ("CFG=2,U=2,R=2", 4)])
def test_two_processes_equal_one(tmp_path, mesh, per_process):
  """U=2,R=2: the ring crosses the processes; CFG=2,U=2,R=2: each process runs one guidance branch
  and the noise predictions cross. The heartbeat timeout is long: this test checks the video, and
  on a loaded 2-core host three JAX processes can starve a heartbeat for the default 30 s while
  process 1 waits at the shutdown barrier for process 0 to decode and write."""
  out, ref = tmp_path / "multi.npy", tmp_path / "single.npy"
  args = list(ARGS) + ["--no-vae-parallel", "--keep-checkpoint"]
  args[args.index("--mesh") + 1] = mesh
  coordinator = f"127.0.0.1:{_free_port()}"
  logs = [str(tmp_path / f"process{i}.log") for i in range(2)]
  procs: list[subprocess.Popen] = []
  try:
    for i in range(2):
      procs.append(_start(args + ["--out", str(out), "--checkpoint-dir", str(tmp_path / "multi.resume"),
                                  "--coordinator", coordinator, "--num-processes", "2",
                                  "--process-id", str(i), "--coordinator-timeout", "60",
                                  "--heartbeat-timeout", "120"], logs[i]))
    assert generate.main(args + ["--out", str(ref), "--checkpoint-dir", str(tmp_path / "single.resume")]) == 0
    # single process, the first of 8 devices
    codes = _wait_all(procs, TIMEOUT_S)
  finally:
    _end(procs)
  text = [open(log).read() for log in logs]
  assert codes == [0, 0], text
  total = 2 * per_process
  assert f"in each of 2 processes ({total} in all; this is process 0)" in text[0], text[0]
  assert "process 1 done; process 0 writes" in text[1], text[1]
  multi, single = np.load(out), np.load(ref)
  assert multi.shape == single.shape == (5, 32, 32, 3)
  assert single.std() > 0.01  # a video, not a constant that any two runs share
  states = [resume.read(str(tmp_path / f"{name}.resume")) for name in ("multi", "single")]
  assert all(s is not None and s.step == 2 for s in states), states
  for key, value in states[1].arrays.items():  # the latents and the solver's state
    np.testing.assert_array_equal(states[0].arrays[key], value, err_msg=f"2 processes vs 1: {key} not bit-identical")
  assert states[1].arrays["latents"].std() > 0.1  # latents, not a constant any two runs share
  assert_psnr_at_least(multi, single, FP32_VIDEO_PSNR_DB, name="2 processes vs 1, decoded on one device")
  assert sorted(os.listdir(tmp_path)) == sorted(["multi.npy", "multi.npy.json", "single.npy", "single.npy.json",
                                                 "multi.resume", "single.resume", "process0.log", "process1.log"])


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_processes_with_different_weights_are_refused(tmp_path):
  """The same --lora path on both processes, another file behind it on process 1 (a stale copy on
  one host): both refuse before the first step, naming process 1 and the model fingerprint; the
  command lines are equal, so only the fingerprint comparison can catch it."""
  from safetensors.numpy import save_file

  from pipelines.wan import lora
  from pipelines.wan.pretrained import TINY_TRANSFORMER
  layers = lora.linear_layers(TINY_TRANSFORMER)
  module = "blocks.0.attn1.to_q"
  (out_dim, in_dim), _, _ = layers[module]
  coordinator = f"127.0.0.1:{_free_port()}"
  logs = [str(tmp_path / f"process{i}.log") for i in range(2)]
  procs: list[subprocess.Popen] = []
  try:
    for i in range(2):
      host = tmp_path / f"host{i}"
      host.mkdir()
      rng = np.random.default_rng(i)  # another LoRA on each "host"
      save_file({f"transformer.{module}.lora_A.weight": rng.standard_normal((2, in_dim), np.float32),
                 f"transformer.{module}.lora_B.weight": rng.standard_normal((out_dim, 2), np.float32)},
                str(host / "style.safetensors"))
      procs.append(_start(ARGS + ["--model", "tiny-random", "--lora", "style.safetensors",
                                  "--out", str(tmp_path / "x.npy"), "--coordinator", coordinator,
                                  "--num-processes", "2", "--process-id", str(i), "--coordinator-timeout", "60"],
                          logs[i], cwd=str(host)))
    codes = _wait_all(procs, TIMEOUT_S)
  finally:
    _end(procs)
  text = [open(log).read() for log in logs]
  assert codes == [1, 1], (codes, text)
  for log in text:
    assert "process(es) [1] of 2 hold other weights, LoRAs or inputs than process 0" in log, log
    assert "compile: the denoise step" not in log, log  # refused before the step
  assert "model_fingerprint" in text[1], text[1]  # the process that differs names what differs
  assert not os.path.exists(tmp_path / "x.npy")


def test_unreachable_coordinator_fails_clearly(tmp_path):
  """Process 1 with no coordinator listening: a DistributedError (exit 1) after the timeout.
  Process 0 whose peer never comes: the watchdog's message and exit 1 (JAX itself would abort)."""
  ports = [_free_port(), _free_port()]  # separate ports: the two must not find each other
  logs = [str(tmp_path / f"p{i}.log") for i in range(2)]
  procs: list[subprocess.Popen] = []
  try:
    for i in range(2):
      procs.append(_start(ARGS + ["--coordinator", f"127.0.0.1:{ports[i]}", "--num-processes", "2",
                                  "--process-id", str(i), "--coordinator-timeout", "3",
                                  "--out", str(tmp_path / f"{i}.mp4")], logs[i]))
    codes = _wait_all(procs, 60)
  finally:
    _end(procs)
  text = [open(log).read() for log in logs]
  assert codes == [1, 1], text
  assert (f"process 1 of 2: could not reach the coordinator at 127.0.0.1:{ports[1]}" in text[1]
          and "within 3 s" in text[1]), text[1]
  assert "process 0 of 2: not every process connected to the coordinator within 3 s" in text[0], text[0]
  assert not [n for n in os.listdir(tmp_path) if not n.endswith(".log")]


@pytest.mark.parametrize("kwargs,env,match", [
    (dict(coordinator="127.0.0.1:1234", num_processes=2), {}, "missing .*--process-id / JAX_PROCESS_ID"),
    (dict(coordinator="127.0.0.1", num_processes=2, process_id=0), {}, "must be HOST:PORT"),
    (dict(coordinator="h:1", num_processes=2, process_id=2), {}, r"process_id=2 must be in 0\.\.1"),
    (dict(), {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two' must be an integer"),
])
def test_process_spec_errors(kwargs, env, match):
  with pytest.raises(ValueError, match=match):
    distributed.process_spec(**kwargs, env=env)


def test_process_spec_from_environment():
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
  assert distributed.process_spec(env=env) == distributed.ProcessSpec("10.0.0.1:1234", 4, 3)
  assert distributed.process_spec(process_id=1, env=env).process_id == 1  # a flag wins
  assert distributed.process_spec(env={}) is None
  assert distributed.process_spec(num_processes=1, env={}) is None  # one process needs no runtime


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_lost_process_ends_the_run_and_it_resumes(tmp_path):
  """Process 1's worker killed (SIGKILL) mid-denoise: process 0 stops within the heartbeat timeout
  + 10 s with exit status 3, one line naming process 1 and the checkpoint to resume from, no
  output, and no stack dump on its terminal (the runtime's log is in the file it names). Then the
  saved run resumes in one process on another mesh (U=1,R=1) to the uninterrupted run's video."""
  heartbeat = 5
  steps = 40
  coordinator = f"127.0.0.1:{_free_port()}"
  args = list(ARGS)
  args[args.index("--steps") + 1] = str(steps)  # still denoising when killed
  ckpt = str(tmp_path / "ckpt")
  logs = [str(tmp_path / f"process{i}.log") for i in range(2)]
  runtime_log = str(tmp_path / "runtime0.log")
  procs: list[subprocess.Popen] = []
  try:
    for i in range(2):
      procs.append(_start(args + ["--out", str(tmp_path / "out.npy"), "--coordinator", coordinator,
                                  "--num-processes", "2", "--process-id", str(i), "--heartbeat-timeout",
                                  str(heartbeat), "--coordinator-timeout", "60", "--checkpoint-dir", ckpt]
                          + (["--runtime-log", runtime_log] if i == 0 else []), logs[i]))
    deadline = time.monotonic() + TIMEOUT_S
    while not re.search(rf" [1-9]\d*/{steps} \[", open(logs[0]).read()):  # a step done, bar drawn
      assert time.monotonic() < deadline and procs[0].poll() is None, open(logs[0]).read()
      time.sleep(0.05)
    worker = int(subprocess.check_output(["pgrep", "-P", str(procs[1].pid)]).split()[0])
    os.kill(worker, 9)
    killed = time.monotonic()
    code = procs[0].wait(timeout=heartbeat + 60)
    elapsed = time.monotonic() - killed
    procs[1].wait(timeout=30)
  finally:
    _end(procs)
  text = open(logs[0]).read()
  assert code == 3, text
  assert elapsed <= heartbeat + 10, elapsed
  errors = [line for line in text.replace("\r", "\n").splitlines() if line.startswith("generate: error")]
  assert len(errors) == 1 and "process 1 of 2 stopped responding" in errors[0], text
  assert f"--resume {ckpt}" in errors[0] and runtime_log in errors[0], errors[0]
  assert "Check failure stack trace" not in text and " 0x" not in text, text
  assert "stopped sending heartbeats" in open(runtime_log).read()  # positive control: the dump is there
  assert "SIGKILL" in open(logs[1]).read()  # process 1's supervisor reports its worker's death
  assert not [n for n in os.listdir(tmp_path) if n.startswith("out")]
  saved = resume.read(ckpt)
  assert saved is not None and 1 <= saved.step < steps, saved and saved.step

  assert generate.main(["--resume", ckpt, "--out", str(tmp_path / "resumed.npy")]) == 0
  assert generate.main(args + ["--out", str(tmp_path / "uninterrupted.npy")]) == 0
  assert_psnr_at_least(np.load(tmp_path / "resumed.npy"), np.load(tmp_path / "uninterrupted.npy"),
                       RESUME_PSNR_DB, name=f"2 processes killed after step {saved.step}, resumed on 1 device")
  assert not os.path.exists(ckpt)


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_processes_with_other_settings_are_refused(tmp_path):
  """Process 1 started with another seed: both refuse before compute (exit 2), naming the setting."""
  coordinator = f"127.0.0.1:{_free_port()}"
  logs = [str(tmp_path / f"process{i}.log") for i in range(2)]
  procs: list[subprocess.Popen] = []
  try:
    for i in range(2):
      args = list(ARGS)
      args[args.index("--seed") + 1] = str(3 + i)
      procs.append(_start(args + ["--out", str(tmp_path / "out.npy"), "--coordinator", coordinator,
                                  "--num-processes", "2", "--process-id", str(i), "--coordinator-timeout", "60"],
                          logs[i]))
    codes = _wait_all(procs, TIMEOUT_S)
  finally:
    _end(procs)
  text = [open(log).read() for log in logs]
  assert codes == [2, 2], text
  assert "process(es) [1] of 2 were started with other settings than process 0" in text[0], text[0]
  assert "seed: 4 here, 3 on process 0" in text[1], text[1]
  assert not [n for n in os.listdir(tmp_path) if n.startswith("out")]


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_ctrl_c_of_one_process(tmp_path):
  """Ctrl-C (SIGINT) to process 1 only, mid-denoise: it stops at once with exit 130 and the resume
  hint; process 0 stops within the heartbeat timeout + 10 s with exit 3 naming process 1. Both are
  started with SIGINT ignored, as a background job (`cmd &`, e.g. a CI runner) is: the supervisor
  forwards the SIGINT it is sent, and its child must act on it (it ignored it, and ran to its end,
  before the supervisor reset SIGINT in the child)."""
  heartbeat = 5
  steps = 400
  args = list(ARGS)
  args[args.index("--steps") + 1] = str(steps)
  coordinator = f"127.0.0.1:{_free_port()}"
  logs = [str(tmp_path / f"process{i}.log") for i in range(2)]
  procs: list[subprocess.Popen] = []
  try:
    for i in range(2):
      procs.append(_start(args + ["--out", str(tmp_path / "out.npy"), "--coordinator", coordinator,
                                  "--num-processes", "2", "--process-id", str(i), "--heartbeat-timeout",
                                  str(heartbeat), "--coordinator-timeout", "60",
                                  "--checkpoint-dir", str(tmp_path / "ckpt")], logs[i], sigint_ignored=True))
    deadline = time.monotonic() + TIMEOUT_S
    while not re.search(rf" [1-9]\d*/{steps} \[", open(logs[0]).read()):
      assert time.monotonic() < deadline and procs[0].poll() is None, open(logs[0]).read()
      time.sleep(0.05)
    procs[1].send_signal(2)  # SIGINT to process 1's supervisor only
    sent = time.monotonic()
    code1 = procs[1].wait(timeout=30)
    stopped1 = time.monotonic() - sent
    code0 = procs[0].wait(timeout=heartbeat + 60)
    stopped0 = time.monotonic() - sent
  finally:
    _end(procs)
  text = [open(log).read() for log in logs]
  assert code1 == 130 and stopped1 < 10, (code1, stopped1, text[1])
  assert "generate: interrupted; nothing written" in text[1] and "another process" not in text[1], text[1]
  assert code0 == 3 and stopped0 <= heartbeat + 10, (code0, stopped0, text[0])
  assert "process 1 of 2 stopped responding" in text[0], text[0]
