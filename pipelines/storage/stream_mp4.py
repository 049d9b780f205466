"""An H.264 MP4 written while its frames are made: fragmented (an empty `moov`, then one `moof` +
`mdat` fragment per frame), so the file on disk plays at every point of the run.

One ffmpeg (imageio-ffmpeg's) runs for the whole video, fed raw RGB frames on its stdin: libx264
with `-tune zerolatency` (no lookahead, no B-frames: each frame's packet comes out as the frame goes
in) and the mp4 muxer's `frag_every_frame` with `empty_moov` and `default_base_moof` (the form
browsers' Media Source Extensions and every player read). `append` returns once the file holds
every frame sent but the last: MP4 stores a frame's duration with it, so the muxer writes a
fragment when the next frame's timestamp is known (the last one at `close`). The video grows under
`streaming_path(path)` and is renamed to `path` when `close` has read it back whole (the frame count
and size sent), so the final name appears only complete, as every other output (`video_io`).
"""

from __future__ import annotations

import fractions
import os
import subprocess
import tempfile
import time
import warnings

import numpy as np

from pipelines.storage import video_io

FRAGMENT_WAIT_S = 120.0  # longest wait for ffmpeg to write a chunk's fragments before it is called stuck


def streaming_path(path: str) -> str:
  """Where the video grows while it is made: OUT.mp4 -> OUT.streaming.mp4."""
  stem, suffix = os.path.splitext(path)
  return f"{stem}.streaming{suffix}"


def complete_boxes(path: str, start: int = 0) -> tuple[bytes, list[bytes]]:
  """(the bytes, the types) of the complete top-level boxes of an MP4 file from byte `start` (a box
  boundary) on; a box still being written is left out. A missing file has none."""
  try:
    with open(path, "rb") as f:
      f.seek(start)
      data = f.read()
  except FileNotFoundError:
    return b"", []
  kinds, at = [], 0
  while at + 8 <= len(data):
    size, kind = int.from_bytes(data[at:at + 4], "big"), data[at + 4:at + 8]
    if size == 1 and at + 16 <= len(data):
      size = int.from_bytes(data[at + 8:at + 16], "big")
    if size < 8 or at + size > len(data):
      break
    kinds.append(kind)
    at += size
  return data[:at], kinds


def count_fragments(path: str) -> int:
  """Complete `moof` boxes at the top level of an MP4 file (0 for a missing or empty file)."""
  return complete_boxes(path)[1].count(b"moof")


class StreamingMp4:
  """A fragmented MP4 that grows chunk by chunk (module doc).

  Args:
    path: the final .mp4 (refused, as its `streaming_path`, if it exists and not `overwrite`, before
      ffmpeg starts).
    fps: frames per second (`video_io.check_fps`).
    height, width: the frames' size, even (H.264 yuv420p).

  Raises:
    OutputError: a path that is not .mp4, an existing output without `overwrite`, odd sizes.
  """

  def __init__(self, path: str, *, fps: float, height: int, width: int, overwrite: bool = False):
    if video_io.output_kind(path) != "mp4":
      raise video_io.OutputError(f"a stream writes an .mp4 as it is made; got {path!r}")
    for target in (path, streaming_path(path)):
      video_io.check_output(target, overwrite=overwrite, sidecar=False)
    if height % 2 or width % 2:
      raise video_io.OutputError(f"an H.264 stream needs an even size, got {height}x{width}")
    self.path, self.partial, self.shape = path, streaming_path(path), (height, width)
    self.overwrite, self.frames = overwrite, 0
    self._scanned, self._fragments, self._taken = 0, 0, 0  # bytes read for counting; moofs seen; bytes taken
    rate = fractions.Fraction(video_io.check_fps(fps)).limit_denominator(1_000_000)
    self._log = tempfile.TemporaryFile()
    import imageio_ffmpeg
    with warnings.catch_warnings():  # fork + exec: no Python runs in the child (video_io.run_ffmpeg)
      warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
      self._ffmpeg = subprocess.Popen(
          [imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24",
           "-s", f"{width}x{height}", "-r", str(rate), "-i", "-", "-an", "-c:v", "libx264", "-tune", "zerolatency",
           "-pix_fmt", "yuv420p", "-crf", "10", "-movflags", "frag_every_frame+empty_moov+default_base_moof",
           "-flush_packets", "1", "-f", "mp4", self.partial],
          stdin=subprocess.PIPE, stderr=self._log, start_new_session=True)

  def append(self, frames: np.ndarray) -> None:
    """Sends frames float [T, H, W, 3] in [0, 1]; returns once the file on disk holds all the frames
    sent but the last (module doc).

    Raises:
      EncodeError: ffmpeg exited, or wrote nothing for `FRAGMENT_WAIT_S`; OutputError: another size.
    """
    if tuple(frames.shape[1:3]) != self.shape:
      raise video_io.OutputError(f"frames of {frames.shape[1:3]} sent to a {self.shape} stream")
    try:
      self._ffmpeg.stdin.write(video_io.to_uint8(frames).tobytes())
      self._ffmpeg.stdin.flush()
    except BrokenPipeError:
      self._failed("stopped taking frames")
    self.frames += frames.shape[0]
    deadline = time.monotonic() + FRAGMENT_WAIT_S
    while self._written_fragments() < self.frames - 1:
      if self._ffmpeg.poll() is not None:
        self._failed(f"exited with status {self._ffmpeg.returncode}")
      if time.monotonic() > deadline:
        self._failed(f"wrote {self._fragments} of {self.frames - 1} frames in {FRAGMENT_WAIT_S:.0f} s")
      time.sleep(0.01)

  def _written_fragments(self) -> int:
    """Fragments in the growing file, reading only the bytes after those already counted."""
    data, kinds = complete_boxes(self.partial, self._scanned)
    self._scanned += len(data)
    self._fragments += kinds.count(b"moof")
    return self._fragments

  def take_bytes(self) -> bytes:
    """The file's complete boxes written since the last call (from its start on the first; the final
    name's once closed): consecutive results concatenated are the file, e.g. segments to send."""
    data, _ = complete_boxes(self.partial if os.path.exists(self.partial) else self.path, self._taken)
    self._taken += len(data)
    return data

  def close(self) -> tuple[int, int, int]:
    """Ends the video, reads it back and renames it to `path`; returns (frames, height, width) read.

    Raises:
      EncodeError: ffmpeg failed, or the file reads back with other frames or size than sent.
    """
    self._ffmpeg.stdin.close()
    if self._ffmpeg.wait() != 0:
      self._failed(f"exited with status {self._ffmpeg.returncode}")
    read = video_io.read_back_mp4(self.partial)
    if read != (self.frames, *self.shape):
      raise video_io.EncodeError(f"{self.partial} reads back as {read} (frames, height, width), "
                                 f"not the {(self.frames, *self.shape)} sent; it is left there")
    video_io.check_output(self.path, overwrite=self.overwrite, sidecar=False)
    os.replace(self.partial, self.path)
    self._log.close()
    return read

  def abort(self) -> None:
    """Stops ffmpeg and leaves the partial file (playable up to its last fragment) where it is."""
    if self._ffmpeg.poll() is None:
      self._ffmpeg.kill()
      self._ffmpeg.wait()
    if not self._log.closed:
      self._log.close()

  def _failed(self, what: str) -> None:
    self._log.seek(0)
    lines = self._log.read().decode(errors="replace").strip().splitlines()[:10]
    self.abort()
    raise video_io.EncodeError(f"ffmpeg, writing the stream {self.partial}, {what}: "
                               + ("\n".join(lines) or "(no message)"))
