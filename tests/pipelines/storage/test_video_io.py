"""Tests for pipelines/storage/video_io.py: writing and reading back videos (mp4, GIF, a frames
folder) and contact sheets: the frames as sent, frame rates a format can store, odd sizes, and an
encoder failure that leaves nothing behind.

The command's own use of these writers (an encoder failure as exit 1, the outputs of a run) is
tested in tests/pipelines/cli/.
"""

from __future__ import annotations

import math
import os
import re
import sys
import warnings

import numpy as np
from PIL import Image
import pytest

from pipelines.storage import video_io

from pipelines.storage import video_tags

from pipelines.storage import contact_sheet
from tests.pipelines.storage.video_files import _decode_mp4, _fake_ffmpeg


def test_contact_sheet_tiles_are_the_frames(tmp_path):
  """Every tile is the frame's uint8 pixels, each repeated zoom x zoom; columns evenly spaced."""
  rng = np.random.default_rng(0)
  videos = [rng.random((17, 24, 40, 3), dtype=np.float32) for _ in range(2)]
  assert contact_sheet.sheet_columns(17, 9) == [0, 2, 4, 6, 8, 10, 12, 14, 16]
  assert contact_sheet.sheet_columns(81, 9) == list(range(0, 81, 10)) and contact_sheet.sheet_columns(3, 9) == [0, 1, 2]
  image = contact_sheet.contact_sheet(videos, labels=["reference", "candidate"])
  zoom, gap = 4, 2  # ceil(96 / 24)
  tile_h, tile_w = 24 * zoom, 40 * zoom
  label_w = image.shape[1] - 9 * (tile_w + gap) - gap
  header_h = image.shape[0] - 2 * (tile_h + gap)
  assert label_w > 0 and header_h > 0
  for r, video in enumerate(videos):
    for c, f in enumerate(contact_sheet.sheet_columns(17, 9)):
      y, x = header_h + r * (tile_h + gap), label_w + gap + c * (tile_w + gap)
      want = video_io.to_uint8(video)[f].repeat(zoom, 0).repeat(zoom, 1)
      np.testing.assert_array_equal(image[y:y + tile_h, x:x + tile_w], want)
  path = str(tmp_path / "sheet.png")
  contact_sheet.write_contact_sheet(videos, path)
  with pytest.raises(video_io.OutputError, match="exists"):
    contact_sheet.write_contact_sheet(videos, path)
  with pytest.raises(video_io.OutputError, match="PNG"):
    contact_sheet.write_contact_sheet(videos, str(tmp_path / "sheet.jpg"))
  with pytest.raises(ValueError, match="one shape"):
    contact_sheet.contact_sheet([videos[0], videos[1][:5]])


FRAMES = np.random.default_rng(0).random((5, 16, 16, 3), dtype=np.float32)


def test_an_existing_output_names_the_python_argument(tmp_path):
  """A Python caller is told to pass overwrite=True (the command prints its own flags, --overwrite:
  tests/pipelines/cli/test_generate.py); a directory that cannot exist names no flag either."""
  (tmp_path / "old.mp4").write_bytes(b"old")
  (tmp_path / "old.png").write_bytes(b"old")
  writes = [lambda: video_io.write_video(FRAMES, str(tmp_path / "old.mp4")),
            lambda: video_io.write_json({}, str(tmp_path / "old.mp4")),
            lambda: contact_sheet.write_contact_sheet([FRAMES], str(tmp_path / "old.png")),
            lambda: video_io.check_output(str(tmp_path / "old.mp4" / "x.mp4"), overwrite=False)]
  for write in writes:
    with pytest.raises(video_io.OutputError) as refused:
      write()
    assert "--" not in str(refused.value), refused.value
  with pytest.raises(video_io.OutputError, match=r"old.mp4' exists; pass overwrite=True to replace it, or choose"):
    video_io.write_video(FRAMES, str(tmp_path / "old.mp4"))
  with pytest.raises(video_io.OutputError, match=r"late.json' appeared while generating; pass overwrite=True"):
    with video_io.atomic_file(str(tmp_path / "late.json"), ".json", False):
      (tmp_path / "late.json").write_text("{}")  # another writer, while this one ran
  assert (tmp_path / "old.mp4").read_bytes() == b"old"



