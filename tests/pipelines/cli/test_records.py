"""Tests for pipelines/cli/records.py: the run record `generate` keeps beside a checkpoint and the
sidecar, both from the request; `--checkpoint-dir`, an interrupted run and `generate --resume`
(flags read back from the record, a differing one refused, the checkpoint folder's checks).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from pipelines.cli import generate, records, run_plan
from pipelines.pipeline.run import resume
from pipelines.pipeline import wan_pipeline
from tests.numerics import assert_psnr_at_least
from tests.pipelines.cli.test_generate import TINY_ARGV
from tests.pipelines.pipeline.run.test_resume import PROMPT, RESUME_PSNR_DB


def _checked(tmp_path, *flags):
  args = generate.build_parser().parse_args(TINY_ARGV + list(flags) + ["--out", str(tmp_path / "a.mp4")])
  return run_plan.check_plan(run_plan.plan_run(args))


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
  from pipelines.commands.presets import PRESETS
  assert record["model"] == "tiny-random" and record["guidance"] == list(PRESETS["tiny"].guidance) == [2.0]
  assert record["shift"] == 3.0
  assert set(record) == set(records._RECORDED + records._RECORDED_FREE + records._RECORDED_FACTS)
  assert record["model_commit"] is None  # not a Hub model
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
  saved = json.loads((tmp_path / "ckpt" / records.RUN_RECORD).read_text())
  assert saved["steps"] == 7 and saved == record
  # The sidecar's settings (what the pipeline records) and the resume identity come from it too.
  assert changed.request.settings()["steps"] == 7 and changed.request.settings()["prompts"] == ["a blue circle"]
  identity = changed.request.identity("f" * 64, changed.request.noise())
  before = checked.request.identity("f" * 64, checked.request.noise())
  assert identity["num_inference_steps"] == 7 and identity["prompts"] == ["a blue circle"]
  assert identity["noise_sha256"] != before["noise_sha256"]  # seed 11's noise, not seed 0's


def test_command_resumes_an_interrupted_run(tmp_path, monkeypatch, capsys):
  """generate --checkpoint-dir, interrupted (Ctrl-C) after step 3 of 5: exit 130 and a hint; then
  `generate --resume DIR` with only a new mesh and output continues it to the same video;
  a given flag that differs from the saved run is refused naming it."""
  args = ["--prompt", PROMPT, "--size", "32x32", "--frames", "5", "--steps", "5", "--seed", "3",
          "--max-sequence-length", "8", "--step-cache", "first-block:0.05"]
  assert generate.main(args + ["--out", str(tmp_path / "ref.npy")]) == 0
  folder = str(tmp_path / "ckpt")
  original_generate = wan_pipeline.WanPipeline.generate

  def interrupted(self, request, options, **kw):
    def on_step(k, seconds):
      if k == 2:
        raise KeyboardInterrupt
    return original_generate(self, request, dataclasses.replace(options, on_step=on_step), **kw)
  monkeypatch.setattr(wan_pipeline.WanPipeline, "generate", interrupted)
  capsys.readouterr()
  assert generate.main(args + ["--out", str(tmp_path / "a.npy"), "--checkpoint-dir", folder]) == 130
  err = capsys.readouterr().err
  assert f"continue with generate --resume {folder}" in err, err
  assert not os.path.exists(tmp_path / "a.npy")
  assert json.load(open(os.path.join(folder, records.RUN_RECORD)))["seed"] == 3
  monkeypatch.setattr(wan_pipeline.WanPipeline, "generate", original_generate)

  assert generate.main(["--resume", folder, "--steps", "6"]) == 2
  err = capsys.readouterr().err
  assert "--steps: saved 5, given 6" in err, err
  assert generate.main(["--resume", folder, "--mesh", "U=2,R=2", "--out", str(tmp_path / "b.npy")]) == 0
  err = capsys.readouterr().err
  assert f"continuing the run saved in {folder}" in err, err
  resumed, reference = np.load(tmp_path / "b.npy"), np.load(tmp_path / "ref.npy")
  assert_psnr_at_least(resumed, reference, RESUME_PSNR_DB, name="generate --resume on U=2,R=2")
  sidecar = json.load(open(tmp_path / "b.npy.json"))
  assert sidecar["checkpoint"]["resumed_from_step"] == 3 and sidecar["prompt"] == PROMPT
  assert sidecar["settings"]["step_cache"]["spec"].startswith("first-block:0.05")  # read from the record
  assert not os.path.exists(folder)  # removed after the video was written
  # a checkpoint folder that cannot be one is refused before compute
  (tmp_path / "file").write_text("x")
  for bad in (str(tmp_path / "file"), str(tmp_path / "missing" / "ckpt")):
    assert generate.main(args + ["--out", str(tmp_path / "c.npy"), "--checkpoint-dir", bad]) == 2
    assert "--checkpoint-dir" in capsys.readouterr().err
  # a new run into a folder holding a saved run is refused before compute
  os.makedirs(folder)
  open(os.path.join(folder, resume.STATE_FILE), "wb").close()
  assert generate.main(args + ["--out", str(tmp_path / "c.npy"), "--checkpoint-dir", folder]) == 2
  assert f"continue it with --resume {folder}" in capsys.readouterr().err


def test_resume_refuses_changed_single_files(tmp_path, capsys):
  """A run of single files records each file's SHA-256 (`model_files.describe`); --resume reads the
  files' flags back from the record and refuses a file whose bytes changed since, naming it."""
  from pipelines.commands import model_files
  from pipelines.wan.pretrained import Sources

  for name in ("t", "v", "te"):
    (tmp_path / name).write_bytes(name.encode() * 10)
  files = Sources(transformer=str(tmp_path / "t"), vae=str(tmp_path / "v"), text_encoder=str(tmp_path / "te"),
                  tokenizer=str(tmp_path))
  folder = tmp_path / "ckpt"
  folder.mkdir()
  (folder / resume.STATE_FILE).write_bytes(b"")
  record = {"model": None, "transformer": str(tmp_path / "t"), "vae": str(tmp_path / "v"),
            "text_encoder": str(tmp_path / "te"), "tokenizer": str(tmp_path), "config": None,
            "model_files": model_files.describe(files, dict.fromkeys(("transformer", "vae", "text_encoder"), "wan"))}
  (folder / records.RUN_RECORD).write_text(json.dumps(record))
  args = generate.build_parser().parse_args(["--resume", str(folder)])
  records.apply_resume(args, {"resume"})
  assert (args.model, args.vae, args.tokenizer) == (None, str(tmp_path / "v"), str(tmp_path))
  (tmp_path / "v").write_bytes(b"w" * 10)
  with pytest.raises(records.UsageError) as refused:
    records.apply_resume(generate.build_parser().parse_args(["--resume", str(folder)]), {"resume"})
  message = str(refused.value)
  assert message.startswith(f"--resume {folder}: the saved run's model files are not the ones it ran on: --vae "
                            f"{str(tmp_path / 'v')!r} changed (SHA-256 "), message
  assert message.endswith(f"A changed file is another model: restore it, or remove {folder} and start a new run")
