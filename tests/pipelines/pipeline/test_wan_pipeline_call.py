"""Tests for `WanPipeline.__call__`'s diffusers-named arguments against diffusers' `WanPipeline`.

Reference: the tiny Wan 2.1 diffusers pipeline of tests/pipelines/pipeline/test_wan_pipeline.py (random weights, UniPC,
saved with `save_pretrained` and read back by `WanPipeline.from_pretrained`); both sides run fp32
with the same explicit latents, on one device and on a 2x2 (U=2, R=2) mesh. Each diffusers run is
made once per module: `prompt_embeds` / `negative_prompt_embeds` from diffusers' `encode_prompt`
with `output_type="pil"`; `num_videos_per_prompt=2` with `output_type="latent"` and
`attention_kwargs={"scale": 0.5}` (no LoRA: a no-op on both sides); a `callback_on_step_end` that
scales the latents by 0.9 after step 0 and interrupts after step 1 of 3.

Bars: decoded videos and latents at FP32_VIDEO_PSNR_DB (latents in units of the reference's range;
the same error analysis: a few transformer forwards, each within ~1e-5 of its output's scale).
uint8 frames (PIL): a pixel can differ only where the fp32 error (<= 1e-4 of the range, the bar
above) straddles a rounding boundary, so by at most 1, in at most 2 * 1e-4 * 255 = 5 % of values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines import WanPipeline
from pipelines.pipeline.checked.inputs import CALLBACK_TENSOR_INPUTS
from tests.numerics import FP32_VIDEO_PSNR_DB, assert_psnr_at_least, within
from tests.pipelines.pipeline.test_wan_pipeline import MAX_LEN, NEGATIVES, PROMPTS, SIZE, _save_diffusers_pipeline, psnr

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

LATENTS = np.random.default_rng(1).standard_normal((2, 16, 3, 6, 10)).astype(np.float32)
COMMON = dict(**SIZE, guidance_scale=4.0, max_sequence_length=MAX_LEN)
MESHES = [None, "U=2,R=2"]
CALLBACK_STEPS = 3  # the callback scales after step 0 and interrupts after step 1: step 2 skipped


def _scaling_callback(record: list, keep: list | None = None):
  """diffusers' callback signature: records (step, timestep, latents), scales the latents by 0.9
  after step 0, interrupts after step 1. Works on torch tensors and JAX arrays alike."""
  def callback(pipe, step_index, timestep, callback_kwargs):
    latents = callback_kwargs["latents"]
    host = latents.numpy() if isinstance(latents, torch.Tensor) else np.asarray(latents)
    record.append((step_index, float(timestep), host.astype(np.float32)))  # astype: a copy
    if keep is not None:
      keep.append(latents)
    if step_index == 1:
      pipe._interrupt = True
    return {"latents": latents * 0.9} if step_index == 0 else {}
  return callback


def assert_latents_close(actual, expected, *, name: str) -> float:
  """PSNR of latents in units of the reference's range, at FP32_VIDEO_PSNR_DB."""
  lo, hi = float(np.min(expected)), float(np.max(expected))
  return assert_psnr_at_least((np.asarray(actual) - lo) / (hi - lo), (np.asarray(expected) - lo) / (hi - lo),
                              FP32_VIDEO_PSNR_DB, name=name)


def assert_pil_close(actual, expected, *, name: str) -> None:
  """Two B-lists of frame lists of PIL images: same sizes; uint8 values within 1, <= 5 % differing."""
  assert len(actual) == len(expected) and all(len(a) == len(e) for a, e in zip(actual, expected))
  a = np.stack([np.stack([np.asarray(f) for f in video]) for video in actual]).astype(np.int16)
  e = np.stack([np.stack([np.asarray(f) for f in video]) for video in expected]).astype(np.int16)
  assert a.shape == e.shape, (a.shape, e.shape)
  assert np.abs(a - e).max() <= 1, f"{name}: uint8 values differ by {np.abs(a - e).max()} (> 1)"
  within(np.mean(a != e), 2 * 1e-4 * 255, f"{name}: fraction of uint8 values differing")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("wan_call") / "wan21")
  _save_diffusers_pipeline(path, two_experts=False)
  return path