def test_an_mp4_without_its_encoder_fails_before_any_compute(tmp_path, monkeypatch):
  """A machine without imageio-ffmpeg (a TPU host's own package index lacks it) is told at the check,
  not after the whole run; other kinds need no ffmpeg and still pass the same check (positive control)."""
  video_io.check_output(str(tmp_path / "fox.mp4"), overwrite=False)  # here imageio-ffmpeg is installed
  monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(tmp_path / "no-such-ffmpeg"))
  with pytest.raises(video_io.OutputError, match=r"fox.mp4' is an mp4 but imageio-ffmpeg finds no ffmpeg .*"
                                                 r"pip install imageio-ffmpeg"):
    video_io.check_output(str(tmp_path / "fox.mp4"), overwrite=False)
  monkeypatch.delenv("IMAGEIO_FFMPEG_EXE")
  monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # import raises ImportError
  with pytest.raises(video_io.OutputError, match=r"fox.mp4' is an mp4 but imageio-ffmpeg is not installed .*"
                                                 r"or write .npy, .gif or a folder of PNG frames"):
    video_io.check_output(str(tmp_path / "fox.mp4"), overwrite=False)
  for other in ("fox.npy", "fox.gif", "frames/"):
    video_io.check_output(str(tmp_path / other), overwrite=False)
  assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("mode,message", [
    ("fail", "ffmpeg encoding the mp4 exited with status 3: fake encoder: refusing this input"),
    ("silent", "ffmpeg decoding the mp4 back exited with status"),
])
def test_encoder_failure_leaves_nothing(tmp_path, monkeypatch, mode, message):
  """imageio-ffmpeg's writer did not raise for either: a failed encode left an empty file."""
  videos = tmp_path / "videos"
  videos.mkdir()
  monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", _fake_ffmpeg(tmp_path, mode))
  with pytest.raises(video_io.EncodeError, match=r"writing '.*fox.mp4' failed; nothing was written there: "
                                                 + re.escape(message)):
    video_io.write_video(FRAMES, str(videos / "fox.mp4"))
  assert os.listdir(videos) == []  # no empty file, no temporary file
  (videos / "old.mp4").write_bytes(b"old")  # with overwrite, a failure keeps the old output
  with pytest.raises(video_io.EncodeError):
    video_io.write_video(FRAMES, str(videos / "old.mp4"), overwrite=True)
  assert os.listdir(videos) == ["old.mp4"] and (videos / "old.mp4").read_bytes() == b"old"


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_odd_size_mp4(tmp_path):
  """17x33 frames: refused before encoding (was an empty .mp4), or padded / cropped with a warning."""
  frames = np.random.default_rng(1).random((3, 17, 33, 3), dtype=np.float32)
  with pytest.raises(video_io.OutputError, match=r"frames of 33x17 cannot be written to .*odd.mp4': mp4 "
                                                 r"\(H.264, yuv420p\) needs an even width and height; pass "
                                                 r"odd_size='pad'"):
    video_io.write_video(frames, str(tmp_path / "odd.mp4"))
  assert os.listdir(tmp_path) == []
  for odd_size, size in (("pad", (34, 18)), ("crop", (32, 16))):
    out = str(tmp_path / f"{odd_size}.mp4")
    match = rf"frames of 33x17 written as {size[0]}x{size[1]} \(odd_size='{odd_size}'\)"
    with pytest.warns(UserWarning, match=match):
      video_io.write_video(frames, out, odd_size=odd_size)
    assert _decode_mp4(out) == (size, 3)
  with pytest.raises(video_io.OutputError, match=r"odd_size='round' must be one of \('error', 'pad', 'crop'\)"):
    video_io.write_video(frames, str(tmp_path / "x.mp4"), odd_size="round")
  video_io.write_video(frames, str(tmp_path / "odd.gif"), fps=10)  # only mp4 needs even sizes


@pytest.mark.parametrize("fps", [math.inf, math.nan, 0.0, -16.0, 1e-9, 1e9, True, "16", None])
def test_write_video_refuses_fps_it_cannot_store(tmp_path, fps):
  with pytest.raises(video_io.OutputError, match=rf"fps={re.escape(repr(fps))} must be a finite number"):
    video_io.write_video(FRAMES, str(tmp_path / "fox.mp4"), fps=fps)
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fps,delay_ms,exact", [
    (60, 20, False),  # 16.7 ms: 2 cs is nearest (was 10 ms, 100 fps)
    (120, 10, False),  # 8.3 ms: 1 cs (was 0, no delay)
    (1000, 10, False),  # never 0
    (16, 60, False),  # 62.5 ms: 6 cs (16.7 fps)
    (25, 40, True),
    (100 / 3, 30, True),
    (0.001, 655350, False),  # 1000 s: the longest delay a GIF holds
])
def test_gif_delay_is_the_nearest_centisecond(tmp_path, fps, delay_ms, exact):
  from PIL import ImageSequence
  out = str(tmp_path / "clip.gif")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    video_io.write_video(FRAMES, out, fps=fps)
  rounded = [w for w in caught if issubclass(w.category, video_io.FrameRateWarning)]
  assert len(rounded) == (0 if exact else 1), [str(w.message) for w in caught]
  if not exact:
    message = str(rounded[0].message)
    assert f"{fps:g} fps" in message and f"stored as {delay_ms // 10} cs" in message
  with Image.open(out) as gif:
    assert [frame.info["duration"] for frame in ImageSequence.Iterator(gif)] == [delay_ms] * len(FRAMES)


