"""The test harness's XLA_FLAGS, shared by conftest.py and the tests that start child processes."""

from __future__ import annotations

import os
import re

DEVICE_FLAG = "xla_force_host_platform_device_count"
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)


def child_env(**extra: str) -> dict[str, str]:
  """os.environ for a child process that picks its own device count (generate simulates the
  mesh's devices): XLA_FLAGS without the harness's --xla_force_host_platform_device_count, every
  other flag kept (e.g. --xla_cpu_max_isa, so the child rounds as this process does); JAX_PLATFORMS
  cpu; then `extra`."""
  env = dict(os.environ)
  flags = re.sub(rf"\s*--{DEVICE_FLAG}=\S*", "", env.pop("XLA_FLAGS", "")).strip()
  if flags:
    env["XLA_FLAGS"] = flags
  return {**env, "JAX_PLATFORMS": "cpu", **extra}


def user_docs() -> str:
  """README.md and docs/*.md, one after another: the documentation a user reads (the README links
  the docs pages, where most facts live)."""
  import glob
  paths = [os.path.join(REPO_ROOT, "README.md"), *sorted(glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))]
  texts = []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      texts.append(f.read())
  return "\n".join(texts)


def step_compiles(monkeypatch) -> list:
  """Records every denoise-step program compiled while the test runs, by any pipeline (the
  `CompiledSteps` of pipelines built inside `generate` too); returns the list it appends to."""
  from pipelines.pipeline.run.step import CompiledSteps

  compiled = []
  original = CompiledSteps.get

  def get(self, *args, **kwargs):
    before = self.traces
    program = original(self, *args, **kwargs)
    if self.traces != before:
      compiled.append(program)
    return program

  monkeypatch.setattr(CompiledSteps, "get", get)
  return compiled


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on now."""
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def serve_process(root: str, data: str, port: int, *flags: str, log: str = "server.log"):
  """A `serve` subprocess of the tiny default on 127.0.0.1:`port` with `--data-dir data` and `flags`
  (stderr appended to data/`log`), in an environment of its own devices (`child_env`, no JAX
  coordinator variables); returns its subprocess.Popen."""
  import subprocess
  import sys
  os.makedirs(data, exist_ok=True)
  command = [sys.executable, "-m", "pipelines.serve.main", "--model", "tiny", "--port", str(port),
             "--data-dir", data, *flags]
  env = {k: v for k, v in child_env(PYTHONPATH=root).items() if not k.startswith("JAX_COORDINATOR")
         and k not in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}
  return subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.DEVNULL,
                          stderr=open(os.path.join(data, log), "a"))


def wait_healthy(client, process, timeout: float = 180.0) -> None:
  """Returns once `client` (an httpx.Client at the server) gets 200 from /health; fails if
  `process` exits first or `timeout` seconds pass."""
  import time
  deadline = time.monotonic() + timeout
  while True:
    assert process.poll() is None, f"the server exited with status {process.returncode}"
    try:
      if client.get("/health").status_code == 200:
        return
    except Exception:  # noqa: BLE001 -- not listening yet
      pass
    assert time.monotonic() < deadline, f"the server did not get ready in {timeout} s"
    time.sleep(0.1)


def http_thread(app):
  """A context manager: uvicorn serving the ASGI `app` on 127.0.0.1 on a thread of this process;
  yields its base URL (stopped on exit)."""
  import contextlib
  import threading
  import time

  import uvicorn

  @contextlib.contextmanager
  def serving():
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
      assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
      time.sleep(0.01)
    try:
      yield f"http://127.0.0.1:{port}"
    finally:
      server.should_exit = True
      thread.join(30)

  return serving()


def end_to_end_commands() -> list[str]:
  """Dotted names of the command modules under end_to_end/ (read with `ast`, nothing imported): a
  module is a command when it has an `if __name__ == "__main__":` block or a top-level `main`."""
  import ast
  import pathlib

  found = []
  for path in sorted(pathlib.Path(REPO_ROOT, "end_to_end").rglob("*.py")):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    main_block = any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)
    main_function = any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)
    if main_block or main_function:
      found.append(".".join(path.relative_to(REPO_ROOT).with_suffix("").parts))
  return found
