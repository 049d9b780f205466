"""`generate --stream`: the growing mp4 plays after every chunk; the flags a stream does not use are
refused before any compute."""

import json
import os

import numpy as np
import pytest

from pipelines.cli import generate
from pipelines.pipeline import WanPipeline
from pipelines.pipeline.run.streaming import StreamSettings, stream_video
from pipelines.storage import video_io
from pipelines.storage.stream_mp4 import StreamingMp4
from pipelines.wan.causal import CacheWindow
from tests.harness import step_compiles

PROMPT = "a red square moving right"
STREAM = ["--prompt", PROMPT, "--stream", "--frames", "33", "--seed", "3", "--stream-window", "6",
          "--stream-prompt", "3:a blue circle moving up"]


def _pixels(path: str) -> np.ndarray:
  """float32 [frames, H, W, 3] in [0, 1] as ffmpeg decodes the mp4."""
  import imageio_ffmpeg
  reader = imageio_ffmpeg.read_frames(path)
  width, height = next(reader)["size"]
  return np.stack([np.frombuffer(f, np.uint8).reshape(height, width, 3) for f in reader]).astype(np.float32) / 255


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # fork + exec of ffmpeg is safe
def test_the_file_plays_after_every_chunk_and_holds_the_stream(tmp_path, monkeypatch, capsys):
  """Three chunks (33 frames), the prompt changed at chunk 3: after each chunk the growing file
  decodes to every frame made but the last; the final mp4 holds the stream's frames (those of
  `stream_video` with the same seed and prompts, to H.264's rounding at crf 10); the sidecar says
  how it was made."""
  played = []
  append = StreamingMp4.append

  def watched(self, frames):
    append(self, frames)
    played.append(video_io.read_back_mp4(self.partial)[0])

  monkeypatch.setattr(StreamingMp4, "append", watched)
  out = str(tmp_path / "s.mp4")
  assert generate.main(STREAM + ["--out", out]) == 0, capsys.readouterr().err
  err = capsys.readouterr().err
  assert played == [8, 20, 32] and "chunk 3/3: 12 frames" in err, err
  record = json.load(open(out + ".json"))
  assert record["frames"] == 33 and record["stream"]["window_frames"] == 6 and len(record["chunk_seconds"]) == 3
  assert not os.path.exists(out.replace(".mp4", ".streaming.mp4"))
  assert record["stream"]["prompts_at"] == {"2": "a blue circle moving up"}
  settings = StreamSettings(window=CacheWindow(3, 6, 0))
  expected = np.concatenate([c.frames[0] for c in stream_video(WanPipeline.tiny(), [PROMPT], num_chunks=3, height=64,
                                                               width=64, seed=3, settings=settings,
                                                               prompts_at={2: ["a blue circle moving up"]})])
  video = _pixels(out)
  assert video.shape == expected.shape
  assert float(np.mean(np.abs(video - expected))) < 0.02  # H.264 crf 10 on 64x64 frames


@pytest.mark.parametrize("extra, message", [
    (["--guidance", "3"], "--guidance does not apply to --stream (causal checkpoints run without guidance)"),
    (["--steps", "4"], "--steps does not apply to --stream (a stream's steps are --stream-steps)"),
    (["--context-frames", "17"], "--context-frames does not apply to --stream"),
    (["--stream-window", "4", "--stream-sink", "2"], "a window at least the chunk plus the sink frames (5)"),
    (["--stream-steps", "250,500"], "--stream-steps 250,500: denoising_step_list=(250.0, 500.0) must be descending"),
    (["--out-gif"], "a stream writes an .mp4 as it is made"),
    (["--stream-prompt", "1:a blue circle moving up"], "give CHUNK:PROMPT with CHUNK >= 2 (chunk 1 takes the prompt)"),
    (["--stream-prompt", "a blue circle"], "give CHUNK:PROMPT with CHUNK >= 2"),
    (["--num-processes", "2"], "--stream runs in one process"),
])
def test_flags_a_stream_does_not_use_are_refused_before_compute(tmp_path, capsys, monkeypatch, extra, message):
  compiles = step_compiles(monkeypatch)
  out = str(tmp_path / ("x.gif" if extra == ["--out-gif"] else "x.mp4"))
  argv = ["--prompt", PROMPT, "--stream", "--out", out] + ([] if extra == ["--out-gif"] else extra)
  assert generate.main(argv) == 2
  err = capsys.readouterr().err
  assert message in err, err
  assert compiles == [] and not os.path.exists(out)


def test_stream_flags_without_stream_are_refused(tmp_path, capsys):
  assert generate.main(["--prompt", PROMPT, "--stream-sink", "1", "--out", str(tmp_path / "x.mp4")]) == 2
  assert "--stream-sink sets up a stream; add --stream" in capsys.readouterr().err


def test_an_interrupted_stream_says_what_it_leaves(tmp_path, monkeypatch, capsys):
  """Ctrl-C after the first chunk: exit 130, the growing file keeps its frames and the message says so."""
  append = StreamingMp4.append

  def interrupted(self, frames):
    append(self, frames)
    raise KeyboardInterrupt

  monkeypatch.setattr(StreamingMp4, "append", interrupted)
  out = str(tmp_path / "cut.mp4")
  assert generate.main(["--prompt", PROMPT, "--stream", "--frames", "33", "--seed", "1", "--out", out]) == 130
  err = capsys.readouterr().err
  assert "cut.streaming.mp4 keeps the 8 frames written so far" in err, err
  assert video_io.read_back_mp4(out.replace(".mp4", ".streaming.mp4"))[0] == 8 and not os.path.exists(out)
