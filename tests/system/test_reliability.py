"""Reliability: bad inputs fail early and clearly (public API and CLI), NaN guard, Ctrl-C safety.

Each bad input is one table row with the exact error it must give. "Before compute" is asserted
for real: `WanPipeline.encode_prompts`, `_compiled_step` and `decode` (the only ways a call reaches
XLA) are replaced by tripwires for the table tests, and the denoise step's trace counter must not
move. Model folders are minimal diffusers layouts written here (12-head tiny transformer; weights
in checkpoint layout from `checkpoint_layout`): loading fails on the transformer, so the other
components hold only a placeholder safetensors file. Tests run as root, which ignores file
permissions, so "output directory not writable" is a path below a regular file (fails for root too).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import select
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from tests.harness import REPO_ROOT, child_env, step_compiles
from pipelines.cli import generate, run_plan
from pipelines.storage import video_io
from pipelines.pipeline import (NonFiniteLatentsError, TINY_SCHEDULER, TINY_TRANSFORMER, WanPipeline)
from pipelines.storage.weights import CheckpointError
from pipelines.wan import vae as wan_vae
from pipelines.wan.encoders import tokenizer as tokenization, umt5
from pipelines.wan.transformer import checkpoint_layout, init_transformer

ROOT = REPO_ROOT
PROMPT = "a red fox running through snow"
# One small size for every run here (and in test_multihost / test_pipeline's checks): shared programs.
CALL = dict(height=32, width=32, num_frames=5, num_inference_steps=1, max_sequence_length=8)
HEADS12 = dataclasses.replace(TINY_TRANSFORMER, num_attention_heads=12)


def _pipeline(transformer) -> WanPipeline:
  """The tiny pipeline's components around another transformer."""
  te = umt5.UMT5_PRESETS["tiny"]
  return WanPipeline(tokenizer=tokenization.default_tokenizer(),
                     text_encoder=(te, umt5.init_umt5_params(te, 0)), transformers=[transformer],
                     vae=wan_vae.init_vae(wan_vae.VAE_PRESETS["tiny"], jax.random.key(0)),
                     scheduler_config=TINY_SCHEDULER, name="test")


@pytest.fixture(scope="module")
def pipes() -> dict[str, WanPipeline]:
  return {"tiny": WanPipeline.tiny(random=True), "heads12": _pipeline(init_transformer(HEADS12, 0))}


