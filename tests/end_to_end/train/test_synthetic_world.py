"""The synthetic shapes world: grammar, renderer and the acceptance detector (positive and negative
controls on rendered clips)."""

import itertools

import numpy as np
import pytest

from end_to_end.train import synthetic_world as world


def _scene(colour, shape, motion, seed=0):
  return world.random_scene(np.random.default_rng(seed), colour=colour, shape=shape, motion=motion)


def test_grammar_round_trips_and_rejects_other_words():
  prompts = world.all_prompts()
  assert len(prompts) == len(set(prompts)) == 5 * 3 * 5
  assert "a red square moving right" in prompts and "a yellow triangle standing still" in prompts
  for p in prompts:
    assert world.prompt_for(*world.parse_prompt(p)) == p
  with pytest.raises(ValueError, match="not in the grammar"):
    world.parse_prompt("a purple square moving right")
  with pytest.raises(ValueError, match="not in the grammar"):
    world.prompt_for("red", "hexagon", "moving up")


def test_render_shape_size_colour_and_background():
  scene = _scene("blue", "square", "moving down", seed=3)
  assert world.render(scene).shape == (world.FRAMES, world.HEIGHT, world.WIDTH, 3)
  H = W = 128
  video = world.render(scene, height=H, width=W)
  assert video.shape == (world.FRAMES, H, W, 3) and video.dtype == np.float32
  # background untouched where the shape never goes; the shape's interior exactly its colour
  np.testing.assert_array_equal(video[:, 0, 0], np.broadcast_to(np.float32(world.BACKGROUND), (world.FRAMES, 3)))
  cx, cy = scene.centre(8, height=H, width=W)
  np.testing.assert_allclose(video[8, int(cy * H), int(cx * W)], world.COLOURS["blue"], atol=1e-6)
  inside = np.abs(video - np.asarray(world.BACKGROUND)).max(-1) > 0.5
  side = scene.size * H
  # the drawn side is the exact one rounded to whole pixels (up to 1 px each way): area within 2.5/side
  np.testing.assert_allclose(inside.mean(axis=(1, 2)), side * side / H / W, rtol=2.5 / side)
  np.testing.assert_array_equal(world.render(scene, height=H, width=W, only=[2, 11]), video[[2, 11]])


@pytest.mark.parametrize("motion", list(world.MOTIONS))
def test_detector_sees_every_colour_and_motion(motion):
  """Positive controls: every colour with this motion, shapes in turn, two draws each."""
  for i, (colour, seed) in enumerate(itertools.product(world.COLOURS, (0, 1))):
    prompt = world.prompt_for(colour, world.SHAPES[i % 3], motion)
    scene = world.random_scene(np.random.default_rng(seed), *world.parse_prompt(prompt))
    ok, reason = world.check(world.render(scene, height=128, width=128), prompt)
    assert ok, f"{prompt} (seed {seed}): {reason}"


def test_detector_negative_controls():
  right = world.render(_scene("red", "circle", "moving right"), height=128, width=128)
  still = world.render(_scene("green", "triangle", "standing still"), height=128, width=128)
  assert world.check(right, "a red circle moving right")[0]
  for prompt, video, why in [
      ("a green circle moving right", right, "wrong colour"),
      ("a red circle moving left", right, "moved"),
      ("a red circle moving up", right, "moved"),
      ("a red circle standing still", right, "moved"),
      ("a green triangle moving down", still, "moved"),
      ("a white triangle standing still", still, "wrong colour"),
  ]:
    ok, reason = world.check(video, prompt)
    assert not ok and why in reason, (prompt, reason)
  blank = np.broadcast_to(np.asarray(world.BACKGROUND, np.float32), right.shape)
  assert "no object" in world.check(blank, "a red square standing still")[1]
  noise = np.random.default_rng(0).random(right.shape, np.float32)
  assert not any(world.check(noise, f"a {c} square standing still")[0] for c in world.COLOURS)
  # a shape that moves only 15 % of the frame is neither moving (>= 20 %) nor still (< 10 %)
  short = world.Scene("white", "square", "moving up", 0.25, (0.5, 0.6), 0.15)
  video = world.render(short, height=128, width=128)
  assert not world.check(video, "a white square moving up")[0]
  assert not world.check(video, "a white square standing still")[0]
  with pytest.raises(ValueError, match="frames >= 2"):
    world.detect(right[:1])


