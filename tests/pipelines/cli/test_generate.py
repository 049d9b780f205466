"""Tests for pipelines/cli/generate.py: the command end to end, every check (the video files
themselves: tests/pipelines/storage/test_video_io.py).

The end-to-end run is a fresh subprocess without the harness's device count (harness.child_env), so
the command itself must simulate the mesh's CPU devices; the checks run in-process (this process
already has 8 fake CPU devices, see conftest.py) and must fail before any model is built.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import numpy as np
from PIL import Image
import pytest

from tests.harness import REPO_ROOT, child_env, step_compiles
from tests.pipelines.storage.video_files import _decode_mp4, _fake_ffmpeg
from pipelines.cli import generate
from pipelines.storage import video_io
from pipelines.cli.help import warnings_as_lines

ROOT = REPO_ROOT
PROMPT = "a red fox running through snow"


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # fork + exec of a child process is safe
def test_command_writes_a_decodable_video(tmp_path):
  """The README command at a small size, twice with one compilation cache: the second run loads the
  compiled programs, draws its seed (--seed -1), and its warnings (frame rounding, a truncated
  prompt) come as `generate: warning:` lines and into the sidecar."""
  out = tmp_path / "fox.mp4"
  cache = str(tmp_path / "cache")
  cmd = [sys.executable, "-m", "pipelines.cli.generate", "--mesh", "U=2,R=2", "--steps", "2",
         "--compile-cache", cache]  # the default model's own size, 64x64 x 17: no warning of its own
  proc = subprocess.run(cmd + ["--prompt", PROMPT, "--frames", "17", "--seed", "5", "--out", str(out)],
                        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  assert "simulating 4 CPU devices" in proc.stderr
  for stage in ("text encode: 2 prompt(s) x 64 tokens", "compile: the denoise step", "denoise:",
                "decode: 1 video(s) of 17 frames 64x64"):
    assert stage in proc.stderr, proc.stderr
  assert "warning" not in proc.stderr and "this run is long" not in proc.stderr, proc.stderr
  assert f"wrote {out} and {out}.json (" in proc.stdout, proc.stdout
  assert "text encode" in proc.stdout and "compile" in proc.stdout and "/step x 2" in proc.stdout
  assert _decode_mp4(str(out)) == ((64, 64), 17)
  sidecar = json.loads((tmp_path / "fox.mp4.json").read_text())
  assert sidecar["prompt"] == PROMPT and sidecar["seed"] == 5 and sidecar["model"] == "tiny"
  assert sidecar["seed_drawn"] is False and sidecar["warnings"] == []
  assert sidecar["mesh"]["U"] == 2 and sidecar["mesh"]["R"] == 2
  assert sidecar["video"] == {"frames": 17, "height": 64, "width": 64, "fps": 16.0}
  assert {"text_encode", "compile", "denoise_per_step", "decode"} <= set(sidecar["timings_s"])
  assert {"jax", "flax", "python"} <= set(sidecar["versions"])
  first = sidecar["compile_cache"]
  assert first["dir"] == cache and first["hits"] == 0 and first["written"] >= 3, first
  for stage in ("text_encode", "compile", "decode"):  # each stage's own programs, compiled and stored
    assert first["stages"][stage]["hits"] == 0 and first["stages"][stage]["compiled_for_cache"] >= 1, first
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temp files left

  long_prompt = "a red fox running through snow, " * 20  # 639 bytes once stripped: 640 ByT5 tokens
  again = subprocess.run(cmd + ["--prompt", long_prompt, "--frames", "16", "--seed", "-1",
                                "--out", str(tmp_path / "again.mp4")],
                         cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
  assert again.returncode == 0, again.stderr
  assert "Warning" not in again.stderr and ".py:" not in again.stderr, again.stderr  # no raw warnings
  assert "generate: warning: num_frames=16: num_frames - 1 must be divisible by 4; rounding to 17" in again.stderr
  assert "generate: warning: prompt(s) [0] are longer than max_sequence_length=64 tokens" in again.stderr
  drawn = re.search(r"generate: random seed (\d+) \(pass --seed \1 to make this video again\)", again.stderr)
  assert drawn is not None, again.stderr
  sidecar = json.loads((tmp_path / "again.mp4.json").read_text())
  assert sidecar["seed"] == int(drawn.group(1)) and sidecar["seed_drawn"] is True
  assert f"seed {drawn.group(1)}," in again.stdout
  frames_warning, truncation = sidecar["warnings"]
  assert frames_warning.startswith("num_frames=16: ") and "rounding to 17" in frames_warning
  assert truncation.startswith("prompt(s) [0] are longer than max_sequence_length=64 tokens ([640] tokens) "
                               "and were truncated")
  warm = sidecar["compile_cache"]
  assert warm["hit"] and warm["hits"] >= 3, warm
  for stage in ("text_encode", "compile", "decode"):  # every stage loaded what the first run stored
    assert warm["stages"][stage]["hits"] >= 1, warm
  assert re.search(r"compile cache hit \(\d+ of \d+ programs loaded: .*compile \d+/\d+.*decode \d+/\d+", again.stdout), \
      again.stdout
  assert re.search(r"\(the VAE's first compile, [0-9.]+ m?s, ran beside the text encoder, step compile and loop\)",
                   proc.stdout), proc.stdout
  assert "first compile" not in again.stdout
  assert json.loads((tmp_path / "again.mp4.json").read_text())["timings_s"]["decode_compile_ahead"] > 0


def test_gif_and_frames_outputs(tmp_path, capsys):
  """In-process run (one device) to a .gif with its contact sheet; the frames-folder writer on the
  same frames.

  Sizes as in tests/pipelines/pipeline/test_wan_pipeline.py, so that in one session the compiled programs are reused.
  """
  out = tmp_path / "clip.gif"
  argv = ["--prompt", PROMPT, "--size", "80x48", "--frames", "9", "--steps", "2", "--seed", "1",
          "--max-sequence-length", "32", "--out", str(out), "--contact-sheet"]
  assert generate.main(argv) == 0
  import imageio.v3 as iio
  gif = iio.imread(out, index=None)
  assert gif.shape[:3] == (9, 48, 80)
  assert "wrote" in capsys.readouterr().out
  sheet = iio.imread(tmp_path / "clip.gif.contact.png")  # 9 frames: one row of 9 tiles, 2x enlarged
  assert sheet.shape[2] == 3 and sheet.shape[1] == 9 * (160 + 2) + 2 and sheet.shape[0] > 96
  sidecar = json.loads((tmp_path / "clip.gif.json").read_text())
  assert sidecar["contact_sheet"] == str(tmp_path / "clip.gif.contact.png")
  # No --fps: Wan's 16 fps as the nearest rate a GIF stores exactly (6 cs), without a warning (the
  # one warning: 80x48 x 9 is not the default model's trained size).
  assert sidecar["video"]["fps"] == pytest.approx(100 / 6), sidecar
  assert [w[:41] for w in sidecar["warnings"]] == ["the 'tiny' model was trained at 64x64 x 1"], sidecar
  with Image.open(out) as stored:
    assert stored.info["duration"] == 60
  # Same output again: refused without --overwrite, replaced with it.
  assert generate.main(argv) == 2
  assert "exists; pass --overwrite" in capsys.readouterr().err
  assert generate.main(argv + ["--overwrite"]) == 0

  (tmp_path / "clip.gif").unlink()  # the contact sheet alone still blocks a run without --overwrite
  (tmp_path / "clip.gif.json").unlink()
  assert generate.main(argv) == 2
  assert "clip.gif.contact.png' exists; pass --overwrite" in capsys.readouterr().err

  frames = np.linspace(0, 1, 3 * 16 * 16 * 3, dtype=np.float32).reshape(3, 16, 16, 3)
  folder = str(tmp_path / "frames") + os.sep
  assert video_io.output_kind(folder) == "frames"
  video_io.write_video(frames, folder)
  names = sorted(os.listdir(tmp_path / "frames"))
  assert names == ["frame_00000.png", "frame_00001.png", "frame_00002.png"]
  np.testing.assert_array_equal(iio.imread(tmp_path / "frames" / names[2]), video_io.to_uint8(frames)[2])
  with pytest.raises(video_io.OutputError, match="overwrite"):
    video_io.write_video(frames, folder)
  video_io.write_video(frames[:1], folder, overwrite=True)
  assert os.listdir(tmp_path / "frames") == ["frame_00000.png"]


BASE = ["--prompt", PROMPT, "--size", "32x32", "--frames", "5", "--steps", "1"]


@pytest.mark.parametrize("extra,message", [
    (["--preset", "wan3"], "unknown --preset 'wan3'; use one of wan2.1-t2v-1.3b"),
    (["--size", "40x32"], "width=40 must be a positive multiple of 16"),
    (["--size", "32x50"], "height=50 must be a positive multiple of 16"),
    (["--size", "big"], "--size 'big' is malformed; write WIDTHxHEIGHT"),
    (["--mesh", "U=4,R=4"], "needs 16 devices but 8 are visible"),
    (["--mesh", "U=2,R=2", "--devices", "8"], "--devices 8 does not match --mesh U=2,R=2"),
    (["--mesh", "U=3,R=2"], "8 heads, not divisible by the Ulysses degree U=3; with 6 devices use one of: "
                            "U=1,R=6, U=2,R=3"),
    (["--mesh", "U2"], "--mesh: mesh spec='U2' is malformed"),
    (["--devices", "4", "--mesh", "U=2,R=2"], "XLA_FLAGS already sets"),
    (["--guidance", "4.0,3.0"], "--guidance: guidance_scale_2=3.0 is only used by two-expert (Wan 2.2) "
                                "pipelines; this one has one transformer"),
    (["--guidance", "a,b,c"], "must be one number"),
    (["--steps", "0"], "--steps: num_inference_steps=0 must be a positive int; e.g. 50"),
    (["--shift", "-1"], "--shift: flow_shift=-1.0 must be a finite number > 0 (Wan: 3.0 at 480p"),
    (["--model", "/no/such/folder"], "is not a folder"),
    (["--out", "/no/such/dir/fox.mp4"], "does not exist ('/no/such/dir'); create it first"),
    (["--out", "fox.avi"], "suffix '.avi'; use .mp4"),
    # Every numeric flag: finite and in range, before compute.
    (["--fps", "nan"], "--fps: fps=nan must be a finite number of frames per second in [0.001, 1000]"),
    (["--fps", "-16"], "--fps: fps=-16.0 must be a finite number"),
    (["--fps", "0"], "--fps: fps=0.0 must be a finite number"),
    (["--fps", "1e-9"], "--fps: fps=1e-09 must be a finite number"),  # ffmpeg wrote an empty mp4
    (["--fps", "1e9"], "--fps: fps=1000000000.0 must be a finite number"),
    (["--shift", "inf"], "--shift: flow_shift=inf must be a finite number > 0"),
    (["--shift", "nan"], "--shift: flow_shift=nan must be a finite number > 0"),
    (["--guidance", "4,inf"], "--guidance: guidance_scale_2=inf must be a finite number (Wan: 5.0; <= 1 turns CFG off)"),
    (["--frames", "-5"], "--frames: num_frames=-5 must be a positive int (Wan uses 4k+1"),
    (["--size", "0x32"], "width=0 must be a positive multiple of 16"),
    (["--seed", "-2"], "--seed: seed=-2 must be a non-negative int (video i uses seed + i); or None"),
    (["--max-sequence-length", "0"], "--max-sequence-length: max_sequence_length=0 must be a positive int"),
    (["--devices", "0"], "--devices 0 must be >= 1"),
    (["--coordinator-timeout", "0"], "--coordinator-timeout 0 must be >= 1 (seconds)"),
])
def test_checks_before_compute(tmp_path, capsys, monkeypatch, extra, message):
  compiles = step_compiles(monkeypatch)
  argv = BASE + ["--out", str(tmp_path / "x.mp4")] + extra
  assert generate.main(argv) == 2
  err = capsys.readouterr().err
  assert message in err, err
  assert compiles == []
  assert not os.path.exists(tmp_path / "x.mp4")


def test_unwritable_output(tmp_path, capsys):
  a_file = tmp_path / "file"
  a_file.write_text("")
  assert generate.main(BASE + ["--out", str(a_file / "fox.mp4")]) == 2
  assert "is a file, not a directory" in capsys.readouterr().err
  if os.geteuid() != 0:  # root may write anywhere
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert generate.main(BASE + ["--out", str(locked / "fox.mp4")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_existing_output_needs_overwrite(tmp_path, capsys):
  (tmp_path / "fox.mp4").write_bytes(b"old")
  assert generate.main(BASE + ["--out", str(tmp_path / "fox.mp4")]) == 2
  assert "exists; pass --overwrite" in capsys.readouterr().err
  assert (tmp_path / "fox.mp4").read_bytes() == b"old"
  (tmp_path / "other.gif.json").write_text("{}")  # the sidecar counts too
  assert generate.main(BASE + ["--out", str(tmp_path / "other.gif")]) == 2
  assert "other.gif.json' exists" in capsys.readouterr().err


@pytest.mark.parametrize("given,rounded", [(10, 9), (16, 17), (19, 17)])
def test_frames_round_as_diffusers_with_a_warning(tmp_path, capsys, given, rounded):
  """num_frames // 4 * 4 + 1 as diffusers: not always down (16 -> 17); the command's warning line."""
  args = generate.build_parser().parse_args(BASE[:-4] + ["--frames", str(given), "--out", str(tmp_path / "a.mp4")])
  with warnings_as_lines("generate"):  # the request rounds (after JAX starts, before any weights)
    request = generate.check_plan(generate.plan_run(args)).request
  assert request.num_frames == rounded
  assert (f"generate: warning: num_frames={given}: num_frames - 1 must be divisible by 4; rounding to "
          f"{rounded} as diffusers does") in capsys.readouterr().err


