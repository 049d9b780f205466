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


def test_run_record_holds_the_flags_and_the_sidecar_the_request(tmp_path):
  """The run record (--resume) holds every flag that decides the video by its dest, with the drawn
  seed; the tags' and sidecar's parameters are the request's values: a changed request field shows
  there."""
  import types

  from pipelines.cli import output
  from pipelines.commands.presets import PRESETS

  checked = _checked(tmp_path, "--steps", "2")
  record = records.request_record(checked.plan, checked.request)
  assert (record["num_inference_steps"], record["seed"], record["size"], record["num_frames"]) == (2, 0, "32x32", 5)
  assert record["model"] == "tiny-random" and record["guidance_scale"] is None and record["flow_shift"] is None
  assert set(record) == {a.dest for a in records._recorded_actions()} | {"out", "fps", "model_commit", "format"}
  assert record["model_commit"] is None  # not a Hub model
  parameters = records.run_parameters(checked.plan, checked.request)
  assert parameters["guidance_scale"] == list(PRESETS["tiny"].guidance) == [2.0] and parameters["flow_shift"] == 3.0
  changed = dataclasses.replace(checked, request=dataclasses.replace(checked.request, steps=7, seed=11,
                                                                     prompts=["a blue circle"]))
  parameters = records.run_parameters(changed.plan, changed.request)
  assert (parameters["num_inference_steps"], parameters["seed"], parameters["prompt"]) == (7, 11, "a blue circle")
  result = types.SimpleNamespace(frames=np.zeros((1, 5, 32, 32, 3), np.float32), settings={"seed": 11})
  cache = types.SimpleNamespace(report=lambda: {})
  sidecar = output.sidecar(changed, result, out=str(tmp_path / "a.mp4"), sheet=None, lora=[], times={},
                           cache=cache, warnings_seen=[])
  assert (sidecar["seed"], sidecar["prompt"], sidecar["model"]) == (11, "a blue circle", "tiny-random")  # records name the model used
  records.write_run_record(changed.plan, changed.request, None, str(tmp_path / "ckpt"))
  saved = json.loads((tmp_path / "ckpt" / records.RUN_RECORD).read_text())
  assert saved == records.request_record(changed.plan, changed.request) and saved["seed"] == 11
  # The sidecar's settings (what the pipeline records) and the resume identity come from the request.
  assert changed.request.settings()["steps"] == 7 and changed.request.settings()["prompts"] == ["a blue circle"]
  identity = changed.request.identity("f" * 64, changed.request.noise())
  before = checked.request.identity("f" * 64, checked.request.noise())
  assert identity["num_inference_steps"] == 7 and identity["prompts"] == ["a blue circle"]
  assert identity["noise_sha256"] != before["noise_sha256"]  # seed 11's noise, not seed 0's


def _media(tmp_path):
  """An image, a 9-frame video and a mask as files (small, so that every model here takes them)."""
  import PIL.Image

  from pipelines.storage import video_io

  pixels = np.zeros((32, 32, 3), np.uint8)
  pixels[8:24, 4:20] = (200, 40, 30)
  PIL.Image.fromarray(pixels).save(tmp_path / "image.png")
  PIL.Image.fromarray(255 - pixels).save(tmp_path / "last.png")
  PIL.Image.fromarray(np.where(pixels > 0, 255, 0).astype(np.uint8)).save(tmp_path / "mask.png")
  y, x = np.mgrid[0:32, 0:32] / 32.0
  frames = np.stack([np.stack([x, y, np.full_like(x, t / 9)], -1) for t in range(9)]).astype(np.float32)
  video_io.write_video(frames, str(tmp_path / "clip.npy"), fps=16)


# One run per model kind, each giving some request flags a value other than its default; together
# they give every request flag (`test_every_request_flag_is_recorded_and_read_back` checks that).
def _resume_cases(tmp_path, vace_folder, flf2v_folder):
  d = str(tmp_path)
  return {
      "t2v": ["--model", "tiny-random", "--prompt", "a red fox", "--negative-prompt", "blurry", "--size", "48x32",
              "--frames", "9", "--steps", "3", "--guidance", "3.5", "--shift", "4", "--scheduler", "euler",
              "--seed", "5", "--max-sequence-length", "16", "--step-cache", "first-block:0.05",
              "--attention-exchange", "fp8", "--dtype", "float32"],
      "timesteps": ["--model", "tiny-random", "--prompt", "x", "--size", "32x32", "--timesteps", "1000,500",
                    "--vae-dtype", "bfloat16"],
      "sigmas": ["--model", "tiny-random", "--prompt", "x", "--size", "32x32", "--sigmas", "1,0.5",
                 "--scheduler", "dpm++"],
      "v2v": ["--model", "tiny-random", "--prompt", "x", "--size", "32x32", "--video", f"{d}/clip.npy",
              "--strength", "0.6"],
      "windows": ["--model", "tiny-random", "--prompt", "x", "--size", "32x32", "--frames", "17",
                  "--context-frames", "9", "--context-overlap", "4", "--context-fuse", "flat"],
      "ti2v": ["--model", "tiny-i2v", "--prompt", "x", "--size", "32x32", "--image", f"{d}/image.png"],
      "flf2v": ["--model", flf2v_folder, "--prompt", "x", "--size", "80x48", "--frames", "9", "--image",
                f"{d}/image.png", "--last-image", f"{d}/last.png", "--dtype", "float32"],
      "vace": ["--model", vace_folder, "--prompt", "x", "--size", "32x32", "--video", f"{d}/clip.npy", "--mask",
               f"{d}/mask.png", "--reference-image", f"{d}/image.png", "--conditioning-scale", "0.5",
               "--dtype", "float32"],
  }


