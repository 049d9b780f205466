"""Tests for pipelines/pipeline/run/resume.py: denoising checkpoints, resuming on the same and another mesh, refusals.

An interrupted run is one whose `on_step` raises after step k (what Ctrl-C or a lost process does
to the loop); the checkpoint on disk then holds the state after the last saved step. Resumed, the
run must give the uninterrupted run's video (fp32, >= 60 dB PSNR; the sharded and single-device
runs agree to ~1e-7, so the bound has a wide margin). The command-level flow (`generate
--checkpoint-dir`, Ctrl-C, `generate --resume`) is tests/pipelines/cli/test_records.py's.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from tests.numerics import assert_psnr_at_least
from pipelines.pipeline.run import resume
from pipelines.pipeline import wan_pipeline

RESUME_PSNR_DB = 60.0
KW = dict(height=32, width=32, num_frames=5, num_inference_steps=5, seed=3, max_sequence_length=8,
          progress=False)
PROMPT = "a fox"  # shorter than max_sequence_length bytes: no truncation warning


class Stop(Exception):
  """Stands for an interruption after a step."""


def _stop_after(k: int):
  def on_step(step: int, seconds: float) -> None:
    if step + 1 == k:
      raise Stop
  return on_step


@pytest.fixture(scope="module")
def pipe():
  return wan_pipeline.WanPipeline.tiny(random=True)


@pytest.fixture(scope="module")
def reference(pipe):
  return pipe.run(PROMPT, **KW).frames


@pytest.mark.parametrize("every,stop,mesh", [(1, 2, None), (1, 3, "U=2,R=2"), (2, 3, "U=1,R=2")])
def test_interrupted_run_resumes_to_the_same_video(pipe, reference, tmp_path, every, stop, mesh):
  folder = str(tmp_path / "ckpt")
  with pytest.raises(Stop):
    pipe.run(PROMPT, checkpoint_dir=folder, checkpoint_every=every, on_step=_stop_after(stop), **KW)
  saved = resume.read(folder)
  assert saved is not None and saved.step == stop // every * every  # the last multiple of `every`
  assert saved.arrays["latents"].shape == pipe.latent_shape(1, 32, 32, 5)
  steps_run = []
  result = pipe.run(PROMPT, checkpoint_dir=folder, resume=True, mesh=mesh,
                    on_step=lambda k, s: steps_run.append(k), **KW)
  assert steps_run == list(range(saved.step, KW["num_inference_steps"]))  # only the steps left
  assert result.settings["resumed_from_step"] == saved.step
  assert_psnr_at_least(result.frames, reference, RESUME_PSNR_DB, name=f"resumed at {saved.step} on {mesh}")
  assert not os.path.exists(folder)  # removed once the video is made


def test_checkpoint_kept_on_request_holds_the_final_state(pipe, tmp_path):
  folder = str(tmp_path / "ckpt")
  result = pipe.run(PROMPT, checkpoint_dir=folder, keep_checkpoint=True, **KW)
  saved = resume.read(folder)
  assert saved.step == KW["num_inference_steps"]
  np.testing.assert_array_equal(saved.arrays["latents"], result.latents)
  assert [n for n in os.listdir(folder)] == [resume.STATE_FILE]  # no temporary file left


def test_resume_refuses_another_run_before_compute(pipe, tmp_path):
  folder = str(tmp_path / "ckpt")
  with pytest.raises(Stop):
    pipe.run(PROMPT, checkpoint_dir=folder, on_step=_stop_after(2), **KW)
  cases = [(dict(prompt="a cat"), "prompts: checkpoint"),
           (dict(num_inference_steps=6), "num_inference_steps: checkpoint 5, this run 6"),
           (dict(seed=4), "noise_sha256"), (dict(guidance_scale=3.0), "guidance_scale"),
           (dict(flow_shift=5.0), "scheduler")]
  for change, message in cases:
    kwargs = {**KW, "prompt": PROMPT, **change}
    calls = []
    with pytest.raises(resume.ResumeError, match=message):
      pipe.run(checkpoint_dir=folder, resume=True, on_step=lambda k, s: calls.append(k), **kwargs)
    assert calls == []
  other = wan_pipeline.WanPipeline.tiny(random=True)  # the same weights: accepted ...
  assert other.fingerprint() == pipe.fingerprint()
  leaves, treedef = jax.tree.flatten(other._experts[0])
  leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].add(1.0)  # ... one weight value changed: refused
  other._experts = [jax.tree.unflatten(treedef, leaves)]
  with pytest.raises(resume.ResumeError, match="model_fingerprint"):
    other.run(PROMPT, checkpoint_dir=folder, resume=True, **KW)
  # without resume, the checkpoint is never overwritten; resume without one is an error
  with pytest.raises(resume.ResumeError, match="already holds a denoising checkpoint"):
    pipe.run(PROMPT, checkpoint_dir=folder, **KW)
  with pytest.raises(resume.ResumeError, match="holds no denoising checkpoint"):
    pipe.run(PROMPT, checkpoint_dir=str(tmp_path / "empty"), resume=True, **KW)
  assert resume.read(folder).step == 2  # untouched by the refusals


def test_callback_interrupt_keeps_the_checkpoint(pipe, reference, tmp_path):
  """diffusers' `_interrupt` ends the call early with a partial video: the checkpoint stays, and
  resuming it finishes the video."""
  folder = str(tmp_path / "ckpt")

  def stop_after_two(p, k, t, kwargs):
    if k == 1:
      p._interrupt = True
    return {}
  pipe.run(PROMPT, checkpoint_dir=folder, callback_on_step_end=stop_after_two, **KW)
  assert resume.read(folder).step == 2
  result = pipe.run(PROMPT, checkpoint_dir=folder, resume=True, **KW)
  assert_psnr_at_least(result.frames, reference, RESUME_PSNR_DB, name="resumed after _interrupt")


def test_unreadable_checkpoint_is_refused(pipe, tmp_path):
  folder = tmp_path / "ckpt"
  folder.mkdir()
  (folder / resume.STATE_FILE).write_bytes(b"not safetensors")
  with pytest.raises(resume.ResumeError, match="not a readable denoising checkpoint"):
    pipe.run(PROMPT, checkpoint_dir=str(folder), resume=True, **KW)


@pytest.mark.parametrize("kwargs,message", [
    (dict(checkpoint_every=0), "checkpoint_every"), (dict(resume=True), "resume=True needs checkpoint_dir"),
    (dict(checkpoint_dir=3), "checkpoint_dir=3"), (dict(checkpoint_dir="x", resume="yes"), "resume"),
])
def test_checkpoint_arguments_are_checked(pipe, kwargs, message):
  with pytest.raises(ValueError, match=message):
    pipe.run(PROMPT, **dict(KW, **kwargs))