def test_presets_are_the_published_defaults(tmp_path):
  p = generate.PRESETS
  assert (p["wan2.1-t2v-1.3b"].width, p["wan2.1-t2v-1.3b"].height, p["wan2.1-t2v-1.3b"].frames) == (832, 480, 81)
  assert (p["wan2.1-t2v-1.3b"].steps, p["wan2.1-t2v-1.3b"].shift, p["wan2.1-t2v-1.3b"].guidance) == (50, 3.0, (5.0,))
  assert (p["wan2.1-t2v-14b"].width, p["wan2.1-t2v-14b"].height, p["wan2.1-t2v-14b"].shift) == (1280, 720, 5.0)
  a14b = p["wan2.2-t2v-a14b"]
  assert (a14b.width, a14b.height, a14b.frames, a14b.steps, a14b.shift, a14b.guidance) == (
      1280, 720, 81, 40, 12.0, (4.0, 3.0))
  args = generate.build_parser().parse_args(["--prompt", "x", "--preset", "wan2.1-t2v-14b",
                                             "--size", "480x272", "--steps", "3",
                                             "--out", str(tmp_path / "a.mp4")])
  plan = generate.plan_run(args)  # flags override the preset, the rest comes from it
  assert (plan.width, plan.height, plan.steps, plan.frames, plan.shift) == (480, 272, 3, 81, 5.0)


