"""Tests for pipelines/wan/conditioning/windows.py (context windows) through the whole pipeline
(pipelines/pipeline/run/step.py's `_windowed_noise`), on the random-weight tiny model in fp32.

- Layout and weights: ComfyUI's pyramid (1, 2, ..., 2, 1) and flat weights, each frame's shares
  summing to 1, windows evenly spread with the last flush with the end, padding copies of weight 0.
  `real_rows` marks a padding copy's rows of a round's forward (on every row layout).
- Window arithmetic: a one-step run is the share-weighted blend of the windows' own one-step runs on
  the same noise (each window run as a clip of its length with its slice of the noise). The step is
  linear in the noise prediction (the first solver step and the guidance mix), so the blend commutes
  with it; bar: fp32 rounding of a few sums (1e-5 of the latents' range ~4).
- Windows that do not overlap are separate clips (every share exactly 1), over the whole schedule.
- W=2 (windows on two device groups, one all-reduce a step) equals the same windows run one after
  another on one group, to fp32 rounding (>= 100 dB), with an odd number of windows (one padding copy),
  also with CFG=2 and the weights sharded over the whole mesh.
- A window as long as the video is no window: the same video bit for bit.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pipelines import WanPipeline
from pipelines.wan.conditioning import ContextWindows, real_rows
from tests.pipelines.pipeline.test_video_pipeline import psnr

KW = dict(height=32, width=32, num_inference_steps=1, max_sequence_length=32, decode=False,
          guidance_scale=3.0, prompt="a red square moving right", negative_prompt="blurry")


@pytest.fixture(scope="module")
def tiny():
  pipe = WanPipeline.tiny(random=True)
  pipe.set_progress_bar_config(disable=True)
  return pipe


def _noise(frames: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal((1, 16, frames, 4, 4)).astype(np.float32)


def test_layout_weights_and_shares():
  w = ContextWindows(frames=17, length=5, overlap=2)
  assert w.starts == (0, 3, 6, 9, 12) and list(w.weights()) == [1, 2, 3, 2, 1]
  assert ContextWindows(frames=61, length=21, overlap=8).starts == (0, 10, 20, 30, 40)  # ComfyUI: 0, 13, 26, 39, 40
  assert list(ContextWindows(frames=9, length=4, overlap=1).weights()) == [1, 2, 2, 1]
  assert list(ContextWindows(frames=9, length=4, overlap=1, fuse="flat").weights()) == [1, 1, 1, 1]
  for fuse in ("pyramid", "flat"):
    w = ContextWindows(frames=23, length=6, overlap=3, fuse=fuse)
    starts, shares = w.rounds(2)
    total = np.zeros(23)
    for s, share in zip(starts.reshape(-1), shares.reshape(-1, 6)):
      total[s:s + 6] += share
    np.testing.assert_allclose(total, 1.0, rtol=1e-6)
    assert starts.shape == (len(w.starts) // 2 + len(w.starts) % 2, 2)
    if len(w.starts) % 2:
      assert not shares[-1, -1].any()  # the padding copy weighs nothing
    gaps = np.diff(w.starts)
    assert w.starts[-1] == 23 - 6 and gaps.max() - gaps.min() <= 1 and gaps.max() <= 6 - 3


def test_real_rows_mark_the_padding_copies_rows():
  """Rows [outer, G, inner] of each round: 3 windows on G=2 pad the second round's second window;
  guidance halves on separate devices (outer 2) split each window's rows [cond; uncond]."""
  w = ContextWindows(frames=7, length=3, overlap=1)
  assert w.starts == (0, 2, 4)
  np.testing.assert_array_equal(real_rows(w, 2, 1, 2), [[1, 1, 1, 1], [1, 1, 0, 0]])
  np.testing.assert_array_equal(real_rows(w, 2, 2, 2), [[1, 1, 1, 1], [1, 0, 1, 0]])
  np.testing.assert_array_equal(real_rows(w, 1, 1, 2), np.ones((3, 2)))
  assert real_rows(ContextWindows(frames=9, length=3, overlap=1), 2, 1, 2).all()  # 4 windows: no copy
  _, shares = w.rounds(2)
  np.testing.assert_array_equal(real_rows(w, 2, 1, 1), shares.any(axis=-1))  # the copies the blend weighs 0
  with pytest.raises(ValueError, match="rows=3 must be a multiple of outer=2"):
    real_rows(w, 2, 2, 3)


