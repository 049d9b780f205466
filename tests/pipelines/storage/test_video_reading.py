"""Tests for pipelines/storage/video_reading.py: an mp4 reads as imageio's ffmpeg reader decodes it,
without the os.fork() deadlock warning that reader gives once JAX runs threads (its child runs
Python: os.setpgrp); a file ffmpeg cannot decode is a ValueError naming it. (Reading given videos on
the command line: tests/pipelines/cli/test_video_flags.py.)"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from pipelines.storage import video_io, video_reading


def test_mp4_reads_as_imageio_reads_it_without_a_fork_warning(tmp_path):
  import imageio.v2 as imageio
  import jax.numpy as jnp

  jnp.ones(3).block_until_ready()  # JAX's threads run: its at-fork hook warns from now on
  path = str(tmp_path / "in.mp4")
  video_io.write_video(np.random.default_rng(0).random((9, 32, 48, 3), dtype=np.float32), path)
  with pytest.warns(RuntimeWarning, match=r"os\.fork\(\) was called"):  # the control: imageio's reader
    with imageio.get_reader(path, "ffmpeg") as reader:
      want = np.stack([np.asarray(frame)[..., :3] for frame in reader])
  with warnings.catch_warnings(record=True) as seen:  # recorded: one raised in an at-fork hook is not raised
    warnings.simplefilter("always")
    got = video_reading.read_video(path)
    first = video_reading.read_video(path, max_frames=4)
  assert not seen, [str(w.message) for w in seen]
  assert got.shape == (9, 32, 48, 3) and got.dtype == np.uint8
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(first, want[:4])


def test_a_file_ffmpeg_cannot_decode_is_named(tmp_path):
  path = tmp_path / "broken.mp4"
  path.write_bytes(b"not a video")
  with pytest.raises(ValueError, match=r"broken.mp4' cannot be read as a video \(EncodeError: ffmpeg decoding"):
    video_reading.read_video(str(path))
