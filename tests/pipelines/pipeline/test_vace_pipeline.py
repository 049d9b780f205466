"""Tests for pipelines/pipeline/vace_pipeline.py (and vace_inputs.py, wan/conditioning/vace.py):
`WanVACEPipeline` against diffusers' `WanVACEPipeline` live, fp32, on a tiny VACE folder built here
(the embedded tiny default's text encoder, VAE, scheduler and trained transformer, plus random VACE
blocks at layers 0 and 2 saved by diffusers' `WanVACETransformer3DModel`): a video with a mask and a
reference image, per-layer scales, on one device and U=2,R=2; reference images alone (no video).
The same prompts and starting noise (diffusers' `randn_tensor` patched to return the array `seed`
gives ours, reference frames included).

Bar: FP32_VIDEO_PSNR_DB (tests/numerics.py: fp32 pipelines, VAE passes within 1e-4 of range).
Controls: another mask, or no reference image, changes diffusers' own video by far more (< 60 dB).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

diffusers = pytest.importorskip("diffusers")
import torch  # noqa: E402

from pipelines.pipeline.checked.request import GenerationRequest  # noqa: E402
from pipelines.pipeline.vace_pipeline import WanVACEPipeline  # noqa: E402
from pipelines.pipeline.wan_pipeline import WanPipeline  # noqa: E402
from tests.numerics import FP32_VIDEO_PSNR_DB, assert_psnr_at_least  # noqa: E402
from tests.pipelines.pipeline.test_video_pipeline import _video, psnr  # noqa: E402
from tests.pipelines.pipeline.vace_folder import build_vace_folder  # noqa: E402

PROMPT, NEGATIVE = "a red square moving right", "blurry"
CALL = dict(height=32, width=48, num_inference_steps=3, guidance_scale=4.0, max_sequence_length=32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  return build_vace_folder(str(tmp_path_factory.mktemp("vace_folder")))


@pytest.fixture(scope="module")
def reference(folder):
  pipe = diffusers.WanVACEPipeline.from_pretrained(folder)
  pipe.set_progress_bar_config(disable=True)
  return pipe


@pytest.fixture(scope="module")
def ours(folder):
  pipe = WanVACEPipeline.from_pretrained(folder)
  pipe.set_progress_bar_config(disable=True)
  return pipe


def _mask(frames=9, left=True) -> np.ndarray:
  """uint8 [frames, 32, 48, 3]: white (generate) on one half, black (keep) on the other."""
  mask = np.zeros((frames, 32, 48, 3), np.uint8)
  mask[:, :, :24] = 255 if left else 0
  mask[:, :, 24:] = 0 if left else 255
  return mask


def _reference_image(height=20, width=28) -> np.ndarray:
  y, x = np.mgrid[0:height, 0:width]
  return np.stack([200 + 0 * x, 30 + 6 * y, 10 * x % 255], axis=-1).astype(np.uint8)


def _diffusers(reference, ours, monkeypatch, *, video=None, mask=None, refs=(), scale=1.0, **call) -> np.ndarray:
  import PIL.Image

  from diffusers.pipelines.wan import pipeline_wan_vace as module

  call = CALL | {"num_frames": 9} | call
  noise = GenerationRequest.build(ours.facts, PROMPT, NEGATIVE, seed=0, reference_images=list(refs) or None,
                                  conditioning_scale=scale, **call).noise()
  monkeypatch.setattr(module, "randn_tensor", lambda shape, **kw: torch.from_numpy(noise.copy()))
  pil = lambda frames: None if frames is None else [PIL.Image.fromarray(f) for f in frames]  # noqa: E731
  with torch.no_grad():
    frames = reference(prompt=PROMPT, negative_prompt=NEGATIVE, video=pil(video), mask=pil(mask),
                       reference_images=pil(refs) or None, conditioning_scale=scale, output_type="np",
                       **call).frames
  return np.asarray(frames)


@pytest.mark.parametrize("mesh", [None, "U=2,R=2"])
def test_video_mask_reference_matches_diffusers(reference, ours, monkeypatch, mesh):
  video, mask, refs, scale = _video(), _mask(), [_reference_image()], [0.8, 1.2]
  want = _diffusers(reference, ours, monkeypatch, video=video, mask=mask, refs=refs, scale=scale)
  got = ours(PROMPT, NEGATIVE, video=video, mask=mask, reference_images=refs, conditioning_scale=scale, seed=0,
             mesh=mesh, **CALL)
  assert got.shape == want.shape == (1, 9, 32, 48, 3)
  assert_psnr_at_least(got, want, FP32_VIDEO_PSNR_DB, name=f"VACE video+mask+reference {mesh=}")
  if mesh is None:  # controls: the other half masked, or no reference, is another video
    other = _diffusers(reference, ours, monkeypatch, video=video, mask=_mask(left=False), refs=refs, scale=scale)
    assert psnr(other, want) < 60
    unreferenced = ours(PROMPT, NEGATIVE, video=video, mask=mask, conditioning_scale=scale, seed=0, **CALL)
    assert psnr(unreferenced, want) < 60


@pytest.mark.parametrize("mesh", [None, "CFG=2,U=2,R=1"])
def test_control_video_at_half_scale_matches_diffusers(reference, ours, monkeypatch, mesh):
  """A control video (pose / depth style: no mask, every pixel generated from it) at
  conditioning_scale 0.5, non-square, 13 frames; CFG's halves on two device groups."""
  video, call = _video(13).transpose(0, 2, 1, 3).copy(), dict(CALL, height=48, width=32)  # [13, 48, 32, 3]
  want = _diffusers(reference, ours, monkeypatch, video=video, scale=0.5, num_frames=13, height=48, width=32)
  got = ours(PROMPT, NEGATIVE, video=video, conditioning_scale=0.5, seed=0, mesh=mesh, **call)
  assert got.shape == want.shape == (1, 13, 48, 32, 3)
  assert_psnr_at_least(got, want, FP32_VIDEO_PSNR_DB, name=f"VACE control video {mesh=}")
  if mesh is None:  # controls: another video, or the full scale, is another video
    assert psnr(ours(PROMPT, NEGATIVE, video=video[::-1].copy(), conditioning_scale=0.5, seed=0, **call), want) < 60
    assert psnr(ours(PROMPT, NEGATIVE, video=video, seed=0, **call), want) < 60


