"""Images as displayed (pipelines/storage/images.py), through the CLI's reader (`run_plan.read_image`)
and the Python call's (`image_inputs.image_array` of a PIL image): a 16-bit grey ramp, an RGBA PNG,
a palette GIF frame, a CMYK JPEG and an EXIF-rotated JPEG each come in as the 8-bit RGB a person
sees (correlation with the expected picture > 0.99), where Pillow's plain `convert("RGB")` (the
positive control) gets the 16-bit, alpha and rotated ones wrong."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from pipelines.cli.run_plan import read_image as cli_read_image
from pipelines.pipeline.checked.image_inputs import image_array
from pipelines.storage import images

H, W = 24, 40


def _corr(a: np.ndarray, b: np.ndarray) -> float:
  a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
  return float(np.corrcoef(a, b)[0, 1])


def _picture() -> np.ndarray:
  """uint8 [H, W, 3]: gradients and a bright block off-centre (so rotations and flips show)."""
  y, x = np.mgrid[0:H, 0:W]
  rgb = np.stack([x * 255 / (W - 1), y * 255 / (H - 1), (x + y) * 255 / (W + H - 2)], axis=-1)
  rgb[2:9, 3:15] = (250, 30, 30)
  return rgb.astype(np.uint8)


def _both_readers(path) -> list[np.ndarray]:
  """The CLI's reading and the Python call's (a PIL image given as `image=`) of one file."""
  with Image.open(path) as given:
    given.load()
    return [cli_read_image(str(path)), image_array("image", given)]


def test_sixteen_bit_ramp_is_scaled_not_clipped(tmp_path):
  ramp = np.tile(np.linspace(0, 65535, W).astype(np.uint16), (H, 1))
  path = tmp_path / "ramp16.png"
  Image.fromarray(ramp).save(path)
  with Image.open(path) as raw:
    assert raw.mode.startswith("I")
    plain = np.asarray(raw.convert("RGB"))
  assert (plain == 255).mean() > 0.9  # the fault: Pillow clips 0..65535 to white
  for seen in _both_readers(path):
    assert seen.dtype == np.uint8 and seen.shape == (H, W, 3)
    assert _corr(seen[..., 0], ramp) > 0.99 and abs(int(seen.max()) - 255) <= 1 and seen.min() == 0
  assert images.describe(path)["source_mode"].startswith("I")


def test_alpha_is_composited_on_black(tmp_path):
  rgb = _picture()
  alpha = np.tile(np.linspace(0, 255, W).astype(np.uint8), (H, 1))
  path = tmp_path / "alpha.png"
  Image.fromarray(np.dstack([rgb, alpha]), "RGBA").save(path)
  expected = rgb * (alpha[..., None] / 255.0)
  with Image.open(path) as raw:
    assert _corr(np.asarray(raw.convert("RGB")), expected) < 0.99  # the alpha was dropped
  for seen in _both_readers(path):
    assert _corr(seen, expected) > 0.99 and np.abs(seen - expected).max() <= 1


def test_palette_gif_and_cmyk_jpeg_come_in_as_rgb(tmp_path):
  rgb = _picture()
  gif, cmyk = tmp_path / "frame.gif", tmp_path / "cmyk.jpg"
  Image.fromarray(rgb).quantize(64).save(gif)
  Image.fromarray(rgb).convert("CMYK").save(cmyk, quality=95)
  for path in (gif, cmyk):
    for seen in _both_readers(path):
      assert seen.shape == (H, W, 3) and _corr(seen, rgb) > 0.99, path


@pytest.mark.parametrize("orientation,turn", [(6, lambda a: np.rot90(a, k=-1)), (3, lambda a: np.rot90(a, k=2)),
                                              (2, lambda a: a[:, ::-1])])
def test_exif_orientation_is_applied(tmp_path, orientation, turn):
  """A phone's JPEG: stored pixels plus an orientation tag; read as displayed (and its displayed
  size is what `generate` takes the video's aspect from)."""
  rgb = _picture()
  path = tmp_path / f"phone{orientation}.jpg"
  exif = Image.Exif()
  exif[0x0112] = orientation
  Image.fromarray(rgb).save(path, quality=95, exif=exif)
  with Image.open(path) as raw:
    stored = np.asarray(raw.convert("RGB"))  # the JPEG's pixels as stored
  expected = turn(stored)
  assert stored.shape != expected.shape or _corr(stored, expected) < 0.99  # the fault: not turned
  for seen in _both_readers(path):
    assert seen.shape == expected.shape and _corr(seen, expected) > 0.99
  assert images.displayed_size(path) == (expected.shape[1], expected.shape[0])
  assert images.describe(path)["rotated"] is True