def test_vae_parallel_flag(tmp_path):
  """The decode is split over the mesh by default; --no-vae-parallel keeps it on one device."""
  parse = generate.build_parser().parse_args
  out = ["--out", str(tmp_path / "a.mp4")]
  assert generate.plan_run(parse(BASE[:-4] + out)).vae_parallel is True
  assert generate.plan_run(parse(BASE[:-4] + ["--no-vae-parallel"] + out)).vae_parallel is False


@pytest.mark.parametrize("text,expected", [("832x480", (832, 480)), ("1280*720", (1280, 720))])
def test_parse_size(text, expected):
  assert generate.parse_size(text) == expected


# --- the command's numeric checks and its encoder errors -------------------------------------

@pytest.mark.parametrize("fps", ["inf", "1e-9"])
def test_command_refuses_bad_fps_before_compute(tmp_path, fps):
  """`--fps inf` used to run the whole generation and end in a traceback (exit 1); `--fps 1e-9` in
  an empty .mp4 and exit 0. Both are usage errors now, found before any model is built."""
  out = tmp_path / "fox.mp4"
  cmd = [sys.executable, "-m", "pipelines.cli.generate", "--prompt", PROMPT, "--fps", fps, "--out", str(out)]
  proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr
  expected = f"generate: error: --fps: fps={float(fps)!r} must be a finite number of frames per second"
  assert expected in proc.stderr
  assert "generate: model" not in proc.stderr  # printed once the model is built, before denoising
  assert os.listdir(tmp_path) == []


