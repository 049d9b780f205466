"""Tests for pipelines/cli/records.py: the run record `generate` keeps beside a checkpoint and the
sidecar, both from the request.
"""

from __future__ import annotations

import json

import numpy as np

from pipelines.cli import generate
from tests.pipelines.cli.test_generate import TINY_ARGV


def _checked(tmp_path, *flags):
  args = generate.build_parser().parse_args(TINY_ARGV + list(flags) + ["--out", str(tmp_path / "a.mp4")])
  return generate.check_plan(generate.plan_run(args))


def test_run_record_and_sidecar_come_from_the_request(tmp_path):
  """The run record (--resume) and the sidecar's request fields are the request's values: a changed
  request field shows in both."""
  import dataclasses
  import types

  from pipelines.cli import output, records

  checked = _checked(tmp_path, "--steps", "2")
  facts = records.RunFacts.of(checked.plan)
  record = records.request_record(checked.request, facts)
  assert (record["steps"], record["seed"], record["size"], record["frames"]) == (2, 0, "32x32", 5)
  assert record["model"] == "tiny-random" and record["guidance"] == [5.0] and record["shift"] == 3.0
  assert set(record) == set(records._RECORDED + records._RECORDED_FREE)
  changed = dataclasses.replace(checked, request=dataclasses.replace(checked.request, steps=7, seed=11,
                                                                     prompts=["a blue circle"]))
  record = records.request_record(changed.request, facts)
  assert (record["steps"], record["seed"], record["prompt"]) == (7, 11, "a blue circle")
  result = types.SimpleNamespace(frames=np.zeros((1, 5, 32, 32, 3), np.float32), settings={"seed": 11})
  cache = types.SimpleNamespace(report=lambda: {})
  sidecar = output.sidecar(changed, result, out=str(tmp_path / "a.mp4"), sheet=None, lora=[], times={},
                           cache=cache, warnings_seen=[])
  assert (sidecar["seed"], sidecar["prompt"], sidecar["model"]) == (11, "a blue circle", "tiny-random")  # records name the model used
  records.write_run_record(changed.request, facts, str(tmp_path / "ckpt"))
  saved = json.loads((tmp_path / "ckpt" / generate.RUN_RECORD).read_text())
  assert saved["steps"] == 7 and saved == record
  # The sidecar's settings (what the pipeline records) and the resume identity come from it too.
  assert changed.request.settings()["steps"] == 7 and changed.request.settings()["prompts"] == ["a blue circle"]
  identity = changed.request.identity("f" * 64, changed.request.noise())
  before = checked.request.identity("f" * 64, checked.request.noise())
  assert identity["num_inference_steps"] == 7 and identity["prompts"] == ["a blue circle"]
  assert identity["noise_sha256"] != before["noise_sha256"]  # seed 11's noise, not seed 0's