def _blend(parts: list[np.ndarray], windows: ContextWindows) -> np.ndarray:
  """numpy: the share-weighted sum of the windows' latents [1, C, Lw, Hl, Wl] over the video."""
  out = np.zeros((1, 16, windows.frames, 4, 4), np.float64)
  counts = windows.counts()
  for part, s in zip(parts, windows.starts):
    out[:, :, s:s + windows.length] += part * (windows.weights() / counts[s:s + windows.length])[:, None, None]
  return out


def test_windows_that_continue_are_given_what_the_ones_before_made():
  """`continued`: the blend's layout run in order, each window given the frames its predecessors
  cover (the overlap, more where the even spacing packs windows closer); such windows are never
  blended (asking for their weights is refused)."""
  assert ContextWindows(17, 5, 2, "continue").continued() == ((0, 0), (3, 2), (6, 2), (9, 2), (12, 2))
  assert ContextWindows(9, 5, 2, "continue").continued() == ((0, 0), (2, 3), (4, 3))
  assert ContextWindows(10, 5, 0, "continue").continued() == ((0, 0), (5, 0))
  with pytest.raises(ValueError, match="fuse='continue': these windows are not blended"):
    ContextWindows(17, 5, 2, "continue").rounds(1)


@pytest.mark.parametrize("fuse", ["pyramid", "flat"])
def test_one_step_is_the_blend_of_the_windows_own_steps(tiny, fuse):
  noise = _noise(9)  # 33 frames, windows of 13 (4 latent frames) overlapping by 4 (1): starts 0, 3, 5
  got = tiny.run(num_frames=33, latents=noise, context_frames=13, context_overlap=4, context_fuse=fuse, **KW)
  windows = ContextWindows(frames=9, length=4, overlap=1, fuse=fuse)
  assert got.settings["context_windows"]["starts"] == [0, 3, 5]
  parts = [tiny.run(num_frames=13, latents=noise[:, :, s:s + 4].copy(), **KW).latents for s in windows.starts]
  want = _blend(parts, windows)
  err = np.abs(got.latents - want).max()
  print(f"{fuse}: max |windowed - blend of windows| = {err:.2e}")
  assert err < 1e-5 * np.abs(want).max()
  assert np.abs(parts[0] - got.latents[:, :, :4]).max() > 1e-3  # control: the blend is not window 0 alone


def test_windows_without_overlap_are_separate_clips(tiny):
  noise = _noise(8, seed=1)  # 29 frames = two windows of 13 (4 latent frames each), no overlap
  kw = KW | dict(num_inference_steps=3)
  got = tiny.run(num_frames=29, latents=noise, context_frames=13, context_overlap=0, **kw).latents
  for s in (0, 4):
    clip = tiny.run(num_frames=13, latents=noise[:, :, s:s + 4].copy(), **kw).latents
    np.testing.assert_allclose(got[:, :, s:s + 4], clip, rtol=0, atol=2e-5)
  whole = tiny.run(num_frames=29, latents=noise, **kw).latents
  assert np.abs(whole - got).max() > 1e-3  # control: one 29-frame clip is another video


def test_a_window_as_long_as_the_video_is_none(tiny):
  noise = _noise(5, seed=2)
  plain = tiny.run(num_frames=17, latents=noise, **KW)
  same = tiny.run(num_frames=17, latents=noise, context_frames=17, **KW)
  assert "context_windows" not in same.settings
  np.testing.assert_array_equal(plain.latents, same.latents)


@pytest.mark.parametrize("mesh,reference,shard", [("W=2,U=2,R=1", "U=2,R=1", False),
                                                  ("CFG=2,W=2,U=2,R=1", "CFG=2,U=2,R=1", True)])