@pytest.fixture(scope="module")
def refs(folder):
  """diffusers' outputs for every comparison here (one run each)."""
  pipe = diffusers.WanPipeline.from_pretrained(folder)
  pipe.set_progress_bar_config(disable=True)
  out = {}
  with torch.no_grad():
    embeds, negative = pipe.encode_prompt(PROMPTS, NEGATIVES, do_classifier_free_guidance=True,
                                          max_sequence_length=MAX_LEN)
    out["embeds"] = (embeds, negative)
    out["pil"] = pipe(prompt_embeds=embeds, negative_prompt_embeds=negative, **COMMON, num_inference_steps=2,
                      latents=torch.from_numpy(LATENTS.copy()), output_type="pil").frames
    out["per_prompt"] = pipe(PROMPTS[0], NEGATIVES[0], **COMMON, num_inference_steps=2, num_videos_per_prompt=2,
                             latents=torch.from_numpy(LATENTS.copy()), output_type="latent",
                             attention_kwargs={"scale": 0.5}).frames.numpy()
    record = []
    out["callback"] = pipe(PROMPTS, NEGATIVES, **COMMON, num_inference_steps=CALLBACK_STEPS,
                           latents=torch.from_numpy(LATENTS.copy()), output_type="np",
                           callback_on_step_end=_scaling_callback(record)).frames
    out["callback_record"] = record
  return out


@pytest.fixture(scope="module")
def ours(folder):
  return WanPipeline.from_pretrained(folder)


@pytest.mark.parametrize("mesh", MESHES, ids=["1dev", "U2R2"])
def test_prompt_embeds_and_pil(refs, ours, mesh):
  """diffusers' `encode_prompt` output (torch tensors) given to both; output_type="pil"."""
  embeds, negative = refs["embeds"]
  kwargs = dict(**COMMON, num_inference_steps=2, latents=LATENTS, mesh=mesh, progress=False)
  pil = ours(prompt_embeds=embeds, negative_prompt_embeds=negative, output_type="pil", **kwargs)
  assert len(pil) == 2 and len(pil[0]) == SIZE["num_frames"]
  assert pil[0][0].mode == "RGB" and pil[0][0].size == (SIZE["width"], SIZE["height"])
  assert_pil_close(pil, refs["pil"], name=f"prompt_embeds, pil, mesh {mesh} vs diffusers")
  # "np" from the same embeds: the PIL frames are exactly its diffusers-style rounding.
  frames = ours(prompt_embeds=embeds.numpy(), negative_prompt_embeds=negative.numpy(), **kwargs)
  np.testing.assert_array_equal(np.stack([np.stack([np.asarray(f) for f in v]) for v in pil]),
                                (frames * 255).round().astype(np.uint8))
  # Mixed (diffusers allows it): given prompt_embeds, the negative prompts encoded here.
  mixed = ours(prompt_embeds=embeds, negative_prompt=NEGATIVES, **kwargs)
  assert_psnr_at_least(mixed, frames, FP32_VIDEO_PSNR_DB, name="prompt_embeds + negative_prompt")
  texts = ours(PROMPTS, NEGATIVES, **kwargs)
  assert_psnr_at_least(texts, frames, FP32_VIDEO_PSNR_DB, name="prompts vs their diffusers embeds")


