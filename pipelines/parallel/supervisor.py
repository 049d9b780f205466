"""One process of a multi-process run, watched from outside: a lost peer ends it with one clear line.

When a process of a multi-process run dies (killed, out of memory, its host gone), JAX's
coordination service notices that its heartbeats stopped (`ProcessSpec.heartbeat_timeout_s`) and
every surviving process is aborted from C++: SIGABRT, exit status 134, and a page of absl log and
stack trace, with no Python exception to catch (measured with jax 0.10: process 1 killed ->
process 0 aborted ~heartbeat timeout later; process 0 killed -> process 1 aborted at once, its
error poll to the coordinator failing). A gloo collective may instead fail first with a Python
`JaxRuntimeError` ("Connection reset by peer"), which names an address, not a process.

So `generate` runs each process of a multi-process run as a child of a small supervisor
(`run_supervised`, no JAX in it):
- the child's stdout and stderr pass through filters that forward the program's own lines (and
  progress bars) as they come and divert the runtime's C++ log records (absl/glog lines
  `E1130 15:23:00.340405 123 file.cc:45] ...` with their continuation lines and stack traces) and
  gloo's chatter (`[Gloo] Rank 0 is connected ...`, on stdout) to a log file, created on the first
  such line;
- when the child dies from the runtime's abort (or on a signal) and the log shows the
  coordination service's verdict, the supervisor prints one line naming the lost process and what
  to do, and exits with `EXIT_PEER_LOST` (3). Other exits pass through unchanged;
- SIGINT / SIGTERM / SIGHUP sent to the supervisor are passed to the child (started in its own
  session, so a Ctrl-C reaches it once, and with SIGINT at its default even where the supervisor
  inherited it ignored), which stops as a single-process run does (exit 130); the
  child gets SIGKILL if the supervisor itself dies (Linux parent-death signal).

The child learns it is supervised from `ENV_SUPERVISED` and may leave a note for the supervisor in
the JSON file named by `ENV_STATUS` (e.g. {"checkpoint_dir": ...}, quoted in the lost-peer line).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any, BinaryIO

EXIT_PEER_LOST = 3
ENV_SUPERVISED = "WAN_USP_SUPERVISED"
ENV_STATUS = "WAN_USP_STATUS_FILE"

# absl / glog record header: severity, MMDD, time, thread id, file:line]
_RUNTIME_HEADER = rb"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+\s+\S+:\d+\]"
_RUNTIME_LINE = re.compile(rb"^" + _RUNTIME_HEADER)
_RUNTIME_INSIDE = re.compile(_RUNTIME_HEADER)  # a record written while a progress bar's line was open
# gloo's connection lines (stdout; its "[Gloo] Rank " prefix may come apart from the rest)
_GLOO_LINE = re.compile(rb"^(\[Gloo\]|\d+ is connected to \d+ peer ranks)")
# What a program line can start with, ending a multi-line runtime record: our own prefixes, a
# progress bar, a Python traceback or warning.
_PROGRAM_LINE = re.compile(
    rb"^(\r|generate[: ]|text encode:|compile:|decode:|denoise|Traceback|[A-Za-z_][\w.]*(Error|Warning|Exception):)")
# Always the runtime's: absl's stack dump after a fatal record.
_STACK_LINE = re.compile(rb"^(\*\*\* Check failure stack trace|\s+@\s+0x[0-9a-f]+)")
# An incomplete line that may become a runtime record: held back until its end arrives (the
# runtime writes each record with one write, so that is at once).
_MAYBE_RUNTIME_START = re.compile(rb"^([IWEF](\d|$)|\[(G|$))")
_UNHEALTHY = re.compile(r"tasks are unhealthy \(stopped sending heartbeats\):\s*([\d\s,]+)")


class StreamFilter:
  """Splits a child's output stream into the program's output (forwarded at once, partial lines
  included, so progress bars move) and runtime log records (appended to a log file).

  Args:
    forward: where program output goes (the supervisor's stdout or stderr, binary).
    log_path: the log file for runtime records; created on the first one.
    lock: shared by the filters of one child's streams (they append to the same file).
  """

  def __init__(self, forward: BinaryIO, log_path: str, lock: threading.Lock | None = None):
    self.forward = forward
    self.log_path = log_path
    self._lock = lock or threading.Lock()
    self.diverted = 0  # runtime lines written to the log
    self._log: BinaryIO | None = None
    self._pending = b""  # an incomplete line not yet classified
    self._mid_line = False  # the start of the current line was forwarded already
    self._in_record = False  # inside a multi-line runtime record

  def _to_log(self, data: bytes) -> None:
    with self._lock:
      if self._log is None:
        self._log = open(self.log_path, "ab")
      self._log.write(data)
      self._log.flush()
    self.diverted += 1

  def _to_program(self, data: bytes) -> None:
    self.forward.write(data)
    self.forward.flush()

  def _line(self, line: bytes) -> None:
    if _RUNTIME_LINE.match(line) or _GLOO_LINE.match(line) or _STACK_LINE.match(line):
      self._in_record = not _GLOO_LINE.match(line)
      self._to_log(line)
    elif self._in_record and not _PROGRAM_LINE.match(line):
      self._to_log(line)  # continuation of a record (its message's next lines, a stack trace)
    else:
      self._in_record = False
      self._to_program(line)

  def feed(self, data: bytes) -> None:
    """Classifies `data` (any chunk of the stream) and writes it where it belongs."""
    data = self._pending + data
    self._pending = b""
    while data:
      match = re.search(rb"[\r\n]", data)
      if match is None:  # an incomplete line
        if self._mid_line:
          self._to_program(data)
        elif self._in_record or _MAYBE_RUNTIME_START.match(data):
          self._pending = data  # wait for the rest to classify it
        else:
          self._to_program(data)  # e.g. a progress bar drawn without a newline
          self._mid_line = True
        return
      line, data = data[:match.end()], data[match.end():]
      inside = _RUNTIME_INSIDE.search(line, 0 if self._mid_line else 1)
      if inside is not None and (self._mid_line or not self._in_record):
        # A runtime record that starts inside a program line (e.g. after a progress bar drawn
        # without a newline): the program's part ends the line, the record goes to the log.
        self._to_program(line[:inside.start()] + b"\n")
        self._mid_line = False
        self._line(line[inside.start():])
      elif self._mid_line:
        self._to_program(line)
        self._mid_line = False
      else:
        self._line(line)

  def close(self) -> None:
    """Flushes an incomplete last line and closes the log."""
    if self._pending:
      self._line(self._pending)
      self._pending = b""
    if self._log is not None:
      self._log.close()
      self._log = None


def lost_peer_line(log_text: str, process_id: int, num_processes: int, heartbeat_timeout_s: int,
                   status: dict) -> str | None:
  """The one line for a run that the runtime stopped because a process was lost; None when the
  log shows no such verdict.

  Args:
    log_text: the runtime log the filter diverted.
    process_id, num_processes: this process and the run's size.
    heartbeat_timeout_s: the heartbeat timeout the run used (quoted).
    status: the child's note (may name a "checkpoint_dir" and the "out" path).
  """
  if "distributed service detected fatal errors" not in log_text and "coordination service" not in log_text:
    return None
  unhealthy = _UNHEALTHY.search(log_text)
  if unhealthy is not None:
    lost = sorted({int(t) for t in re.findall(r"\d+", unhealthy.group(1))})
    who = ", ".join(f"process {t}" for t in lost) + f" of {num_processes}"
    what = f"{who} stopped responding (no heartbeat for {heartbeat_timeout_s} s)"
  elif process_id != 0 and ("PollForError" in log_text or "Heartbeat" in log_text):
    what = (f"process 0 of {num_processes} (the coordinator) stopped responding or exited; the "
            "connection to it was lost")
  else:
    what = "another process of the run failed (the runtime stopped this one)"
  out = status.get("out")
  nothing = f"nothing written to {out}" if out else "no output written"
  checkpoint = status.get("checkpoint_dir")
  todo = ("restart every process with the same command plus --resume " + checkpoint +
          " to continue from the last saved step" if checkpoint else
          "restart every process with the same command")
  return f"generate: error: process {process_id}: {what}; {nothing}; {todo}"


def _child_setup() -> None:
  """In the child before exec: SIGINT at its default, so that the child's Python raises
  KeyboardInterrupt on the SIGINT the supervisor forwards (a supervisor started with SIGINT
  ignored, as `cmd &` in a non-interactive shell starts it, would pass SIG_IGN on: Python keeps an
  ignored SIGINT ignored, and the child ran to its end); then `_die_with_parent`."""
  signal.signal(signal.SIGINT, signal.SIG_DFL)
  _die_with_parent()


def _die_with_parent() -> None:
  """In the child before exec: SIGKILL when the supervisor dies (Linux; elsewhere a no-op)."""
  try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


def run_supervised(argv: Sequence[str], *, process_id: int, num_processes: int,
                   heartbeat_timeout_s: int, log_path: str | None = None) -> int:
  """Runs `python -m pipelines.cli.generate argv` as a supervised child; returns the exit status.

  Args:
    argv: the command's arguments (unchanged).
    process_id, num_processes, heartbeat_timeout_s: from the run's `ProcessSpec` (for the message).
    log_path: the runtime log file; default `wan-usp-generate-process{I}-{pid}.log` in the system
      temporary directory (kept only if something was written to it).

  Returns:
    the child's exit status, `EXIT_PEER_LOST` when the runtime stopped it for a lost process, or
    128 + N when it died from signal N otherwise.
  """
  if log_path is None:
    log_path = os.path.join(tempfile.gettempdir(),
                            f"wan-usp-generate-process{process_id}-{os.getpid()}.log")
  fd, status_path = tempfile.mkstemp(prefix="wan-usp-status-", suffix=".json")
  os.close(fd)
  env = dict(os.environ, **{ENV_SUPERVISED: "1", ENV_STATUS: status_path})
  child = subprocess.Popen([sys.executable, "-m", "pipelines.cli.generate", *argv], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                           preexec_fn=_child_setup if os.name == "posix" else None)
  code = _wait_filtering(child, log_path)
  status = _read_status(status_path)
  log_text = ""
  if os.path.exists(log_path):
    with open(log_path, encoding="utf-8", errors="replace") as f:
      log_text = f.read()
  if code < 0 or code == 128 + signal.SIGABRT:
    line = lost_peer_line(log_text, process_id, num_processes, heartbeat_timeout_s, status)
    if line is not None:
      print(f"{line} (runtime log: {log_path})", file=sys.stderr, flush=True)
      return EXIT_PEER_LOST
    name = signal.Signals(-code).name if code < 0 else "SIGABRT"
    where = f"; runtime log: {log_path}" if log_text else ""
    print(f"generate: error: process {process_id} died from {name}{where}", file=sys.stderr, flush=True)
    return 128 + (-code if code < 0 else signal.SIGABRT)
  if log_text and code != 0:
    print(f"generate: runtime log: {log_path}", file=sys.stderr, flush=True)
  return code


def _wait_filtering(child: subprocess.Popen, log_path: str) -> int:
  """Waits for `child`, its stdout and stderr passed through `StreamFilter`s (runtime noise to
  `log_path`) and SIGINT / SIGTERM / SIGHUP forwarded to it meanwhile; returns its exit status
  (negative: killed by that signal)."""
  lock = threading.Lock()  # one log file, two streams
  filters = [StreamFilter(sys.stdout.buffer, log_path, lock), StreamFilter(sys.stderr.buffer, log_path, lock)]

  def pump(stream, filt: StreamFilter) -> None:
    while True:
      data = os.read(stream.fileno(), 65536)
      if not data:
        return
      filt.feed(data)

  readers = [threading.Thread(target=pump, args=(stream, filt), daemon=True)
             for stream, filt in zip((child.stdout, child.stderr), filters)]
  for reader in readers:
    reader.start()
  forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
  previous = {s: signal.signal(s, lambda signum, frame: child.send_signal(signum)) for s in forwarded}
  try:
    while True:
      try:
        code = child.wait()
        break
      except InterruptedError:
        continue
    for reader in readers:
      reader.join(timeout=10)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    for filt in filters:
      filt.close()
  return code


def _read_status(status_path: str) -> dict[str, Any]:
  """The note the child left (`write_status`), {} when it wrote none; the file is removed."""
  try:
    with open(status_path, encoding="utf-8") as f:
      return json.load(f) if os.path.getsize(status_path) else {}
  except (OSError, ValueError):
    return {}
  finally:
    try:
      os.remove(status_path)
    except OSError:
      pass


def write_status(**fields) -> None:
  """In a supervised child: merges `fields` into the note the supervisor reads (no-op otherwise)."""
  path = os.environ.get(ENV_STATUS)
  if not path:
    return
  try:
    with open(path, encoding="utf-8") as f:
      status = json.load(f) if os.path.getsize(path) else {}
  except (OSError, ValueError):
    status = {}
  status.update(fields)
  from pipelines.storage import video_io  # (the child only: it has the whole program loaded anyway)
  video_io.write_json(status, path, overwrite=True)


def wait_for_runtime_verdict(heartbeat_timeout_s: int) -> None:
  """After a collective failed in a supervised multi-process run: give the coordination service
  time to name the lost process (it aborts this process, and the supervisor says which), up to the
  heartbeat timeout plus 5 s; returns if nothing happened (a failure of another kind)."""
  if os.environ.get(ENV_SUPERVISED):
    time.sleep(heartbeat_timeout_s + 5)