def _identity(checked) -> dict:
  return checked.request.identity("f" * 64, checked.request.noise())


def test_every_request_flag_is_recorded_and_read_back(tmp_path):
  """For every request flag (each flag of a --help group that decides the video): a run with
  --checkpoint-dir D writes the record, and `--resume D` alone rebuilds a request with the same
  identity (no compute). Positive control: a record whose values are changed rebuilds another request,
  so the identities are read from the record, not from defaults that happen to agree."""
  import warnings

  from tests.pipelines.pipeline.test_image_pipeline import _save as save_image_folder
  from tests.pipelines.pipeline.vace_folder import build_vace_folder

  _media(tmp_path)
  save_image_folder("flf2v", str(tmp_path / "flf2v"))
  cases = _resume_cases(tmp_path, build_vace_folder(str(tmp_path / "vace")), str(tmp_path / "flf2v"))
  given = {a.dest for flags in cases.values() for a in generate.build_parser()._actions
           if any(f in flags for f in a.option_strings)}
  recorded = {a.dest for a in records._recorded_actions()}
  not_given = {"preset", "quantize", "lora", "lora_2", "transformer", "vae", "text_encoder", "tokenizer", "config"}
  assert recorded - not_given <= given, recorded - not_given - given  # a request flag no case gives
  for name, flags in cases.items():
    folder = tmp_path / f"ckpt-{name}"
    argv = flags + ["--checkpoint-dir", str(folder), "--out", str(tmp_path / f"{name}.mp4")]
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      first = run_plan.check_plan(run_plan.plan_run(generate.build_parser().parse_args(argv)))
      records.write_run_record(first.plan, first.request, None, str(folder))
      (folder / resume.STATE_FILE).write_bytes(b"")  # a saved state (its contents are the loop's)
      again = generate.build_parser().parse_args(["--resume", str(folder)])
      records.apply_resume(again, records.given_flags(["--resume", str(folder)]))
      resumed = run_plan.check_plan(run_plan.plan_run(again))
    assert _identity(resumed) == _identity(first), name
    assert resumed.request.plan.attention_exchange == first.request.plan.attention_exchange, name
    assert resumed.plan.vae_dtype == first.plan.vae_dtype, name
  path = tmp_path / "ckpt-t2v" / records.RUN_RECORD
  path.write_text(json.dumps(json.loads(path.read_text()) | {"prompt": "a blue bird", "num_inference_steps": 4}))
  changed = generate.build_parser().parse_args(["--resume", str(path.parent)])
  records.apply_resume(changed, {"resume"})
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    identity = _identity(run_plan.check_plan(run_plan.plan_run(changed)))
  assert identity["prompts"] == ["a blue bird"] and identity["num_inference_steps"] == 4, identity
  # A flag the saved run left to its default may be given (the checkpoint's identity decides); one it
  # gave must match.
  argv = ["--resume", str(tmp_path / "ckpt-timesteps"), "--steps", "2"]
  given = generate.build_parser().parse_args(argv)
  records.apply_resume(given, records.given_flags(argv))
  assert given.num_inference_steps == 2 and given.timesteps == "1000.0,500.0"
  argv = ["--resume", str(tmp_path / "ckpt-timesteps"), "--timesteps", "1000,250"]
  with pytest.raises(records.UsageError, match="--timesteps: saved '1000.0,500.0', given '1000.0,250.0'"):
    records.apply_resume(generate.build_parser().parse_args(argv), records.given_flags(argv))
  # A record of the earlier format (flags by name, no "format") is refused, not half read.
  path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "format"}))
  with pytest.raises(records.UsageError, match="written by an earlier version of generate"):
    records.apply_resume(generate.build_parser().parse_args(["--resume", str(path.parent)]), {"resume"})


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
  record = {"format": records.RECORD_FORMAT, "model": None, "transformer": str(tmp_path / "t"), "vae": str(tmp_path / "v"),
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