@pytest.mark.parametrize("mesh", MESHES, ids=["1dev", "U2R2"])
def test_pallas_kernels_match_diffusers(refs, ours, mesh):
  """attention_backend="pallas" (on CPU: the kernels in Pallas interpret mode) for every self- and
  cross-attention of the transformer, against diffusers' video; the run records the backend."""
  embeds, negative = refs["embeds"]
  result = ours.run(prompt_embeds=embeds, negative_prompt_embeds=negative, **COMMON, num_inference_steps=2,
                    latents=LATENTS, mesh=mesh, progress=False, attention_backend="pallas")
  assert result.settings["attention_backend"] == "pallas"
  want = np.stack([np.stack([np.asarray(f) for f in video]) for video in refs["pil"]]).astype(np.float32) / 255
  # diffusers' frames are uint8 (PIL): the bar is their rounding, 0.5 / 255, plus the fp32 error.
  within(np.max(np.abs(result.frames - want)), 0.5 / 255 + 1e-4, f"pallas, mesh {mesh} vs diffusers")


@pytest.mark.parametrize("mesh", MESHES, ids=["1dev", "U2R2"])
def test_num_videos_per_prompt_latent_and_scale(refs, ours, mesh):
  """num_videos_per_prompt=2 for one prompt, explicit latents [2, ...], output_type="latent", and
  attention_kwargs={"scale": 0.5} with no LoRA loaded (diffusers: a no-op; here too)."""
  kwargs = dict(**COMMON, num_inference_steps=2, mesh=mesh, progress=False, output_type="latent")
  latents = ours(PROMPTS[0], NEGATIVES[0], num_videos_per_prompt=2, latents=LATENTS,
                 attention_kwargs={"scale": 0.5}, **kwargs)
  assert latents.dtype == np.float32 and latents.shape == LATENTS.shape
  assert_latents_close(latents, refs["per_prompt"], name=f"num_videos_per_prompt=2, mesh {mesh} vs diffusers")
  # Without the scale: bit-identical (the same compiled program on the same inputs).
  np.testing.assert_array_equal(
      ours(PROMPTS[0], NEGATIVES[0], num_videos_per_prompt=2, latents=LATENTS, **kwargs), latents)
  # The two videos got different noise, so they differ (the repeat is of the text only).
  assert psnr(*(np.clip((v - v.min()) / (v.max() - v.min()), 0, 1) for v in latents)) < 40
  # Given embeds are repeated too (diffusers broadcasts one row; more rows fail there).
  embeds, negative = refs["embeds"]
  given = ours(prompt_embeds=embeds[:1], negative_prompt_embeds=negative[:1], num_videos_per_prompt=2,
               latents=LATENTS, **kwargs)
  assert_latents_close(given, refs["per_prompt"], name="prompt_embeds [1] x 2 videos vs diffusers")
  # Seeds: video i of the expanded batch draws seed + i, so one prompt x 2 == the prompt twice.
  by_count = ours(PROMPTS[0], NEGATIVES[0], num_videos_per_prompt=2, seed=5, **kwargs)
  by_list = ours([PROMPTS[0]] * 2, [NEGATIVES[0]] * 2, seed=5, **kwargs)
  assert_latents_close(by_count, by_list, name="1 prompt x 2 videos vs the prompt twice")


def test_lora_scale_hook(ours, monkeypatch):
  """The call's scale goes through the pipeline's public `set_lora_scale`: multiplied into the
  pipeline's scale for the denoising loop and the previous scale restored after it; no call
  without attention_kwargs or with scale 1.0 (test_lora checks the video against diffusers)."""
  calls = []
  original = ours.set_lora_scale
  monkeypatch.setattr(ours, "set_lora_scale", lambda s: calls.append(s) or original(s))
  kwargs = dict(**COMMON, num_inference_steps=1, latents=LATENTS, progress=False, output_type="latent")
  ours(PROMPTS, NEGATIVES, attention_kwargs={"scale": 0.5}, **kwargs)
  assert calls == [0.5, 1.0] and ours.lora_scale == 1.0
  ours(PROMPTS, NEGATIVES, attention_kwargs={"scale": 1.0}, **kwargs)
  ours(PROMPTS, NEGATIVES, attention_kwargs={}, **kwargs)
  assert calls == [0.5, 1.0]


