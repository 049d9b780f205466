"""Tests for pipelines/cli/generate.py: the command as a whole: end to end in a subprocess, its
checks before compute (exit status 2, nothing written), the command and the Python call refusing alike.

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

import pytest


from pipelines.storage import video_tags

from tests.harness import REPO_ROOT, child_env, step_compiles
from tests.pipelines.storage.video_files import _decode_mp4, _fake_ffmpeg
from pipelines.cli import generate

ROOT = REPO_ROOT
PROMPT = "a red square moving right"


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
  tags = video_tags.read_metadata(str(out))  # the mp4 carries the prompt and parameters (ffmpeg shows them)
  parameters = json.loads(tags["comment"])
  assert tags["title"] == PROMPT and parameters["seed"] == 5 and parameters["num_inference_steps"] == 2, tags
  assert parameters["mesh"].startswith("U=2,R=2") and parameters["prompt"] == PROMPT and "out" not in parameters
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
  assert ("generate: warning: --frames 16 is not 4k + 1 (the VAE's frame groups); rounding to 17 as diffusers does "
          "(pass --frames 17 to silence this)") in again.stderr
  assert "generate: warning: prompt(s) [0] are longer than --max-sequence-length 64 tokens" in again.stderr
  drawn = re.search(r"generate: random seed (\d+) \(pass --seed \1 to make this video again\)", again.stderr)
  assert drawn is not None, again.stderr
  sidecar = json.loads((tmp_path / "again.mp4.json").read_text())
  assert sidecar["seed"] == int(drawn.group(1)) and sidecar["seed_drawn"] is True
  assert f"seed {drawn.group(1)}," in again.stdout
  frames_warning, world, truncation = sidecar["warnings"]  # a prompt this long is outside the tiny model's world
  assert "generate: warning: prompt(s) ['a red fox running through snow" in again.stderr
  assert "outside what the 'tiny' model was trained on" in world
  assert frames_warning.startswith("--frames 16 is not 4k + 1") and "rounding to 17" in frames_warning
  assert truncation.startswith("prompt(s) [0] are longer than --max-sequence-length 64 tokens ([640] tokens) "
                               "and were truncated")
  warm = sidecar["compile_cache"]
  assert warm["hit"] and warm["hits"] >= 3, warm
  for stage in ("text_encode", "compile", "decode"):  # every stage loaded what the first run stored
    assert warm["stages"][stage]["hits"] >= 1, warm
  assert re.search(r"compile cache hit \(\d+ of \d+ programs loaded: .*compile \d+/\d+.*decode \d+/\d+", again.stdout), \
      again.stdout
  # On the CPU the decoder compiles at the decode (`CallOptions.decode_compile_ahead`: ahead on accelerators).
  assert "(decode includes the VAE's first compile)" in proc.stdout, proc.stdout
  assert "first compile" not in again.stdout  # the warm run loads it
  assert json.loads((tmp_path / "again.mp4.json").read_text())["timings_s"]["decode_compile_ahead"] == 0


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
                                "pipelines; this one has one transformer: give one guidance scale\n"),
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
    (["--guidance", "4,inf"], "--guidance: guidance_scale_2=inf must be a finite number in [0, 100] (Wan: 5.0; "
                              "<= 1 turns CFG off)"),
    (["--frames", "-5"], "--frames: num_frames=-5 must be a positive int (Wan uses 4k+1"),
    (["--size", "0x32"], "width=0 must be a positive multiple of 16"),
    (["--seed", "-2"], "--seed: seed=-2 must be a non-negative int (video i uses seed + i); or leave it out for "
                       "a random one\n"),
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


def test_an_image_on_the_default_model_names_the_tiny_image_model(tmp_path, capsys, monkeypatch):
  """--image on the default (text-to-video) model: refused before compute, naming the shipped
  image-to-video model beside the Wan folders; --model tiny-i2v takes the same image (the control)."""
  import PIL.Image

  PIL.Image.new("RGB", (32, 32)).save(tmp_path / "first.png")
  image = ["--image", str(tmp_path / "first.png"), "--out", str(tmp_path / "a.mp4")]
  assert generate.main(BASE + image) == 2
  err = capsys.readouterr().err
  assert "image given, but this is a text-to-video model" in err and "(generate --model tiny-i2v)" in err, err
  monkeypatch.setattr(generate, "run", lambda checked, seen: {})  # checked, not run
  assert generate.main(BASE + image + ["--model", "tiny-i2v"]) == 0, capsys.readouterr().err


def test_warnings_name_the_flags(tmp_path, capsys, monkeypatch):
  """The request's warnings print in the command's words: 32 frames rounded, and 64x64 x 33 not
  the tiny model's trained clip, advise --frames and --context-frames (the Python call's messages
  name num_frames=33 and context_frames=17, tests/pipelines/pipeline/checked)."""
  monkeypatch.setattr(generate, "run", lambda checked, seen: {})  # checked, not run
  assert generate.main(BASE[:-4] + ["--size", "64x64", "--frames", "32", "--out", str(tmp_path / "a.mp4")]) == 0
  err = capsys.readouterr().err
  assert ("generate: warning: --frames 32 is not 4k + 1 (the VAE's frame groups); rounding to 33 as diffusers "
          "does (pass --frames 33 to silence this)") in err, err
  assert "use 64x64 x 17 frames (a longer video in context windows of that length: --context-frames 17)" in err, err
  assert "num_frames" not in err and "context_frames" not in err, err


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
  err = capsys.readouterr().err  # the command's flags, not the Python argument (overwrite=True)
  assert "generate: error: --out: '" in err and "fox.mp4' exists; pass --overwrite to replace it" in err, err
  assert "overwrite=True" not in err, err
  assert (tmp_path / "fox.mp4").read_bytes() == b"old"
  (tmp_path / "other.gif.json").write_text("{}")  # the sidecar counts too
  assert generate.main(BASE + ["--out", str(tmp_path / "other.gif")]) == 2
  assert "other.gif.json' exists" in capsys.readouterr().err


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
  from pipelines.pipeline.checked.model_facts import ModelFacts
  from pipelines.pipeline.checked.request import GenerationRequest

  call = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 1, "seed": 0, **kwargs}
  with pytest.raises(ValueError) as refused:
    GenerationRequest.build(ModelFacts.tiny_random("float32"), PROMPT, **call)
  assert generate.main(TINY_ARGV + flags + ["--out", str(tmp_path / "x.mp4")]) == 2
  err = capsys.readouterr().err
  assert f"generate: error: {flag}: {refused.value}" in err, err
  assert os.listdir(tmp_path) == []


# --- a model as single files: --transformer --vae --text-encoder ------------------------------------

FILE_ARGV = ["--prompt", PROMPT, "--size", "32x32", "--frames", "5", "--steps", "1", "--seed", "0"]

@pytest.fixture(scope="module")
def single(tmp_path_factory):
  """The random tiny pipeline as a diffusers folder and as ComfyUI single files."""
  from pipelines.pipeline import WanPipeline
  from tests.pipelines.wan.pretrained import writers

  return writers.write_single_files(WanPipeline.tiny(random=True), str(tmp_path_factory.mktemp("single")))


def _files(single, **changed) -> list[str]:
  flags = {"--transformer": single["transformer"], "--vae": single["vae"], "--text-encoder": single["text_encoder"],
           "--config": single["folder"], **{"--" + k.replace("_", "-"): v for k, v in changed.items()}}
  return [a for flag, value in flags.items() if value is not None for a in (flag, value)]


def test_single_files_make_the_folders_video(single, tmp_path):
  """The same model as --model FOLDER, as ComfyUI single files (configs from --config) and as an
  official Wan folder (--model): the same raw frames (.npy); the sidecar names each single file with
  its layout and SHA-256 (a folder's has none)."""
  import hashlib

  import numpy as np

  from pipelines.pipeline import WanPipeline
  from tests.pipelines.wan.pretrained import writers

  official = writers.write_official(WanPipeline.from_pretrained(single["folder"]), str(tmp_path / "official"),
                                    os.path.join(single["folder"], "tokenizer"))
  argv = FILE_ARGV[:6] + ["--steps", "2", "--seed", "0", "--max-sequence-length", "8", "--dtype", "float32"]
  assert generate.main(argv + ["--model", single["folder"], "--out", str(tmp_path / "folder.npy")]) == 0
  assert generate.main(argv + _files(single) + ["--out", str(tmp_path / "files.npy")]) == 0
  assert generate.main(argv + ["--model", official, "--out", str(tmp_path / "official.npy")]) == 0
  folder, files = np.load(tmp_path / "folder.npy"), np.load(tmp_path / "files.npy")
  assert files.std() > 0.01 and np.array_equal(files, folder)
  assert np.array_equal(np.load(tmp_path / "official.npy"), folder)
  sidecar = json.loads((tmp_path / "files.npy.json").read_text())
  assert sidecar["model"] == os.path.abspath(single["transformer"])
  layouts = {name: record["layout"] for name, record in sidecar["model_files"].items()}
  assert layouts == {"transformer": "wan", "vae": "wan", "text_encoder": "transformers"}
  for name, record in sidecar["model_files"].items():
    assert record["path"] == os.path.abspath(single[name])
    assert record["sha256"] == hashlib.sha256(open(single[name], "rb").read()).hexdigest()
  assert "model_files" not in json.loads((tmp_path / "folder.npy.json").read_text())


def _bad_files(tmp_path, single) -> dict[str, str]:
  """Files in the way: the first half of the transformer, a LoRA, a folder without a tokenizer."""
  from safetensors.numpy import save_file

  import numpy as np

  data = open(single["transformer"], "rb").read()
  (tmp_path / "half.safetensors").write_bytes(data[: len(data) // 2])
  save_file({"blocks.0.self_attn.q.lora_A.weight": np.zeros((4, 8), np.float32)}, str(tmp_path / "lora.safetensors"))
  (tmp_path / "empty").mkdir()
  return {"half": str(tmp_path / "half.safetensors"), "lora": str(tmp_path / "lora.safetensors"),
          "empty": str(tmp_path / "empty")}


SINGLE_FILE_REFUSALS = [  # (id, single-file flags changed (None: left out) or extra flags, message)
    ("with --model", dict(model="tiny"), "--model 'tiny' and --transformer "),
    ("vae left out", dict(vae=None, text_encoder=None), "needs --vae and --text-encoder too: a model as single files"),
    ("missing file", dict(vae="/no/such/vae.safetensors"),
     "--vae '/no/such/vae.safetensors' is not a file; pass a Wan VAE file (wan_2.1_vae.safetensors"),
    ("no tokenizer", dict(config=None), "--transformer, --vae and --text-encoder need --tokenizer FOLDER: no UMT5"),
    ("tokenizer not a folder", dict(tokenizer="{lora}"), "is not a folder; pass a folder holding the google/umt5-xxl"),
    ("folder without a tokenizer", dict(tokenizer="{empty}"), "empty' holds no tokenizer (none of tokenizer.json"),
    ("files swapped", dict(vae="{transformer}"),
     "holds the transformer of a Wan pipeline, not the VAE of a Wan model; pass it as transformer= (--transformer)"),
    ("truncated file", dict(transformer="{half}"), "(truncated or corrupt safetensors file"),
    ("a LoRA as the transformer", dict(transformer="{lora}"), "holds a LoRA (keys like"),
    ("shapes of no known config", dict(vae="{tiny_vae}", config=None, tokenizer="{tokenizer}"),
     "are the VAE of tiny_default and of tiny_i2v, whose latent statistics differ (they are no weights); pass the "
     "model's config: --config FOLDER (CLI)"),
]


@pytest.mark.parametrize("changed,message", [c[1:] for c in SINGLE_FILE_REFUSALS],
                         ids=[c[0] for c in SINGLE_FILE_REFUSALS])
def test_single_files_refused_before_loading(single, tmp_path, capsys, monkeypatch, changed, message):
  """Each bad single-file flag: exit status 2 and the message, before any weight loads or compiles."""
  from pipelines.pipeline import WanPipeline
  from pipelines.wan.pretrained import TINY_DEFAULT_FOLDER

  monkeypatch.setattr(WanPipeline, "from_single_file", lambda *a, **k: pytest.fail("weights loaded"))
  compiles = step_compiles(monkeypatch)
  paths = {**_bad_files(tmp_path, single), "transformer": single["transformer"], "tokenizer": single["folder"],
           "tiny_vae": os.path.join(TINY_DEFAULT_FOLDER, "vae", "diffusion_pytorch_model.safetensors")}
  model = changed.pop("model", None)
  argv = FILE_ARGV + _files(single, **{k: v if v is None else v.format(**paths) for k, v in changed.items()})
  argv += ["--model", model] if model else []
  assert generate.main(argv + ["--out", str(tmp_path / "x.mp4")]) == 2
  err = capsys.readouterr().err
  assert message in err, err
  assert compiles == [] and not os.path.exists(tmp_path / "x.mp4")