def test_windows_on_two_device_groups_equal_one_after_another(tiny, mesh, reference, shard):
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  noise = _noise(9, seed=3)  # three windows: the second round pads with a copy of weight 0
  kw = KW | dict(num_frames=33, latents=noise, context_frames=13, context_overlap=4, num_inference_steps=2)
  parallel = tiny.run(mesh=mesh, shard_weights=shard, **kw).latents  # weights split over all 8 devices
  sequential = tiny.run(mesh=reference, **kw).latents
  value = psnr(parallel, sequential)
  print(f"{mesh} vs {reference}: {value:.1f} dB")
  assert value >= 100
  other = tiny.run(mesh=reference, **(kw | dict(context_overlap=8))).latents
  assert psnr(other, sequential) < 80  # control: other windows are another video


def test_the_windows_axis_adds_one_all_reduce_of_the_prediction(tiny):
  """On W=2 the groups' blended predictions meet in one all-reduce of the video's noise-prediction
  size ([2 rows, C, F, Hl, Wl] over the windows groups) and no window's prediction is gathered to
  every device; the sequential windows (U=2,R=1) have no such all-reduce (control)."""
  import re

  if jax.device_count() < 4:
    pytest.skip("needs 4 devices")
  kw = KW | dict(num_frames=33, latents=_noise(9, seed=4), context_frames=13, context_overlap=4)
  counts = {}
  for mesh in ("W=2,U=2,R=1", "U=2,R=1"):
    tiny.compiled_steps.clear()
    tiny.run(mesh=mesh, **kw)
    hlo = tiny.compiled_steps.programs()[-1].as_text()
    counts[mesh] = (len(re.findall(r"f32\[2,16,9,4,4\]\{[\d,]*\} all-reduce(-start)?\(", hlo)),
                    len(re.findall(r"f32\[2,2,16,4,4,4\]\{[\d,]*\} all-gather(-start)?\(", hlo)))
  # (all-reduces of the prediction, all-gathers of the rounds' stacked window predictions [2, 2, C, Lw, ...])
  assert counts["W=2,U=2,R=1"] == (1, 0) and counts["U=2,R=1"][0] == 0, counts


def test_ti2v_windows_give_the_first_window_the_image(tmp_path):
  """Wan 2.2 TI2V (per-token timesteps, the first frame's latents in the input) in windows: a one-step
  run is the blend of window 0's own image-to-video run and the later windows' own text-to-video runs
  (each window sees its slice of the per-token timesteps: 0 on the image's tokens, only in window 0).
  Control: giving every window the image (the later windows' own runs with it) is another result."""
  from tests.pipelines.wan.conditioning import test_ti2v

  folder = str(tmp_path / "ti2v")
  test_ti2v._save_folder(folder)
  pipe = WanPipeline.from_pretrained(folder)
  pipe.set_progress_bar_config(disable=True)
  image = test_ti2v._image()[0].transpose(1, 2, 0)
  noise = np.random.default_rng(7).standard_normal((1, 8, 9, 4, 6)).astype(np.float32)
  kw = dict(prompt=test_ti2v.PROMPT, negative_prompt=test_ti2v.NEGATIVE, height=64, width=96, num_inference_steps=1,
            guidance_scale=4.0, max_sequence_length=16, decode=False, image=image)
  got = pipe.run(num_frames=33, latents=noise, context_frames=13, context_overlap=4, **kw).latents
  windows = ContextWindows(frames=9, length=4, overlap=1)
  parts = [pipe.run(num_frames=13, latents=noise[:, :, s:s + 4].copy(), **(kw if s == 0 else kw | {"image": None}))
           .latents for s in windows.starts]
  want = np.zeros_like(got, np.float64)
  counts = windows.counts()
  for part, s in zip(parts, windows.starts):
    want[:, :, s:s + 4] += part * (windows.weights() / counts[s:s + 4])[:, None, None]
  err = np.abs(got - want).max()
  print(f"TI2V windows: max |windowed - blend of windows| = {err:.2e}")
  assert err < 1e-5 * np.abs(want).max()
  imaged = pipe.run(num_frames=13, latents=noise[:, :, 3:7].copy(), **kw).latents
  assert np.abs(imaged - parts[1]).max() > 1e-3  # the image in a later window would change it