@pytest.mark.parametrize("mesh", MESHES, ids=["1dev", "U2R2"])
def test_callback_scales_latents_and_interrupts(refs, ours, mesh):
  record, keep = [], []
  result = ours.run(PROMPTS, NEGATIVES, **COMMON, num_inference_steps=CALLBACK_STEPS, latents=LATENTS,
                    mesh=mesh, progress=False, callback_on_step_end=_scaling_callback(record, keep))
  assert result.settings["steps_run"] == 2 and ours.current_timestep is None
  expected = refs["callback_record"]
  assert [r[:2] for r in record] == [r[:2] for r in expected]  # steps and timesteps, exactly
  for (k, _, got), (_, _, want) in zip(record, expected):
    assert_latents_close(got, want, name=f"latents after step {k} (mesh {mesh}) vs diffusers")
  assert_psnr_at_least(result.frames, refs["callback"], FP32_VIDEO_PSNR_DB,
                       name=f"callback x0.9 + interrupt, mesh {mesh} vs diffusers")
  # The arrays handed to the callback stay readable after later steps (a copy, never donated).
  for held, (_, _, copied) in zip(keep, record):
    np.testing.assert_array_equal(np.asarray(held), copied)
  # Positive control: the callback's changes matter (vs the same call without it).
  plain = ours(PROMPTS, NEGATIVES, **COMMON, num_inference_steps=CALLBACK_STEPS, latents=LATENTS, mesh=mesh,
               progress=False)
  assert psnr(plain, result.frames) < 45
  assert not ours.interrupt  # reset by the new call


def test_callback_replacements(ours):
  """Replacements returned after step 0 are used by step 1: the same values (copies, any array
  type) give the same latents bit for bit (same program, same inputs); zeroed text states do not."""
  kwargs = dict(**COMMON, num_inference_steps=2, latents=LATENTS, progress=False, output_type="latent")
  everything = list(CALLBACK_TENSOR_INPUTS)
  plain = ours(PROMPTS, NEGATIVES, **kwargs)
  as_given = ours(PROMPTS, NEGATIVES, callback_on_step_end=lambda pipe, k, t, kw: kw,
                  callback_on_step_end_tensor_inputs=everything, **kwargs)
  np.testing.assert_array_equal(as_given, plain)
  copies = ours(PROMPTS, NEGATIVES, callback_on_step_end_tensor_inputs=everything, **kwargs,
                callback_on_step_end=lambda pipe, k, t, kw: {n: np.array(v) for n, v in kw.items()})
  np.testing.assert_array_equal(copies, plain)
  zeroed = ours(PROMPTS, NEGATIVES, callback_on_step_end_tensor_inputs=["prompt_embeds"], **kwargs,
                callback_on_step_end=lambda pipe, k, t, kw: {"prompt_embeds": np.zeros(kw["prompt_embeds"].shape)})
  assert np.abs(zeroed - plain).max() > 1e-3 * np.abs(plain).max()


def test_callback_replacement_errors(ours):
  kwargs = dict(**COMMON, num_inference_steps=1, latents=LATENTS, progress=False, output_type="latent")
  with pytest.raises(ValueError, match="must return a dict"):
    ours(PROMPTS, NEGATIVES, callback_on_step_end=lambda pipe, k, t, kw: None, **kwargs)
  with pytest.raises(ValueError, match=r"latents \(shape \(1, 16, 3, 6, 10\)\) after step 0"):
    ours(PROMPTS, NEGATIVES, callback_on_step_end=lambda pipe, k, t, kw: {"latents": kw["latents"][:1]},
         **kwargs)
  with pytest.raises(ValueError, match=r"prompt_embeds \(1 NaN/inf values\)"):
    bad = np.zeros((2, MAX_LEN, 32), np.float32)
    bad[0, 0, 0] = np.nan
    ours(PROMPTS, NEGATIVES, callback_on_step_end=lambda pipe, k, t, kw: {"prompt_embeds": bad},
         callback_on_step_end_tensor_inputs=["prompt_embeds"], **kwargs)


