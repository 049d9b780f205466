"""`generate --video PATH --strength S` (video-to-video on a text-to-video model): the written video
equals the Python call with the decoded frames (`WanVideoToVideoPipeline`), the sidecar records
the frames' SHA-256 and the strength, --resume refuses a changed video, and bad inputs are refused
before any weight loads, naming the flag."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pipelines.cli import generate
from pipelines.commands.presets import PRESETS
from pipelines.pipeline.checked.image_inputs import digest
from pipelines.storage import video_io
from pipelines.storage import video_reading
from tests.numerics import FP32_VIDEO_PSNR_DB, assert_psnr_at_least

ARGS = ["--prompt", "a red square moving right", "--size", "64x64", "--steps", "4", "--seed", "2",
        "--max-sequence-length", "16"]


def _video(path: str, frames: int = 9, shift: int = 0, overwrite: bool = False) -> str:
  y, x = np.mgrid[0:64, 0:64] / 64.0
  video = np.stack([np.stack([x, y, np.full_like(x, 0.3)], -1)] * frames).astype(np.float32)
  for f in range(frames):
    video[f, 20:36, 8 + 4 * f + shift:24 + 4 * f + shift] = (0.95, 0.1, 0.1)
  video_io.write_video(video, path, fps=16, overwrite=overwrite)
  return path


def test_generate_video_equals_the_python_call_and_records_the_input(tmp_path, capsys):
  from pipelines.pipeline.video_pipeline import WanVideoToVideoPipeline

  source = _video(str(tmp_path / "in.mp4"))
  out = tmp_path / "out.npy"
  assert generate.main(ARGS + ["--video", source, "--strength", "0.6", "--out", str(out)]) == 0, \
      capsys.readouterr().err
  written = np.load(out)
  frames = video_reading.read_video(source)
  pipe = WanVideoToVideoPipeline.tiny()
  pipe.set_progress_bar_config(disable=True)
  negative = PRESETS["tiny"].negative_prompt  # generate's default for the tiny model
  expected = pipe(frames, "a red square moving right", negative, height=64, width=64, num_inference_steps=4,
                  strength=0.6, seed=2, max_sequence_length=16, guidance_scale=PRESETS["tiny"].guidance[0])[0]
  assert written.shape == (9, 64, 64, 3)  # the video's 9 frames (no --frames)
  assert_psnr_at_least(written, expected, FP32_VIDEO_PSNR_DB, name="generate --video vs the Python call")
  settings = json.load(open(f"{out}.json"))["settings"]
  assert settings["video_sha256"] == digest(frames) and settings["strength"] == 0.6
  plain = tmp_path / "plain.npy"
  assert generate.main(ARGS + ["--frames", "9", "--out", str(plain)]) == 0
  assert np.mean((np.load(plain) - written) ** 2) > 1e-4  # control: the video changes the result


def test_resume_refuses_a_changed_video(tmp_path, capsys):
  source = _video(str(tmp_path / "in.mp4"))
  ckpt = str(tmp_path / "ckpt")
  argv = ARGS + ["--video", source, "--strength", "1.0", "--out", str(tmp_path / "a.npy"), "--checkpoint-dir", ckpt,
                 "--keep-checkpoint"]
  assert generate.main(argv) == 0, capsys.readouterr().err
  _video(source, shift=6, overwrite=True)  # another video behind the same path
  code = generate.main(["--resume", ckpt, "--out", str(tmp_path / "b.npy"), "--overwrite"])
  err = capsys.readouterr().err
  assert code != 0 and "video_sha256" in err, err
  assert not os.path.exists(tmp_path / "b.npy")


@pytest.mark.parametrize("extra,words", [
    (["--video", "missing.mp4"], "--video: 'missing.mp4' cannot be read as a video"),
    (["--video", "{video}", "--strength", "0"], "--strength: strength=0.0 must be a number in (0, 1]"),
    (["--video", "{video}", "--frames", "17"], "--frames: num_frames=17 differs from the video's 9 frames"),
    (["--video", "{video}", "--image", "{image}"], "give one"),
])
def test_bad_video_flags_are_refused_before_loading(tmp_path, capsys, monkeypatch, extra, words):
  from pipelines.pipeline import wan_pipeline

  monkeypatch.setattr(wan_pipeline.WanPipeline, "tiny", lambda *a, **k: pytest.fail("loaded weights"))
  import PIL.Image

  source = _video(str(tmp_path / "in.mp4"))
  PIL.Image.new("RGB", (64, 64)).save(tmp_path / "first.png")
  monkeypatch.chdir(tmp_path)
  argv = ARGS + [a.replace("{video}", source).replace("{image}", "first.png") for a in extra] + [
      "--out", str(tmp_path / "x.npy")]
  assert generate.main(argv) == 2
  assert words in capsys.readouterr().err