def test_command_reports_encoder_failure(tmp_path):
  """The whole command: an encoder failure is exit 1 with ffmpeg's reason, no video, no sidecar."""
  videos = tmp_path / "videos"
  videos.mkdir()
  cmd = [sys.executable, "-m", "pipelines.cli.generate", "--prompt", PROMPT, "--size", "32x32", "--frames", "5",
         "--steps", "1", "--max-sequence-length", "8", "--seed", "0", "--out", str(videos / "fox.mp4")]
  env = child_env(IMAGEIO_FFMPEG_EXE=_fake_ffmpeg(tmp_path, "fail"))
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stderr
  assert "generate: error: writing" in proc.stderr and "fake encoder: refusing this input" in proc.stderr
  assert "wrote" not in proc.stdout and "Traceback" not in proc.stderr
  assert os.listdir(videos) == []


def test_gif_fps_warning_before_compute(tmp_path, capsys):
  args = generate.build_parser().parse_args(BASE + ["--fps", "60", "--out", str(tmp_path / "a.gif")])
  with warnings_as_lines("generate"):  # as main shows warnings
    generate.plan_run(args)
  assert ("generate: warning: GIF frame delays are whole centiseconds: 60 fps (a 16.67 ms delay) is stored "
          "as 2 cs = 50 fps" in capsys.readouterr().err)