def test_gif_of_repeated_frames_reads_back(tmp_path):
  """Pillow stores a run of identical frames once with the run's delay: still the frames sent."""
  from PIL import ImageSequence
  frames = np.repeat(FRAMES[:2], [3, 2], axis=0)
  video_io.write_video(frames, str(tmp_path / "clip.gif"), fps=10)
  with Image.open(tmp_path / "clip.gif") as gif:
    assert [frame.info["duration"] for frame in ImageSequence.Iterator(gif)] == [300, 200]


TRICKY_PROMPT = 'a "red" fox; = \\ back\nslash,\r\ttab ünïcödé 日本 🦊 # not a comment \\'  # ends in a backslash


def _tagged(tmp_path, name: str, prompt: str, parameters: dict) -> dict[str, str]:
  """Writes 3 frames of 16x16 to tmp_path/name tagged with `metadata_tags(prompt, parameters)`;
  returns `read_metadata` of the file."""
  frames = np.random.default_rng(0).random((3, 16, 16, 3), np.float32)
  path = str(tmp_path / name)
  video_io.write_video(frames, path, fps=20, metadata=video_tags.metadata_tags(prompt, parameters))
  return video_tags.read_metadata(path)


@pytest.mark.parametrize("name", ["v.mp4", "v.gif", "frames"])
def test_metadata_tags_round_trip_exactly(tmp_path, name):
  """The prompt and parameters come back exactly from each tagged format (quotes, '=', ';', '#',
  backslashes (a last one too), newline, CR, tab, non-ASCII), with the package in the JSON;
  positive control: another prompt gives other tags; a .npy has none."""
  import json

  parameters = {"prompt": TRICKY_PROMPT, "seed": 7, "steps": 4, "size": "16x16", "guidance": [5.0]}
  tags = _tagged(tmp_path, name, TRICKY_PROMPT, parameters)
  comment = json.loads(tags["comment"])
  assert tags["title"] == TRICKY_PROMPT and comment == {**parameters, "software": comment["software"]}, tags
  assert comment["software"].startswith("wan-usp-jax "), comment
  other = _tagged(tmp_path, "other_" + name, "a cat", {"seed": 8})
  assert other["title"] == "a cat" and json.loads(other["comment"])["seed"] == 8 and other != tags
  assert _tagged(tmp_path, "v.npy", "x", {}) == {}


def test_mp4_tags_longer_than_an_argument_round_trip(tmp_path):
  """A prompt over `ARGV_TAG_BYTES` (and its JSON, over Linux's 128 KiB for one argument) reaches
  ffmpeg through a file and comes back exactly; positive control: at the limit it goes as an argument."""
  import json

  prompt = (TRICKY_PROMPT + " ") * 9000  # ~ 430 KB of UTF-8
  assert len(prompt.encode("utf-8")) > 131072
  tags = _tagged(tmp_path, "long.mp4", prompt, {"prompt": prompt, "negative_prompt": prompt})
  assert tags["title"] == prompt and json.loads(tags["comment"])["negative_prompt"] == prompt
  at_limit = "x" * (video_io.ARGV_TAG_BYTES - len("title="))
  options = video_io._metadata_options({"title": at_limit, "comment": at_limit + "y"}, str(tmp_path))
  assert options[:2] == ["-metadata", f"title={at_limit}"] and options[2] == "-/metadata", options[2:]


@pytest.mark.parametrize("tags, why", [({"title": "a\0b"}, "NUL"), ({"title": "\ud800"}, "not UTF-8"),
                                       ({"a=b": "x"}, "must be a letter"), ({"title": 5}, "must be text")])
def test_tags_no_format_keeps_are_refused_before_writing(tmp_path, tags, why):
  """A NUL, a lone surrogate, a key ffmpeg or PNG cannot hold, a value not text: OutputError, no file."""
  frames = np.zeros((1, 16, 16, 3), np.float32)
  with pytest.raises(video_io.OutputError, match=why):
    video_io.write_video(frames, str(tmp_path / "v.mp4"), metadata=tags)
  assert os.listdir(tmp_path) == []


def test_another_programs_gif_comment_reads_as_text(tmp_path):
  """A GIF comment that is not our JSON object comes back as {"comment": text}, not an error."""
  path = tmp_path / "other.gif"
  Image.new("RGB", (4, 4)).save(path, comment=b"made elsewhere; not JSON")
  assert video_tags.read_metadata(str(path)) == {"comment": "made elsewhere; not JSON"}
  Image.new("RGB", (4, 4)).save(path, comment=b'["a list"]')
  assert video_tags.read_metadata(str(path)) == {"comment": '["a list"]'}