def test_colour_by_frame_names_each_frames_colour_at_the_models_size():
  """Every colour and shape rendered at the tiny models' 64x64 (soft edges, the smallest shapes):
  every frame's dominant colour is the named one. Negative controls: a frame recoloured to the
  neighbouring colour is named so, and only that frame; a frame without the shape is None."""
  rng = np.random.default_rng(3)
  for colour in world.COLOURS:
    for shape in world.SHAPES:
      clip = world.render(world.random_scene(rng, colour, shape, "moving left"))
      assert world.colour_by_frame(clip) == [colour] * len(clip), (colour, shape)
  clip = world.render(world.random_scene(rng, "green", "triangle", "moving down"))
  bg = np.asarray(world.BACKGROUND, np.float32)
  shape_px = np.abs(clip[5] - bg).max(axis=-1) > world.DIFF_THRESHOLD
  clip[5][shape_px] = world.COLOURS["blue"]
  clip[9] = bg
  seen = world.colour_by_frame(clip)
  assert seen[5] == "blue" and seen[9] is None and seen[:5] == ["green"] * 5 and seen[10:] == ["green"] * 7
  with pytest.raises(ValueError, match=r"\[frames, height, width, 3\]"):
    world.colour_by_frame(clip[0])


# --- slow motions and the long-video rule (end_to_end.train.long_clips, issue: long videos) ----------

def test_slow_scenes_stay_in_frame_over_65_frames_and_pass_both_rules():
  """Every slow motion, many draws: the shape stays inside the frame for all 65 frames, a 17-frame
  window passes `check` (its slow threshold) and the whole clip `check_long`; the fast rule's
  threshold would refuse the window (the slow rule is what lets it pass)."""
  rng = np.random.default_rng(0)
  prompts = world.slow_prompts()
  assert len(prompts) == len(set(prompts)) == 5 * 3 * 4 and not set(prompts) & set(world.all_prompts())
  for motion in list(world.SLOW_MOTIONS) + ["standing still"]:
    for _ in range(20):
      scene = world.random_scene(rng, motion=motion)
      for f in (0, world.SLOW_FRAMES - 1):
        half = scene.size / 2
        assert all(half <= c <= 1 - half for c in scene.centre(f, world.SLOW_FRAMES))
    video = world.render(scene, frames=world.SLOW_FRAMES)
    assert world.check_long(video, scene.prompt)[0], (scene, world.check_long(video, scene.prompt))
    assert world.check(video[24:41], scene.prompt)[0]
    if motion != "standing still":
      dx, dy = world.DIRECTIONS[motion]
      d = world.detect(video[24:41]).displacement
      assert d[0] * dx + d[1] * dy < world.MOVE_MIN  # slower than the fast motions' bar


def _long(motion="moving slowly right", seed=1):
  scene = world.random_scene(np.random.default_rng(seed), colour="red", shape="square", motion=motion)
  return scene, world.render(scene, frames=world.SLOW_FRAMES)


def test_long_rule_negative_controls():
  """What the long-video acceptance must refuse: a reset at a window boundary (the clip restarting),
  a second shape, another colour in one span, motion the wrong way, a shape that stops."""
  scene, video = _long()
  assert world.check_long(video, scene.prompt)[0]  # the positive control
  reset = np.concatenate([video[:33], video[:32]])
  assert "jumps" in world.check_long(reset, scene.prompt)[1]
  two = video.copy()
  two[40:, :, :, :] = np.maximum(video[40:], np.roll(video[40:], 32, axis=2))
  assert "exactly one shape" in world.check_long(two, scene.prompt)[1]
  green = video.copy()
  green[48:] = np.where(np.abs(video[48:] - video[0, 0, 0]).max(-1, keepdims=True) > 0.25,
                        np.asarray(world.COLOURS["green"], np.float32), video[48:])
  assert "colour" in world.check_long(green, scene.prompt)[1]
  assert not world.check_long(video[::-1], scene.prompt)[0]
  stops = np.concatenate([video[:33], np.repeat(video[32:33], 32, axis=0)])
  assert not world.check_long(stops, scene.prompt)[0]
  still, still_video = _long("standing still")
  assert world.check_long(still_video, still.prompt)[0] and not world.check_long(video, still.prompt)[0]
  with pytest.raises(ValueError, match="frames"):
    world.check_long(video[:17], scene.prompt)