def test_two_experts_match_diffusers(tmp_path, monkeypatch):
  """Wan 2.2 VACE-Fun A14B's layout: transformer_2 (another VACE model) runs the steps below
  boundary_ratio, as diffusers' WanVACEPipeline(transformer_2=, boundary_ratio=)."""
  folder = build_vace_folder(str(tmp_path / "fun"), boundary_ratio=0.9)
  reference = diffusers.WanVACEPipeline.from_pretrained(folder)
  reference.set_progress_bar_config(disable=True)
  ours = WanVACEPipeline.from_pretrained(folder)
  ours.set_progress_bar_config(disable=True)
  video, mask, call = _video(), _mask(), dict(CALL, num_inference_steps=4, guidance_scale_2=2.0)
  request = ours.check_inputs(PROMPT, NEGATIVE, video=video, mask=mask, num_frames=9, seed=0, **call)
  assert set(request.experts_per_step(request.schedule().timesteps)) == {0, 1}  # both experts run
  want = _diffusers(reference, ours, monkeypatch, video=video, mask=mask, **call)
  got = ours(PROMPT, NEGATIVE, video=video, mask=mask, seed=0, **call)
  assert_psnr_at_least(got, want, FP32_VIDEO_PSNR_DB, name="VACE two experts")
  single = diffusers.WanVACEPipeline.from_pretrained(build_vace_folder(str(tmp_path / "one")))
  single.set_progress_bar_config(disable=True)
  one_expert = _diffusers(single, ours, monkeypatch, video=video, mask=mask, num_inference_steps=4)
  assert psnr(one_expert, want) < 60  # control: transformer_2 changes diffusers' own video


def test_references_alone_match_diffusers(reference, ours, monkeypatch):
  """Reference-to-video: no video (zeros, all generated), two references of other sizes, in front of
  the video's latent frames in diffusers' order (the last given first)."""
  refs = [_reference_image(), _reference_image(40, 24)[::-1].copy()]
  want = _diffusers(reference, ours, monkeypatch, refs=refs)
  got = ours(PROMPT, NEGATIVE, reference_images=refs, num_frames=9, seed=0, **CALL)
  assert_psnr_at_least(got, want, FP32_VIDEO_PSNR_DB, name="VACE references alone")
  swapped = ours(PROMPT, NEGATIVE, reference_images=refs[::-1], num_frames=9, seed=0, **CALL)
  assert psnr(swapped, want) < 60  # the order matters, and ours follows diffusers'


