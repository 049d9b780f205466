"""The MP4 that grows while a stream runs: playable after every chunk, renamed whole at the end."""

import os

import numpy as np
import pytest

from pipelines.storage import video_io
from pipelines.storage.stream_mp4 import StreamingMp4, count_fragments, streaming_path


def _chunk(frames: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).random((frames, 48, 64, 3)).astype(np.float32)


def test_the_file_plays_after_every_chunk_and_is_renamed_whole(tmp_path):
  """Chunks of 9, 12, 12 frames: after each `append` ffmpeg decodes the growing file to every frame
  sent but the last (the muxer writes a frame with the next one's timestamp), at the size sent;
  `close` leaves 33 frames under the final name and nothing under the streaming one; the bytes
  taken after each chunk and after `close` are the file."""
  out = str(tmp_path / "stream.mp4")
  writer = StreamingMp4(out, fps=16, height=48, width=64)
  sent, taken = 0, []
  for seed, frames in enumerate((9, 12, 12)):
    writer.append(_chunk(frames, seed))
    taken.append(writer.take_bytes())
    sent += frames
    assert video_io.read_back_mp4(streaming_path(out)) == (sent - 1, 48, 64)
    assert count_fragments(streaming_path(out)) == sent - 1
    assert not os.path.exists(out)  # the final name only once whole
  assert writer.close() == (33, 48, 64)
  assert video_io.read_back_mp4(out) == (33, 48, 64) and not os.path.exists(streaming_path(out))
  taken.append(writer.take_bytes())  # the last fragment, from the final name
  assert all(taken) and b"".join(taken) == open(out, "rb").read()  # the pieces are the file, in order


def test_existing_outputs_and_odd_sizes_are_refused_before_ffmpeg_starts(tmp_path):
  out = tmp_path / "taken.mp4"
  out.write_bytes(b"x")
  with pytest.raises(video_io.OutputError, match="exists"):
    StreamingMp4(str(out), fps=16, height=48, width=64)
  (tmp_path / "left.streaming.mp4").write_bytes(b"x")
  with pytest.raises(video_io.OutputError, match="exists"):
    StreamingMp4(str(tmp_path / "left.mp4"), fps=16, height=48, width=64)
  with pytest.raises(video_io.OutputError, match="even size"):
    StreamingMp4(str(tmp_path / "odd.mp4"), fps=16, height=47, width=64)
  with pytest.raises(video_io.OutputError, match=r"\.mp4"):
    StreamingMp4(str(tmp_path / "clip.gif"), fps=16, height=48, width=64)


def test_a_stopped_stream_leaves_its_playable_part(tmp_path):
  """abort (Ctrl-C, an error): the frames written so far stay playable under the streaming name."""
  out = str(tmp_path / "cut.mp4")
  writer = StreamingMp4(out, fps=16, height=48, width=64)
  writer.append(_chunk(9, 0))
  writer.abort()
  assert video_io.read_back_mp4(streaming_path(out))[0] == 8 and not os.path.exists(out)
