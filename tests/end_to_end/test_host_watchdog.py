"""end_to_end/host_watchdog.sh: a command under it runs as usual below the limit and is killed, with
the watchdog's line, above it (the machine's memory in use always exceeds a limit of 1 MiB)."""

import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "end_to_end" / "host_watchdog.sh"


def _run(limit_gib: str, *command: str) -> subprocess.CompletedProcess:
  return subprocess.run(["bash", str(SCRIPT), limit_gib, *command], capture_output=True, text=True, timeout=60)


def test_below_the_limit_the_command_runs_and_its_status_is_kept():
  done = _run("100000", sys.executable, "-c", "print('made it'); raise SystemExit(3)")
  assert done.returncode == 3 and "made it" in done.stdout
  assert "host watchdog: peak" in done.stdout and "killing" not in done.stderr


def test_above_the_limit_the_command_is_killed_with_a_line():
  start = time.perf_counter()
  done = _run("0.001", "sleep", "30")
  assert done.returncode == 137 and time.perf_counter() - start < 20
  assert "passed the limit 0.0 GiB; killing the command" in done.stderr


def test_usage_is_refused():
  done = _run("5")
  assert done.returncode == 2 and "usage" in done.stderr