@pytest.fixture(scope="module")
def nan_pipe() -> WanPipeline:
  """The tiny pipeline with every transformer weight NaN."""
  graphdef, state = nnx.split(init_transformer(TINY_TRANSFORMER, 0))
  state = jax.tree.map(lambda x: x * np.nan if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
  return _pipeline(nnx.merge(graphdef, state))


def _write_folder(folder, transformer_files: dict[str, bytes] | None = None, *, index: bool = True) -> str:
  """A diffusers Wan folder: model_index.json, component folders, a 12-head transformer config and
  `transformer_files` (name -> bytes); placeholder weights for the text encoder and VAE (whose config is Wan 2.1's)."""
  os.makedirs(folder)
  if index:
    (folder / "model_index.json").write_text(json.dumps({  # the components named, as diffusers writes it
        "_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"],
        "text_encoder": ["transformers", "UMT5EncoderModel"], "tokenizer": ["transformers", "T5TokenizerFast"],
        "vae": ["diffusers", "AutoencoderKLWan"], "scheduler": ["diffusers", "UniPCMultistepScheduler"]}))
  for component in ("transformer", "text_encoder", "tokenizer", "vae", "scheduler"):
    (folder / component).mkdir()
  (folder / "transformer" / "config.json").write_text(json.dumps(HEADS12.to_dict()))
  (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(
      {"_class_name": "UniPCMultistepScheduler", "use_flow_sigmas": True,
       "prediction_type": "flow_prediction", "flow_shift": 3.0}))
  # The VAE's config (Wan 2.1's, all defaults): read with the other JSON files before any weights.
  (folder / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan"}))
  for component in ("text_encoder", "vae"):
    save_file({"placeholder": np.zeros(1, np.float32)}, str(folder / component / "model.safetensors"))
  for name, data in (transformer_files or {}).items():
    (folder / "transformer" / name).write_bytes(data)
  return str(folder)


def _transformer_bytes(tmp, wrong_shape: str | None = None) -> bytes:
  """A full 12-head transformer checkpoint (zeros) in diffusers layout; `wrong_shape` gets one
  extra row."""
  state = {}
  for key, shape, *_ in checkpoint_layout(HEADS12):
    shape = (shape[0] + 1, *shape[1:]) if key == wrong_shape else shape
    state[key] = np.zeros(shape, np.float32)
  path = str(tmp / "transformer.safetensors")
  save_file(state, path)
  with open(path, "rb") as f:
    return f.read()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
  base = tmp_path_factory.mktemp("folders")
  good = _transformer_bytes(base)
  st = "diffusion_pytorch_model.safetensors"
  return {
      "no_index": _write_folder(base / "no_index", {st: good}, index=False),
      "pickle": _write_folder(base / "pickle", {"diffusion_pytorch_model.bin": b"\x80\x04not loaded"}),
      "truncated": _write_folder(base / "truncated", {st: good[: len(good) // 2]}),
      "mismatch": _write_folder(base / "mismatch", {st: _transformer_bytes(base, "proj_out.weight")}),
  }


@pytest.fixture
def no_compute(monkeypatch):
  """Tripwires on every way a call reaches XLA; yields the list of what was reached."""
  reached = []
  for name in ("encode_prompts", "decode"):
    def tripwire(*args, _name=name, **kwargs):
      reached.append(_name)
      raise AssertionError(f"compute reached: WanPipeline.{_name}")
    monkeypatch.setattr(WanPipeline, name, tripwire)
  compiles = step_compiles(monkeypatch)
  yield reached
  assert reached == [] and compiles == []


# --- the public API ------------------------------------------------------------------------------

def _existing(tmp_path) -> str:
  (tmp_path / "old.mp4").write_bytes(b"old")
  return str(tmp_path / "old.mp4")


def _under_a_file(tmp_path) -> str:
  (tmp_path / "a_file").write_text("")
  return str(tmp_path / "a_file" / "fox.mp4")


API_CASES = [  # (id, call(pipes, folders, tmp_path), exception, message regex)
    ("empty prompt list", lambda p, f, t: p["tiny"]([], **CALL), ValueError,
     r"prompt must be a str or a non-empty list of str, got \[\]"),
    ("prompt/negative batch mismatch", lambda p, f, t: p["tiny"](["a", "b"], ["x"], **CALL), ValueError,
     r"negative_prompt must be a str or a list of 2 str \(one per prompt\), got \['x'\]"),
    ("frames 0", lambda p, f, t: p["tiny"](PROMPT, **{**CALL, "num_frames": 0}), ValueError,
     r"num_frames=0 must be a positive int \(Wan uses 4k\+1, e.g. 81\)"),
    ("frames -3", lambda p, f, t: p["tiny"](PROMPT, **{**CALL, "num_frames": -3}), ValueError,
     r"num_frames=-3 must be a positive int"),
    ("height not a multiple of 16", lambda p, f, t: p["tiny"](PROMPT, **{**CALL, "height": 40}), ValueError,
     r"height=40 must be a positive multiple of 16 \(VAE factor 8 x patch 2\); use 32 or 48"),
    ("steps 0", lambda p, f, t: p["tiny"](PROMPT, **{**CALL, "num_inference_steps": 0}), ValueError,
     r"num_inference_steps=0 must be a positive int"),
    ("NaN guidance", lambda p, f, t: p["tiny"](PROMPT, **CALL, guidance_scale=math.nan), ValueError,
     r"guidance_scale=nan must be a finite number"),
    ("NaN latents", lambda p, f, t: p["tiny"](PROMPT, **CALL, latents=np.full((1, 16, 2, 4, 4), np.nan)),
     ValueError, r"latents hold 512 NaN/inf values; pass finite noise"),
    ("mesh U=0", lambda p, f, t: p["tiny"](PROMPT, **CALL, mesh="U=0"), ValueError,
     r"mesh spec='U=0': U=0 must be >= 1"),
    ("mesh U=8 with 12 heads", lambda p, f, t: p["heads12"](PROMPT, **CALL, mesh="U=8"), ValueError,
     r"the model has 12 heads, not divisible by the Ulysses degree U=8; with 8 devices use one of: "
     r"U=1,R=8, U=2,R=4, U=4,R=2"),
    ("mesh U=3 with 8 heads", lambda p, f, t: p["tiny"](PROMPT, **CALL, mesh="U=3"), ValueError,
     r"the model has 8 heads, not divisible by the Ulysses degree U=3; with 3 devices use one of: U=1,R=3"),
    ("mesh bigger than the devices", lambda p, f, t: p["tiny"](PROMPT, **CALL, mesh="U=4,R=4"), ValueError,
     r"mesh U=4,R=4 needs 16 devices but 8 are visible"),
    ("unknown dtype", lambda p, f, t: WanPipeline.tiny("float16", random=True), ValueError,
     r"dtype='float16' is not supported; use one of \['bfloat16', 'float32'\]"),
    ("folder without model_index.json", lambda p, f, t: WanPipeline.from_pretrained(f["no_index"]),
     CheckpointError, r"has no model_index.json; pass a diffusers-format Wan pipeline folder"),
    ("pickle-only checkpoint", lambda p, f, t: WanPipeline.from_pretrained(f["pickle"]), CheckpointError,
     r"holds only pickle-format weights \['diffusion_pytorch_model.bin'\]; pickle files can execute code"),
    ("truncated safetensors", lambda p, f, t: WanPipeline.from_pretrained(f["truncated"]), CheckpointError,
     r"cannot read .*diffusion_pytorch_model.safetensors' \(truncated or corrupt safetensors file"),
    ("key shape mismatch", lambda p, f, t: WanPipeline.from_pretrained(f["mismatch"]), CheckpointError,
     r"does not fit the model config:\n  shape mismatches \(1\): \['proj_out.weight: checkpoint "
     r"\(65, 192\) vs model \(64, 192\)'\]"),
    ("output directory missing",
     lambda p, f, t: video_io.check_output(str(t / "no" / "x.mp4"), overwrite=False),
     video_io.OutputError, r"the directory of output .* does not exist .*; create it first"),
    ("output directory is a file", lambda p, f, t: video_io.check_output(_under_a_file(t), overwrite=False),
     video_io.OutputError, r"cannot exist: .*a_file' is a file, not a directory"),
    ("existing output", lambda p, f, t: video_io.write_video(np.zeros((1, 16, 16, 3)), _existing(t)),
     video_io.OutputError, r"old.mp4' exists; pass overwrite=True to replace it"),
]


@pytest.mark.parametrize("call,error,match", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_api_rejects_before_compute(pipes, folders, tmp_path, no_compute, call, error, match):
  with pytest.raises(error, match=match):
    call(pipes, folders, tmp_path)


def test_api_accepts_u3_with_12_heads(pipes):
  """U=3 divides 12 heads: accepted (the check must not reject a mesh that works)."""
  resolved = pipes["heads12"].check_inputs(
      PROMPT, None, **CALL, guidance_scale=5.0, guidance_scale_2=None, flow_shift=None, seed=0,
      latents=None, mesh="U=3")
  assert dict(resolved.mesh.shape) == {"cfg": 1, "ring": 1, "ulysses": 3}


# Every public argument of WanPipeline.run (and so of __call__) x wrong types: each must be a
# ValueError naming the argument and its value, before any compute. `test_every_argument_is_listed`
# keeps the table complete when an argument is added.
WRONG_TYPES = {
    "prompt": [123, None, b"a fox", [PROMPT, 2], (PROMPT, None)],
    "negative_prompt": [123, b"blurry", [1], [None], {"a": 1}],
    "height": ["32", 32.0, True, np.float32(32)],  # None: the model's (test_generation_defaults)
    "width": ["32", 32.0, True, np.float32(32)],
    "num_frames": ["5", 5.0, True, math.nan],
    "num_inference_steps": ["1", 1.0, True, math.inf, 0],
    "timesteps": [5, "1000,750", [1000, "x"], [[1000, 750]], [True], [750, 1000], [2000], []],
    "sigmas": [0.5, [1.5], [math.nan], [0.5, 0.9], [0.0]],
    "scheduler": [123, "ddim", True, {"a": 1}],
    "guidance_scale": ["abc", "5.0", True, math.nan, math.inf, 1j, [5.0]],
    "guidance_scale_2": ["abc", True, math.nan, [1.0]],
    "flow_shift": ["abc", "3.0", True, math.nan, -math.inf, [3.0], 0.0],
    "seed": ["1", 1.0, True, math.nan, -1, np.bool_(True)],
    "latents": ["abc", [["x"]], np.zeros((1, 16, 2, 4, 4), np.complex64), {"a": 1}, True],
    "max_sequence_length": ["8", 8.0, True, 0],
    "mesh": [123, 2.0, ["U=2"], True],
    "progress": ["yes", 1, None],
    "on_step": [123, "print"],
    "attention_implementation": [123, None, "flash"],
    "attention_backend": [123, None, "cuda"],
    "nan_guard": ["no", 0, None],
    "decode": ["no", 1, None],
    "prompt_embeds": ["abc", np.zeros((1, 8), np.float32), np.zeros((1, 8, 5), np.float32), {"a": 1}, True],
    "negative_prompt_embeds": ["abc", np.zeros((2, 8, 32), np.float32), [[["x"]]], 1j],
    "num_videos_per_prompt": ["2", 2.0, True, None, 0],
    "callback_on_step_end": [123, "print"],
    "callback_on_step_end_tensor_inputs": ["latents", [1], ["noise_pred"], None],
    "attention_kwargs": [0.5, {"scale": "1"}, {"scale": math.nan}, {"lora": 1}, {"scale": True}],
    "generator": [0, "seed"],
    "checkpoint_dir": [123, b"ckpt", ["ckpt"], True],
    "checkpoint_every": ["1", 1.0, True, 0, None],
    "resume": ["yes", 1, None],
    "keep_checkpoint": ["no", 0, None],
    "step_cache": [123, "first-block", "fast:0.1", True],
    "shard_weights": ["yes", 1, None],
    "vae_parallel": ["yes", 1, None],
    "attention_exchange": ["fp16", 8, None],
    # Images given to a text-to-video model (the image model's own checks: tests/pipelines/pipeline/test_image_pipeline.py).
    "image": [np.zeros((16, 16, 3), np.uint8)],
    "last_image": [np.zeros((16, 16, 3), np.uint8)],
    "image_embeds": [np.zeros((1, 4, 8), np.float32)],
    # video-to-video's: not frames; a strength outside (0, 1] or not a number (checked without a video too)
    "video": [123, "clip.mp4"],
    "strength": ["high", -1, None, True],
    # VACE's, given to a model without VACE blocks (VACE's own checks: tests/pipelines/pipeline/test_vace_pipeline.py)
    "mask": [np.zeros((1, 16, 16, 3), np.uint8), "mask.png"],
    "reference_images": ["ref.png", ["a.png", "b.png"], np.zeros((16, 16, 3), np.uint8)],
    "conditioning_scale": [0.5, "1", None, [1.0, 1.0]],
    # context windows: not 4k + 1, longer than the video, not an int; overlap and fuse without windows
    "context_frames": ["17", 16, 33, True, 0],
    "context_overlap": [4, "4", -4],
    "context_fuse": ["pyramids", 1],
}
WRONG_TYPE_CASES = [(name, value) for name, values in WRONG_TYPES.items() for value in values]


def test_every_argument_is_listed():
  """The table covers every argument a call takes (the request's, the options', the legacy ones)."""
  import inspect

  from pipelines.pipeline.run import call_options
  accepted = ({"prompt", "negative_prompt", "callback_on_step_end", "callback_on_step_end_tensor_inputs"}
              | set(call_options.REQUEST_ARGUMENTS) | set(call_options.LEGACY_OPTIONS))
  assert accepted == set(WRONG_TYPES)
  # output_type is __call__'s alone (run has decode=False for latents); test_pipeline_call checks it.
  named = set(inspect.signature(WanPipeline.__call__).parameters) - {"self", "output_type", "options"}
  assert named <= accepted and len(inspect.signature(WanPipeline.__call__).parameters) <= 23


@pytest.mark.parametrize("name,value", WRONG_TYPE_CASES,
                         ids=[f"{n}={v!r}"[:40] for n, v in WRONG_TYPE_CASES])
def test_api_names_every_wrong_argument(pipes, no_compute, name, value):
  with pytest.raises(ValueError) as caught:
    pipes["tiny"].run(**{"prompt": PROMPT, **CALL, name: value})
  message = str(caught.value)
  assert re.search(rf"\b{name}\b", message), message
  if not isinstance(value, np.ndarray):
    assert repr(value) in message, message


def test_negative_prompt_checked_without_cfg(pipes, no_compute):
  """guidance_scale <= 1 does not use the negative prompt, but a wrong one is still refused."""
  with pytest.raises(ValueError, match=r"negative_prompt must be .*, got 123"):
    pipes["tiny"].run(PROMPT, 123, **CALL, guidance_scale=1.0)


# --- the command line ----------------------------------------------------------------------------

CLI_CASES = [  # (id, extra arguments ({folder} and {tmp} filled in), message)
    ("empty prompt", ["--prompt", ""], "--prompt '' is empty; describe the video"),
    ("frames 0", ["--frames", "0"], "--frames: num_frames=0 must be a positive int (Wan uses 4k+1, e.g. 81)"),
    ("size not a multiple of 16", ["--size", "40x32"],
     "width=40 must be a positive multiple of 16 (VAE factor 8 x patch 2); use 32 or 48"),
    ("steps 0", ["--steps", "0"], "--steps: num_inference_steps=0 must be a positive int; e.g. 50"),
    ("NaN guidance", ["--guidance", "nan"],
     "--guidance: guidance_scale=nan must be a finite number in [0, 100] (Wan: 5.0; <= 1 turns CFG off)"),
    ("mesh U=0", ["--mesh", "U=0"], "--mesh: mesh spec='U=0': U=0 must be >= 1"),
    ("mesh U=8 with 12 heads", ["--model", "{mismatch}", "--mesh", "U=8"],
     "the model has 12 heads, not divisible by the Ulysses degree U=8; with 8 devices use one of: "
     "U=1,R=8, U=2,R=4, U=4,R=2"),
    ("mesh U=3 with 8 heads", ["--mesh", "U=3"],
     "the model has 8 heads, not divisible by the Ulysses degree U=3"),
    ("mesh bigger than the devices", ["--mesh", "U=4,R=4"],
     "mesh U=4,R=4 needs 16 devices but 8 are visible"),
    ("unknown dtype", ["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    ("folder without model_index.json", ["--model", "{no_index}"], "has no model_index.json"),
    ("pickle-only checkpoint", ["--model", "{pickle}"],
     "holds only pickle-format weights ['diffusion_pytorch_model.bin']"),
    ("truncated safetensors", ["--model", "{truncated}"], "(truncated or corrupt safetensors file"),
    ("key shape mismatch", ["--model", "{mismatch}"],
     "shape mismatches (1): ['proj_out.weight: checkpoint (65, 192) vs model (64, 192)']"),
    ("output directory missing", ["--out", "{tmp}/no/x.mp4"], "does not exist"),
    ("output directory is a file", ["--out", "{tmp}/a_file/x.mp4"], "a_file' is a file, not a directory"),
    ("existing output", ["--out", "{tmp}/old.mp4"], "old.mp4' exists; pass --overwrite"),
]


def _main(argv: list[str]) -> int:
  try:
    return generate.main(argv)
  except SystemExit as e:  # argparse
    return e.code


@pytest.mark.parametrize("extra,message", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_rejects_before_compute(folders, tmp_path, capsys, no_compute, extra, message):
  _existing(tmp_path)
  _under_a_file(tmp_path)
  extra = [a.format(tmp=tmp_path, **folders) for a in extra]
  argv = ["--prompt", PROMPT, "--size", "32x32", "--frames", "5", "--steps", "1",
          "--out", str(tmp_path / "x.mp4"), *extra]
  assert _main(argv) == 2
  err = capsys.readouterr().err
  assert message in err, err
  assert sorted(os.listdir(tmp_path)) == ["a_file", "old.mp4"]  # nothing written
  assert (tmp_path / "old.mp4").read_bytes() == b"old"


# --- NaN guard ------------------------------------------------------------------------------------

def test_nan_guard_stops_at_the_first_bad_step(nan_pipe):
  steps = []
  message = r"latents hold NaN/inf after denoising step 1/2 \(timestep \d+\.\d, expert 0\); stopped before"
  with pytest.raises(NonFiniteLatentsError, match=message):
    nan_pipe.run(PROMPT, **{**CALL, "num_inference_steps": 2}, seed=0, on_step=lambda k, s: steps.append(k))
  assert steps == []
  result = nan_pipe.run(PROMPT, **{**CALL, "num_inference_steps": 2}, seed=0, nan_guard=False, decode=False)
  assert np.isnan(result.latents).all() and result.frames is None


def test_cli_nan_guard_writes_nothing(nan_pipe, tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(WanPipeline, "tiny", classmethod(lambda cls, dtype="float32", random=False, image=False,
                                                                   vae_dtype="float32": nan_pipe))
  monkeypatch.setattr(nan_pipe, "name", "tiny-random")  # the random tiny model's facts, NaN weights
  out = tmp_path / "fox.mp4"
  argv = ["--prompt", PROMPT, "--model", "tiny-random", "--size", "32x32", "--frames", "5", "--steps", "2",
          "--max-sequence-length", "8", "--out", str(out)]
  assert generate.main(argv) == 1
  assert "generate: error: latents hold NaN/inf after denoising step 1/2" in capsys.readouterr().err
  assert os.listdir(tmp_path) == []
  plan = run_plan.plan_run(generate.build_parser().parse_args(argv + ["--no-nan-guard"]))
  assert plan.nan_guard is False


# --- Ctrl-C ---------------------------------------------------------------------------------------

def test_interrupt_during_denoising_leaves_no_output(tmp_path):
  out = tmp_path / "fox.mp4"
  # ~20 ms per step at this size on one CPU device (1 ms at 32x32): a window of ~20 s to interrupt.
  cmd = [sys.executable, "-m", "pipelines.cli.generate", "--prompt", PROMPT, "--size", "128x128", "--frames",
         "17", "--steps", "1000", "--max-sequence-length", "8", "--seed", "0", "--out", str(out)]
  # A runner started with SIGINT ignored (`cmd &` in a non-interactive shell) passes SIG_IGN on to
  # its children, and Python keeps it: restore the default so the child gets its Ctrl-C handler.
  proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stderr=subprocess.PIPE,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  err = b""
  try:
    deadline = time.monotonic() + 120
    while b"denoise:" not in err:  # the progress bar appears when the first step starts
      assert time.monotonic() < deadline and proc.poll() is None, err.decode(errors="replace")
      if select.select([proc.stderr], [], [], 1.0)[0]:
        err += os.read(proc.stderr.fileno(), 65536)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGINT)
    code = proc.wait(timeout=60)
    err += proc.stderr.read()
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  text = err.decode(errors="replace")
  assert code == 130, text
  assert "generate: interrupted; nothing written to" in text, text
  assert "1000/1000" not in text  # it really stopped mid-way
  assert os.listdir(tmp_path) == []  # no output, no sidecar, no temporary file
