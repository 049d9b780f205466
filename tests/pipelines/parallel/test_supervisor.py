"""Tests for pipelines/parallel/supervisor.py without processes: the output filter and the lost-peer line.

The records are the ones jax 0.10's runtime printed when a peer was killed (see the module
docstring); the end-to-end behaviour is tests/system/test_multihost.py::test_lost_process_ends_the_run.
"""

from __future__ import annotations

import io

import pytest

from pipelines.parallel import supervisor

RECORD = (
    b"E1130 15:24:30.199317   15899 coordination_service.cc:1549] [1291] Use error polling to propagate "
    b"the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending "
    b"heartbeats):\n1\nThe tasks have crashed. Check the task logs for an earlier error.\n"
    b"F1130 15:24:30.200095   15910 client.h:80] Terminating process because the JAX distributed "
    b"service detected fatal errors.\n:UNKNOWN:Error received from peer  {grpc_message:\"Socket closed\"}\n"
    b"*** Check failure stack trace: ***\n    @     0x7fe5a3840634  absl::LogMessage::SendToLog()\n"
    b"    @     0x7fe5aaca71f5  (unknown)\n")
PROGRAM = [b"generate: model tiny\n", b"\rdenoise:   1%|", b"\rdenoise:   2%|", b"\n"]


@pytest.mark.parametrize("chunk", [1, 3, 64, 10_000])
def test_filter_splits_program_from_runtime(tmp_path, chunk):
  log = tmp_path / "runtime.log"
  data = (PROGRAM[0] + b"[Gloo] Rank 0 is connected to 3 peer ranks.\n" + PROGRAM[1] + PROGRAM[2]
          + PROGRAM[3] + RECORD + b"generate: error: lost\n")
  out = io.BytesIO()
  filt = supervisor.StreamFilter(out, str(log))
  for i in range(0, len(data), chunk):
    filt.feed(data[i:i + chunk])
  filt.close()
  assert out.getvalue() == b"".join(PROGRAM) + b"generate: error: lost\n"
  assert log.read_bytes() == b"[Gloo] Rank 0 is connected to 3 peer ranks.\n" + RECORD


def test_progress_bar_is_forwarded_before_its_line_ends(tmp_path):
  out = io.BytesIO()
  filt = supervisor.StreamFilter(out, str(tmp_path / "log"))
  filt.feed(b"\rdenoise:  10%|#")
  assert out.getvalue() == b"\rdenoise:  10%|#"  # not held back until a newline
  filt.feed(b"E1130 15")  # the bar's line has not ended: this continues it
  assert out.getvalue() == b"\rdenoise:  10%|#E1130 15"
  filt.feed(b"\nE1130 15")  # at a line start it may be a runtime record: held until its line ends
  assert out.getvalue() == b"\rdenoise:  10%|#E1130 15\n"
  filt.feed(b":23:00.340405 15177 service.cc:12] lost\n")
  assert out.getvalue() == b"\rdenoise:  10%|#E1130 15\n"
  filt.close()
  assert (tmp_path / "log").read_bytes() == b"E1130 15:23:00.340405 15177 service.cc:12] lost\n"


def test_record_inside_a_progress_line_goes_to_the_log(tmp_path):
  out = io.BytesIO()
  filt = supervisor.StreamFilter(out, str(tmp_path / "log"))
  filt.feed(b"\rdenoise:  10%|#")  # a bar drawn without a newline, then the runtime's record
  filt.feed(b"E1130 15:23:00.340405 15177 service.cc:12] stopped sending heartbeats\n1\n")
  filt.feed(b"1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n")
  filt.feed(b"generate: error: lost\n")
  filt.close()
  assert out.getvalue() == b"\rdenoise:  10%|#\ngenerate: error: lost\n"
  assert (tmp_path / "log").read_bytes() == (
      b"E1130 15:23:00.340405 15177 service.cc:12] stopped sending heartbeats\n1\n"
      b"1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n")


def test_lost_peer_lines():
  text = RECORD.decode()
  line = supervisor.lost_peer_line(text, 0, 2, 30, {"out": "fox.mp4", "checkpoint_dir": "fox.mp4.resume"})
  assert line == ("generate: error: process 0: process 1 of 2 stopped responding (no heartbeat for 30 s); "
                  "nothing written to fox.mp4; restart every process with the same command plus --resume "
                  "fox.mp4.resume to continue from the last saved step")
  poll = ("F1130 15:24:38.371336 16038 client.h:80] Terminating process because the JAX distributed service "
          "detected fatal errors.\nRPC: /xla.coordination.CoordinationService/PollForError\n")
  assert "process 0 of 4 (the coordinator)" in supervisor.lost_peer_line(poll, 2, 4, 30, {})
  assert supervisor.lost_peer_line("F1130 12:00:00.0 1 x.cc:1] Check failed: x\n", 0, 2, 30, {}) is None
