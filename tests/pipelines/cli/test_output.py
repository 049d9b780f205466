"""Tests for pipelines/cli/output.py: what `generate` writes: a GIF with its contact sheet and JSON
sidecar (the frame rate a GIF stores, the warnings seen), an output that exists refused without
--overwrite, and a frames folder written from the same frames.
"""

from __future__ import annotations

import json
import os

import numpy as np
from PIL import Image
import pytest

from pipelines.cli import generate
from pipelines.storage import video_io
from tests.pipelines.cli.test_generate import PROMPT


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


def test_vae_dtype_decodes_in_bfloat16_near_the_float32_video(tmp_path):
  """`--vae-dtype bfloat16`: the sidecar records it and the video is the float32 one to bf16 rounding
  (> 30 dB: bf16 keeps 8 bits of mantissa through the decoder's ~20 layers), not equal to it (the
  positive control: the flag reaches the VAE)."""
  argv = ["--prompt", PROMPT, "--size", "80x48", "--frames", "9", "--steps", "2", "--seed", "1",
          "--max-sequence-length", "32"]
  videos = {}
  for dtype in ("float32", "bfloat16"):
    out = tmp_path / f"{dtype}.npy"
    assert generate.main(argv + ["--out", str(out), "--vae-dtype", dtype]) == 0
    sidecar = json.loads((tmp_path / f"{dtype}.npy.json").read_text())
    assert sidecar["settings"]["vae_dtype"] == dtype, sidecar["settings"]
    videos[dtype] = np.load(out).astype(np.float64)
  a, b = videos["float32"], videos["bfloat16"]
  assert a.shape == b.shape and not np.array_equal(a, b)
  span = a.max() - a.min()
  assert 10 * np.log10(span ** 2 / np.mean((a - b) ** 2)) > 30