# --- checks before compute ---

EMBEDS = np.zeros((2, MAX_LEN, 32), np.float32)  # tiny text_dim = 32


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt="a fox", prompt_embeds=EMBEDS), "either prompt or prompt_embeds"),
    (dict(prompt=None), "prompt=None and prompt_embeds=None: give a prompt"),
    (dict(prompt=None, prompt_embeds=EMBEDS[0]), r"prompt_embeds.shape=\(32, 32\) must be \[B, L, text_dim\]"),
    (dict(prompt=None, prompt_embeds=EMBEDS[..., :16]), "text_dim=32"),
    (dict(prompt=None, prompt_embeds=EMBEDS + np.nan), "NaN/inf"),
    (dict(prompt=None, prompt_embeds="a fox"), "must be an array of real numbers"),
    (dict(negative_prompt="x", negative_prompt_embeds=EMBEDS[:1]), "either negative_prompt or"),
    (dict(negative_prompt_embeds=EMBEDS), "holds 2 prompt.* the call has 1"),
    (dict(prompt=None, prompt_embeds=EMBEDS[:, :8]), "classifier-free guidance needs .* same L"),
    (dict(output_type="pt"), "output_type='pt' must be one of"),
    (dict(callback_on_step_end_tensor_inputs=["latents", "noise_pred"]), r"not allowed: \['noise_pred'\]"),
    (dict(callback_on_step_end_tensor_inputs="latents"), "must be a list of names"),
    (dict(callback_on_step_end=3), "callback_on_step_end=3 must be None or a callable"),
    (dict(attention_kwargs={"scale": 0.5, "heads": 2}), r"attention_kwargs=\{.*\}: keys \['heads'\] are not supported"),
    (dict(attention_kwargs={"scale": float("nan")}), r"'scale' must be a finite number"),
    (dict(attention_kwargs=0.5), "must be None or a dict"),
    (dict(generator=torch.Generator()), "generator=.* is not supported.* latents"),
    (dict(num_videos_per_prompt=0), "num_videos_per_prompt=0 must be a positive int"),
    (dict(attention_backend="cuda"), "unknown attention_backend='cuda'"),
    (dict(num_videos_per_prompt=2, latents=LATENTS[:1]), r"for 1 prompt\(s\) x 2 video\(s\)"),
])
def test_call_checks(ours, kwargs, match):
  before = ours.compiled_steps.traces
  call = dict(prompt="a fox", **COMMON, num_inference_steps=1, progress=False)
  with pytest.raises(ValueError, match=match):
    ours(**{**call, **kwargs})
  assert ours.compiled_steps.traces == before  # failed before any compute


def test_another_step_count_reuses_the_compiled_step(ours):
  """A 1-step and a 3-step call run one compiled step program (the solver's tables are padded to
  one length); the 3-step video differs (the count was taken)."""
  call = dict(prompt="a fox", **COMMON, latents=LATENTS[:1], progress=False, output_type="np")
  one = ours(**call, num_inference_steps=1)
  before = ours.compiled_steps.traces
  three = ours(**call, num_inference_steps=3)
  assert ours.compiled_steps.traces == before
  assert np.max(np.abs(np.asarray(one) - np.asarray(three))) > 1e-3


def test_run_options_in_a_call_point_to_call_options(ours):
  """A `CallOptions` field passed to the diffusers-style call names the object that takes it (with
  the value given), before any compute; any other unknown name stays a plain TypeError."""
  before = ours.compiled_steps.traces
  call = dict(prompt="a fox", **COMMON, num_inference_steps=1, progress=False)
  with pytest.raises(TypeError, match=r"\['decode_compile_effort'\]: run options.*CallOptions\(decode_compile_effort=-0.5\)"):
    ours(**call, decode_compile_effort=-0.5)
  with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['fps_out'\]"):
    ours(**call, fps_out=16)
  assert ours.compiled_steps.traces == before
