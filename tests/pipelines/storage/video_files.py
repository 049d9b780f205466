"""Helpers of the video-file tests (tests/pipelines/storage/test_video_io.py and the command's, in
tests/pipelines/cli/): reading an mp4 back with ffmpeg, and an ffmpeg that fails when encoding."""

from __future__ import annotations


def _decode_mp4(path: str) -> tuple[tuple[int, int], int]:
  """((width, height), frame count) as ffmpeg reads the file back."""
  import imageio_ffmpeg
  reader = imageio_ffmpeg.read_frames(path)
  meta = next(reader)
  return tuple(meta["size"]), sum(1 for _ in reader)


def _fake_ffmpeg(tmp_path, mode: str) -> str:
  """An ffmpeg that breaks when encoding (its input is stdin, "-i -") and is the real one otherwise:
  "fail" exits 3 with a message, "silent" exits 0 having written an empty file (what ffmpeg does
  when the mp4 muxer refuses a frame rate)."""
  import imageio_ffmpeg
  broken = {"fail": "echo 'fake encoder: refusing this input' >&2; exit 3",
            "silent": 'for last; do :; done; : > "$last"; exit 0'}[mode]
  script = tmp_path / f"ffmpeg_{mode}"
  script.write_text(f"""#!/bin/sh
case " $* " in *" -i - "*) ;; *) exec '{imageio_ffmpeg.get_ffmpeg_exe()}' "$@";; esac
{broken}
""")
  script.chmod(0o755)
  return str(script)
