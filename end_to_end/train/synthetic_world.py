"""A synthetic video world for the tiny model: one solid shape moving over a plain dark background.

Rendered by our own numpy code (no files, no downloads). Each clip shows one shape (square, circle,
triangle) in one colour (red, green, blue, yellow, white) that moves left, right, up or down, or
stands still, over a constant dark background; its prompt comes from the grammar
"a {colour} {shape} {motion}", e.g. "a red square moving right", "a yellow triangle standing still".

Also the acceptance detector (`detect`, `check`): the moving object's colour is the grammar colour
nearest (Euclidean, RGB) to the mean of the pixels that differ from the background, and its motion
is the displacement of that pixel set's centroid between the first and the last frames.

Video layout: float32 [frames, height, width, 3] in [0, 1] (the pipeline's decoded layout, one video).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.1, 0.1), "green": (0.1, 0.8, 0.2), "blue": (0.15, 0.3, 0.95),
    "yellow": (0.95, 0.85, 0.1), "white": (0.95, 0.95, 0.95)}
SHAPES = ("square", "circle", "triangle")
# Unit displacement (dx, dy) in image coordinates: x to the right, y down.
MOTIONS: dict[str, tuple[int, int]] = {
    "moving left": (-1, 0), "moving right": (1, 0), "moving up": (0, -1), "moving down": (0, 1),
    "standing still": (0, 0)}
# Slow motions: the shape crosses SLOW_TRAVEL_RANGE of the frame over SLOW_FRAMES frames (what a
# long video of this 64x64 world can show: at the motions above, 65 frames would leave the frame).
# A shorter clip of a slow scene is a window of its SLOW_FRAMES-frame render.
SLOW_MOTIONS: dict[str, tuple[int, int]] = {
    "moving slowly left": (-1, 0), "moving slowly right": (1, 0), "moving slowly up": (0, -1),
    "moving slowly down": (0, 1)}
DIRECTIONS = {**MOTIONS, **SLOW_MOTIONS}
BACKGROUND = (0.06, 0.06, 0.08)

# Defaults: the tiny model's video size (its folder's generation_defaults.json, written from
# end_to_end/train/tiny.py GENERATION_DEFAULTS).
FRAMES, HEIGHT, WIDTH = 17, 64, 64

# Rendering ranges, as fractions of the frame side: shape size, travel over the clip.
SIZE_RANGE = (0.22, 0.3)
TRAVEL_RANGE = (0.4, 0.5)
SLOW_FRAMES = 65
SLOW_TRAVEL_RANGE = (0.5, 0.62)  # at most 1 - 2 (largest size / 2 + margin) = 0.64
# The path's midpoint (the centre, for standing still) lies within this distance of the frame's
# centre, per axis: every prompt names a nearly fixed video (what a tiny model learns in minutes on
# a CPU), and seeds still move and resize the shape a little.
CENTRE_JITTER = 0.08

# Detector settings (see `detect`).
DIFF_THRESHOLD = 0.25  # max |pixel - background| over RGB for a pixel to belong to the object
MOVE_MIN = 0.2  # moving: centroid displacement in the named direction >= 20 % of the frame side
STILL_MAX = 0.1  # standing still: centroid displacement < 10 % of the frame side
# Slow motions, over 17 frames (15 frames between the first and last pairs: 0.12-0.145 rendered).
SLOW_MOVE_MIN = 0.07
# The object's mean share of each frame's pixels must lie in this range (the rendered shapes cover
# 2-9 %): an empty video, or noise where most pixels differ from the background, is no object.
COVERAGE_RANGE = (0.005, 0.4)


@dataclasses.dataclass(frozen=True)
class Scene:
  """One clip's content: the grammar's words and the rendering draws.

  Attributes:
    colour, shape, motion: keys of COLOURS, SHAPES, MOTIONS.
    size: shape side / diameter, fraction of the frame's shorter side.
    start: (x, y) centre at frame 0, fractions of width / height.
    travel: displacement over the clip, fraction of the frame side (0 for standing still).
  """
  colour: str
  shape: str
  motion: str
  size: float
  start: tuple[float, float]
  travel: float

  @property
  def prompt(self) -> str:
    return prompt_for(self.colour, self.shape, self.motion)

  def centre(self, frame: int, frames: int = FRAMES, height: int = HEIGHT, width: int = WIDTH
             ) -> tuple[float, float]:
    """(x, y) centre of the shape at `frame` of a `frames`-frame clip, fractions of width / height."""
    a = frame / max(frames - 1, 1)
    dx, dy = DIRECTIONS[self.motion]
    side = min(height, width)
    return (self.start[0] + dx * self.travel * a * side / width,
            self.start[1] + dy * self.travel * a * side / height)


def prompt_for(colour: str, shape: str, motion: str) -> str:
  """The grammar: "a {colour} {shape} {motion}".

  Raises:
    ValueError: a word the grammar does not have.
  """
  for word, known in ((colour, COLOURS), (shape, SHAPES), (motion, DIRECTIONS)):
    if word not in known:
      raise ValueError(f"{word!r} is not in the grammar; known: {list(known)}")
  return f"a {colour} {shape} {motion}"


def parse_prompt(prompt: str) -> tuple[str, str, str]:
  """Inverse of `prompt_for`: (colour, shape, motion).

  Raises:
    ValueError: a prompt outside the grammar.
  """
  for colour, shape, motion in itertools.product(COLOURS, SHAPES, DIRECTIONS):
    if prompt.strip().lower() == prompt_for(colour, shape, motion):
      return colour, shape, motion
  raise ValueError(f"{prompt!r} is not in the grammar 'a {{colour}} {{shape}} {{motion}}' with colours "
                   f"{list(COLOURS)}, shapes {list(SHAPES)}, motions {list(DIRECTIONS)}")


def all_prompts() -> list[str]:
  """Every prompt of the 17-frame grammar (5 colours x 3 shapes x 5 motions = 75), in a fixed order."""
  return [prompt_for(c, s, m) for c, s, m in itertools.product(COLOURS, SHAPES, MOTIONS)]


def slow_prompts() -> list[str]:
  """Every slow-motion prompt (5 colours x 3 shapes x 4 motions = 60), in a fixed order."""
  return [prompt_for(c, s, m) for c, s, m in itertools.product(COLOURS, SHAPES, SLOW_MOTIONS)]


def random_scene(rng: np.random.Generator, colour: str | None = None, shape: str | None = None,
                 motion: str | None = None) -> Scene:
  """Draws a scene; words not given are drawn uniformly (motions: `MOTIONS`'). The shape stays
  inside the frame all clip (a slow motion's clip: `SLOW_FRAMES` frames). A slow path's midpoint is
  anywhere it fits, not near the centre."""
  colour = colour or str(rng.choice(list(COLOURS)))
  shape = shape or str(rng.choice(SHAPES))
  motion = motion or str(rng.choice(list(MOTIONS)))
  size = float(rng.uniform(*SIZE_RANGE))
  dx, dy = DIRECTIONS[motion]
  slow = motion in SLOW_MOTIONS
  travel = 0.0 if (dx, dy) == (0, 0) else float(rng.uniform(*(SLOW_TRAVEL_RANGE if slow else TRAVEL_RANGE)))
  margin = size / 2 + 0.02
  jitter = 0.2 if slow else CENTRE_JITTER  # across the path

  def start_along(d: int) -> float:
    lo, hi = margin, 1 - margin
    if d > 0:
      hi -= travel
    elif d < 0:
      lo += travel
    if slow and d != 0:  # anywhere along the path
      return float(rng.uniform(lo, hi))
    mid = 0.5 + float(rng.uniform(-jitter, jitter))
    return float(np.clip(mid - d * travel / 2, lo, hi))

  return Scene(colour, shape, motion, size, (start_along(dx), start_along(dy)), travel)


def render(scene: Scene, frames: int = FRAMES, height: int = HEIGHT, width: int = WIDTH,
           only: Sequence[int] | None = None) -> np.ndarray:
  """Renders a scene, 2x2 supersampled (soft edges).

  Args:
    only: render just these frame indices of the `frames`-frame clip (in this order).

  Returns:
    float32 [frames or len(only), height, width, 3] in [0, 1].
  """
  ss = 2
  ys = (np.arange(height * ss, dtype=np.float32) + 0.5) / (height * ss)
  xs = (np.arange(width * ss, dtype=np.float32) + 0.5) / (width * ss)
  side = min(height, width)
  half_x, half_y = scene.size / 2 * side / width, scene.size / 2 * side / height
  colour = np.asarray(COLOURS[scene.colour], np.float32)
  background = np.asarray(BACKGROUND, np.float32)
  indices = list(range(frames)) if only is None else list(only)
  video = np.empty((len(indices), height, width, 3), np.float32)
  for out, f in enumerate(indices):
    cx, cy = scene.centre(f, frames, height, width)
    u = (xs[None, :] - cx) / half_x  # [-1, 1] across the shape
    v = (ys[:, None] - cy) / half_y
    if scene.shape == "square":
      inside = (np.abs(u) <= 1) & (np.abs(v) <= 1)
    elif scene.shape == "circle":
      inside = u * u + v * v <= 1
    else:  # triangle, apex up: |u| <= (v + 1) / 2 for v in [-1, 1]
      inside = (v <= 1) & (np.abs(u) <= (v + 1) / 2)
    cover = inside.reshape(height, ss, width, ss).mean(axis=(1, 3), dtype=np.float32)[..., None]
    video[out] = background + cover * (colour - background)
  return video


def dataset(rng: np.random.Generator, count: int, **kw) -> tuple[np.ndarray, list[str]]:
  """`count` random clips and their prompts: (float32 [count, frames, height, width, 3], prompts)."""
  scenes = [random_scene(rng) for _ in range(count)]
  return np.stack([render(s, **kw) for s in scenes]), [s.prompt for s in scenes]


@dataclasses.dataclass(frozen=True)
class Detection:
  """What `detect` sees in a video.

  Attributes:
    colour: the grammar colour nearest the object's mean RGB; None when no pixel differs.
    mean_rgb: the object's mean RGB (float, [0, 1]); None when no pixel differs.
    displacement: (dx, dy) centroid displacement from the first to the last frames, fractions of
      the width / height (x to the right, y down); None when a frame has no object pixels.
    coverage: mean fraction of each frame's pixels that belong to the object.
  """
  colour: str | None
  mean_rgb: tuple[float, float, float] | None
  displacement: tuple[float, float] | None
  coverage: float


def _object_pixels(video: np.ndarray, background: tuple[float, float, float] | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
  """(the background RGB: `background`, else the per-channel median of the whole video; the object
  mask [frames, height, width]: pixels whose max over RGB of |pixel - background| > DIFF_THRESHOLD)
  of a float32 video [frames, height, width, 3]. The one rule every detector here uses."""
  bg = np.median(video.reshape(-1, 3), axis=0) if background is None else np.asarray(background, np.float32)
  return bg, np.abs(video - bg).max(axis=-1) > DIFF_THRESHOLD


def detect(video: np.ndarray, background: tuple[float, float, float] | None = None) -> Detection:
  """The acceptance detector.

  The background is `background` if given, else the per-channel median of the whole video (the
  shape covers well under half the pixels). Object pixels: max over RGB of |pixel - background|
  > DIFF_THRESHOLD. Colour: nearest COLOURS entry to the mean RGB of all object pixels. Motion:
  centroid of the object pixels, mean over the first 2 frames vs the last 2 frames (2 frames
  each, so one frame's blur moves the estimate less).

  Args:
    video: float [frames, height, width, 3] in [0, 1], frames >= 2.

  Raises:
    ValueError: a video that is not [frames >= 2, height, width, 3].
  """
  video = np.asarray(video, np.float32)
  if video.ndim != 4 or video.shape[-1] != 3 or video.shape[0] < 2:
    raise ValueError(f"video must be [frames >= 2, height, width, 3], got {video.shape}")
  frames, height, width, _ = video.shape
  _, mask = _object_pixels(video, background)  # [frames, height, width]
  coverage = float(mask.mean())
  if not mask.any():
    return Detection(None, None, None, coverage)
  mean_rgb = video[mask].mean(axis=0)
  names = list(COLOURS)
  distances = [np.linalg.norm(mean_rgb - np.asarray(COLOURS[n])) for n in names]
  colour = names[int(np.argmin(distances))]
  ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
  centroids = []
  for f in range(frames):
    m = mask[f]
    if not m.any():
      return Detection(colour, tuple(map(float, mean_rgb)), None, coverage)
    centroids.append(((xs[m].mean() + 0.5) / width, (ys[m].mean() + 0.5) / height))
  c = np.asarray(centroids)
  k = min(2, frames // 2)
  d = c[-k:].mean(axis=0) - c[:k].mean(axis=0)
  return Detection(colour, tuple(map(float, mean_rgb)), (float(d[0]), float(d[1])), coverage)


def colour_by_frame(video: np.ndarray, background: tuple[float, float, float] | None = None) -> list[str | None]:
  """The colour that dominates each frame's object: the grammar colour nearest the most of its
  pixels (object pixels as `detect` finds them, the background the video's median unless given);
  None for a frame without object pixels. A plurality of pixels, not the nearest colour to their
  mean: the soft edges' blends with the background pull a small shape's mean off its colour.

  Args:
    video: float [frames, height, width, 3] in [0, 1].

  Raises:
    ValueError: a video that is not [frames, height, width, 3].
  """
  video = np.asarray(video, np.float32)
  if video.ndim != 4 or video.shape[-1] != 3:
    raise ValueError(f"video must be [frames, height, width, 3], got {video.shape}")
  _, mask = _object_pixels(video, background)
  names = list(COLOURS)
  palette = np.asarray([COLOURS[n] for n in names], np.float32)
  out: list[str | None] = []
  for frame, frame_mask in zip(video, mask):
    pixels = frame[frame_mask]
    if not len(pixels):
      out.append(None)
      continue
    nearest = np.argmin(((pixels[:, None] - palette[None]) ** 2).sum(axis=-1), axis=1)
    out.append(names[int(np.bincount(nearest, minlength=len(names)).argmax())])
  return out


def check(video: np.ndarray, prompt: str, background: tuple[float, float, float] | None = None
          ) -> tuple[bool, str]:
  """Does `video` show what `prompt` says? The acceptance rule: an object covering a plausible
  share of the frame (COVERAGE_RANGE), its detected colour the named one, and the centroid moves >= MOVE_MIN of the frame in the named direction (for "standing
  still": moves < STILL_MAX in total). The shape is not checked.

  Returns:
    (ok, reason): reason names what was seen.

  Raises:
    ValueError: a prompt outside the grammar, or a bad video shape (see `detect`).
  """
  colour, _, motion = parse_prompt(prompt)
  seen = detect(video, background)
  if seen.colour is None or seen.displacement is None:
    return False, f"no object in every frame (coverage {seen.coverage:.3f})"
  if not COVERAGE_RANGE[0] <= seen.coverage <= COVERAGE_RANGE[1]:
    return False, f"object coverage {seen.coverage:.3f} outside {COVERAGE_RANGE}: no single shape"
  dx, dy = DIRECTIONS[motion]
  moved = float(np.hypot(*seen.displacement))
  along = seen.displacement[0] * dx + seen.displacement[1] * dy
  what = (f"colour {seen.colour} (mean RGB {np.round(seen.mean_rgb, 2).tolist()}), displacement "
          f"({seen.displacement[0]:+.2f}, {seen.displacement[1]:+.2f})")
  if seen.colour != colour:
    return False, f"wrong colour: {what}"
  if (dx, dy) == (0, 0):
    return (moved < STILL_MAX), (what if moved < STILL_MAX else f"moved {moved:.2f} >= {STILL_MAX}: {what}")
  least = SLOW_MOVE_MIN if motion in SLOW_MOTIONS else MOVE_MIN
  if along < least:
    return False, f"moved {along:+.2f} < {least} {motion.split()[-1]}: {what}"
  return True, what


# Long-video rule (`check_long`): per SEGMENT frames the named colour and progress the named way.
SEGMENT = 16
SEGMENT_MOVE_MIN = 0.04  # slow: 0.12-0.155 per 16 frames rendered
LONG_MOVE_MIN = 0.3  # slow over 65 frames: 0.5-0.62 rendered
STEP_JUMP_MAX = 0.06  # centroid change between consecutive frames (slow: ~0.01 rendered)
PART_SHARE = 0.25  # a second group of object pixels this large against the largest is a second shape


def object_parts(mask_HW: np.ndarray) -> int:
  """Connected groups (8-connectivity, scikit-image's `label`) of object pixels at least PART_SHARE
  the size of the largest (smaller ones are a decoder's ringing at the shape's edges)."""
  from skimage.measure import label
  sizes = np.bincount(label(mask_HW, connectivity=2).ravel())[1:]
  return int(np.count_nonzero(sizes >= PART_SHARE * sizes.max())) if sizes.size else 0


def check_long(video: np.ndarray, prompt: str, colour_check: bool = True) -> tuple[bool, str]:
  """Does a long `video` (float [frames >= 2 SEGMENT, H, W, 3] in [0, 1]) keep showing `prompt`?

  Every frame: one shape (one connected group of object pixels, `object_parts`). Every SEGMENT-frame
  span: the named colour (`detect`). Motion (centroid per frame): a moving prompt advances >=
  SEGMENT_MOVE_MIN in the named direction over every span and >= LONG_MOVE_MIN over the video, and
  never jumps more than STEP_JUMP_MAX between frames (no reset at a window boundary); standing
  still moves < STILL_MAX over the video. `colour_check` False: the rest without the colour.

  Raises:
    ValueError: a prompt outside the grammar, or fewer than 2 SEGMENT frames.
  """
  colour, _, motion = parse_prompt(prompt)
  video = np.asarray(video, np.float32)
  if video.ndim != 4 or video.shape[0] < 2 * SEGMENT:
    raise ValueError(f"video must be [frames >= {2 * SEGMENT}, height, width, 3], got {video.shape}")
  frames, height, width, _ = video.shape
  bg, mask = _object_pixels(video)
  parts = [object_parts(m) for m in mask]
  if any(p != 1 for p in parts):
    bad = [f for f, p in enumerate(parts) if p != 1]
    return False, f"{len(bad)} frames without exactly one shape (first: frame {bad[0]}, {parts[bad[0]]} parts)"
  for s in range(0, frames - SEGMENT, SEGMENT) if colour_check else ():
    seen = detect(video[s:s + SEGMENT + 1], tuple(bg))
    if seen.colour != colour:
      return False, f"frames {s}-{s + SEGMENT}: colour {seen.colour}, not {colour}"
  ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
  c = np.asarray([((xs[m].mean() + 0.5) / width, (ys[m].mean() + 0.5) / height) for m in mask])
  jump = float(np.abs(np.diff(c, axis=0)).max())
  if jump > STEP_JUMP_MAX:
    return False, f"the shape jumps {jump:.2f} between frames {int(np.abs(np.diff(c, axis=0)).max(1).argmax())}+1"
  d = np.asarray(DIRECTIONS[motion], np.float32)
  total = c[-2:].mean(0) - c[:2].mean(0)
  if not d.any():
    moved = float(np.hypot(*total))
    return moved < STILL_MAX, f"moved {moved:.2f} in all (standing still: < {STILL_MAX})"
  spans = [float((c[s + SEGMENT] - c[s]) @ d) for s in range(0, frames - SEGMENT, SEGMENT)]
  if min(spans) < SEGMENT_MOVE_MIN or float(total @ d) < LONG_MOVE_MIN:
    return False, f"progress per {SEGMENT} frames {np.round(spans, 2).tolist()}, {float(total @ d):+.2f} in all"
  return True, f"progress per {SEGMENT} frames {np.round(spans, 2).tolist()}, {float(total @ d):+.2f} in all"