def test_a_plain_wan_pipeline_of_the_folder_runs_vace(ours, folder):
  """The model decides: WanPipeline of a VACE folder runs its VACE context (text-only here); a mask on
  a text-to-video model is refused naming it."""
  plain = WanPipeline.from_pretrained(folder)
  plain.set_progress_bar_config(disable=True)
  a = plain(PROMPT, NEGATIVE, num_frames=9, seed=0, **CALL)
  b = ours(PROMPT, NEGATIVE, num_frames=9, seed=0, **CALL)
  np.testing.assert_array_equal(a, b)
  text_only = WanPipeline.tiny(random=True)
  refused = r"mask=<uint8 array \[9, 32, 48, 3\]>, reference_images=\[<uint8 array \[20, 28, 3\]>\] given, but this"
  with pytest.raises(ValueError, match=refused + " model has no VACE blocks"):
    text_only.check_inputs(PROMPT, mask=_mask(), reference_images=[_reference_image()], num_frames=9, **CALL)


@pytest.mark.parametrize("kwargs,match", [
    (dict(mask=_mask()), "mask given without video"),
    (dict(video=_video(), num_frames=13), r"video has 9 frames but num_frames=13"),
    (dict(video=_video(), mask=_mask(5)), r"mask is 5 frame\(s\) of 48x32; it must be one image or 9 frames"),
    (dict(video=_video(), mask=_mask()[:, :16]), "of the video's size 48x32"),
    (dict(conditioning_scale=[1.0, 2.0, 3.0]), r"conditioning_scale=\[1.0, 2.0, 3.0\] must be a finite number or 2"),
    (dict(conditioning_scale=float("nan")), "conditioning_scale=nan"),
    (dict(reference_images="ref.png"), "reference_images='ref.png' must be an image or a list of images, not a str"),
    (dict(reference_images=[_reference_image(), "ref.png"]), r"reference_images\[1\]"),
])
def test_bad_vace_inputs_are_refused_before_compute(ours, kwargs, match):
  kwargs = {"num_frames": 9, **kwargs}
  with pytest.raises(ValueError, match=match):
    ours.check_inputs(PROMPT, **CALL, **kwargs)


def test_one_mask_image_stands_for_every_frame(ours):
  """A single mask image equals the same mask repeated per frame (same request digest aside)."""
  one = ours.check_inputs(PROMPT, video=_video(), mask=_mask(1)[0], num_frames=9, **CALL)
  every = ours.check_inputs(PROMPT, video=_video(), mask=_mask(), num_frames=9, **CALL)
  np.testing.assert_array_equal(one.vace.mask_pixels(9, 32, 48), every.vace.mask_pixels(9, 32, 48))
  assert one.latent_shape == every.latent_shape == (1, 16, 3, 4, 6)
  refs = ours.check_inputs(PROMPT, reference_images=[_reference_image()] * 2, num_frames=9, **CALL)
  assert refs.latent_shape == (1, 16, 5, 4, 6)  # two reference latent frames in front
  assert refs.settings()["reference_images_sha256"][0] is not None


@pytest.mark.parametrize("frames,used", [(9, 9), (12, 9), (16, 13), (14, 13)])
def test_a_video_without_num_frames_gives_its_first_4k_plus_1_frames(ours, frames, used):
  """num_frames left out: a video of 4k frames (12, 16) uses its first 4k + 1 (9, 13), as video-to-video
  does, and is not refused for its length rounded up (13, 17); 9 and 14 (never rounded up) are the controls."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the dropped frames' warning
    request = ours.check_inputs(PROMPT, video=_video(frames), **CALL)
  assert request.num_frames == len(request.vace.video) == used


def test_run_and_call_take_the_videos_length(ours):
  """run(video=...) and __call__(video=...) without num_frames: the video's first 4k + 1 frames, the
  same video as those frames given alone (the control: a 4k + 1 video, which ran before too)."""
  call = dict(CALL, num_inference_steps=1)
  with pytest.warns(UserWarning, match="video has 12 frames; the VAE encodes 4k"):
    result = ours.run(PROMPT, video=_video(12), seed=0, **call)
  assert result.frames.shape == (1, 9, 32, 48, 3)
  np.testing.assert_array_equal(result.frames, ours(PROMPT, video=_video(9), seed=0, **call))
  with pytest.warns(UserWarning, match="video has 16 frames"):
    called = ours(PROMPT, video=_video(16), seed=0, **call)
  np.testing.assert_array_equal(called, ours(PROMPT, video=_video(13), num_frames=13, seed=0, **call))