# --- one check per value: the command and the Python call refuse alike ------------------------------

TINY_ARGV = ["--prompt", PROMPT, "--model", "tiny-random", "--size", "32x32", "--frames", "5", "--steps", "1",
             "--seed", "0"]


@pytest.mark.parametrize("flags,flag,kwargs", [
    (["--size", "40x32"], "--size", {"width": 40, "height": 32}),
    (["--mesh", "CFG=2,U=2", "--guidance", "1.0"], "--mesh", {"mesh": "CFG=2,U=2", "guidance_scale": 1.0}),
    (["--mesh", "U=1,R=1", "--shard-weights"], "--shard-weights", {"mesh": "U=1,R=1", "shard_weights": True}),
    (["--steps", "0"], "--steps", {"num_inference_steps": 0}),
], ids=["size not a multiple of 16", "CFG=2 without guidance", "sharded weights on one device", "steps 0"])
def test_command_and_python_call_refuse_alike(tmp_path, capsys, flags, flag, kwargs):
  """The same bad value: `GenerationRequest.build` (the Python call's constructor) raises a
  ValueError, and the command prints that very message after the flag, exit status 2."""
  from pipelines.pipeline.request import GenerationRequest, ModelFacts

  call = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 1, "seed": 0, **kwargs}
  with pytest.raises(ValueError) as refused:
    GenerationRequest.build(ModelFacts.tiny_random("float32"), PROMPT, **call)
  assert generate.main(TINY_ARGV + flags + ["--out", str(tmp_path / "x.mp4")]) == 2
  err = capsys.readouterr().err
  assert f"generate: error: {flag}: {refused.value}" in err, err
  assert os.listdir(tmp_path) == []


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


def test_the_trained_default_warns_outside_its_one_video_size(tmp_path):
  """The trained tiny default knows 64x64 x 17 frames only: another size warns before any compute
  (the Python call and the command build the same request); its own size, and the random tiny
  model at any size, do not (the control)."""
  from pipelines.pipeline.request import GenerationRequest, ModelFacts

  trained = ModelFacts.tiny_default("float32")
  call = {"num_inference_steps": 1, "seed": 0}
  with pytest.warns(UserWarning, match=r"trained at 64x64 x 17 frames only; 128x128 x 9 frames"):
    GenerationRequest.build(trained, PROMPT, height=128, width=128, num_frames=9, **call)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    GenerationRequest.build(trained, PROMPT, height=64, width=64, num_frames=17, **call)
    GenerationRequest.build(ModelFacts.tiny_random("float32"), PROMPT, height=128, width=128, num_frames=9, **call)
  argv = ["--prompt", PROMPT, "--size", "128x128", "--frames", "9", "--steps", "1", "--out", str(tmp_path / "a.mp4")]
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    generate.check_plan(generate.plan_run(generate.build_parser().parse_args(argv)))
  assert any("trained at 64x64 x 17 frames only" in str(w.message) for w in seen)
