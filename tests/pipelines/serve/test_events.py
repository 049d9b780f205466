"""Tests for pipelines/serve/events.py: what the operator of `serve` reads: the loading, warm-up and
ready lines, one line per job as it starts and ends (driven through a real `Service` with the
worker's stand-in pipeline), the line format, and --log-level reaching uvicorn."""

from __future__ import annotations

import logging

import pytest

from pipelines.serve import api, events
from pipelines.serve.main import model_facts
from pipelines.serve.options import ServeConfig, parse
from pipelines.serve.service import Service
from tests.pipelines.serve.test_worker import StandInPipe, wait_finished


def test_job_line_format():
  row = {"id": "video_ab", "params": {"width": 64, "height": 32, "num_frames": 17, "num_inference_steps": 8}}
  assert events.job_line(row, "completed", seconds=9.42, batch=2) == \
      "job video_ab completed: 64x32 x 17 frames, 8 steps, 9.4 s (batch of 2)"
  assert events.job_line(row, "failed", error="ValueError: x") == \
      "job video_ab failed: 64x32 x 17 frames, 8 steps: ValueError: x"
  assert events.job_line({"id": "video_cd"}, "started").startswith("job video_cd started")  # an unreadable row


def test_a_server_says_loading_ready_and_each_job(tmp_path, caplog):
  config = ServeConfig(model="tiny", data_dir=str(tmp_path), port=8123, max_batch=1)
  facts = model_facts(config)
  service = Service(config, facts, load=lambda: StandInPipe(facts))
  caplog.set_level(logging.INFO, logger=events.LOGGER)
  service.start(block=True)
  try:
    job = service.submit(api.VideoCreate(prompt="a fox", size="32x32", num_frames=5, num_inference_steps=2,
                                         output_format="npy"))["id"]
    assert wait_finished(service, job)["status"] == "completed"
  finally:
    service.stop()
  lines = [r.getMessage() for r in caplog.records if r.name == events.LOGGER]
  assert lines[0] == "loading model tiny (float32) ..." and lines[1].startswith("model loaded in "), lines
  assert any(line.startswith("ready at http://127.0.0.1:8123/ (model tiny, mesh one device): POST /v1/videos, "
                             "schema at /docs") for line in lines), lines
  assert f"job {job} started: 32x32 x 5 frames, 2 steps" in lines, lines
  assert any(line.startswith(f"job {job} completed: 32x32 x 5 frames, 2 steps, ") for line in lines), lines


def test_a_failed_load_is_said(tmp_path, caplog):
  config = ServeConfig(model="tiny", data_dir=str(tmp_path))

  def broken():
    raise OSError("no weights here")

  service = Service(config, model_facts(config), load=broken)
  caplog.set_level(logging.INFO, logger=events.LOGGER)
  service.start(block=True)
  service.stop()
  assert any("the model failed to load (OSError: no weights here)" in r.getMessage() for r in caplog.records)


def test_log_level_reaches_uvicorn(monkeypatch, tmp_path):
  """--log-level warning: uvicorn at warning without its access log; the default info keeps both."""
  import uvicorn

  from pipelines.serve import main

  seen = {}
  monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
  monkeypatch.setattr(Service, "start", lambda self, block=False: None)
  assert parse([]).log_level == "info"
  for level, access in (("warning", False), ("info", True)):
    assert main.main(["--model", "tiny-random", "--data-dir", str(tmp_path / level), "--log-level", level]) == 0
    assert seen["log_level"] == level and seen["access_log"] is access, seen
  with pytest.raises(SystemExit):
    parse(["--log-level", "loud"])
