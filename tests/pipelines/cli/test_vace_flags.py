"""`generate --video V --mask M --reference-image R --conditioning-scale S` on a VACE folder: the
written video equals the Python call (`WanVACEPipeline`) with the decoded inputs, the sidecar records
their digests and the scales; VACE flags are refused on a model without VACE, and a mask without a
video, before any weight loads."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("diffusers")

from pipelines.cli import generate  # noqa: E402
from pipelines.pipeline.checked.image_inputs import digest  # noqa: E402
from pipelines.storage import images, video_io, video_reading  # noqa: E402
from tests.numerics import FP32_VIDEO_PSNR_DB, assert_psnr_at_least  # noqa: E402
from tests.pipelines.pipeline.vace_folder import build_vace_folder  # noqa: E402

ARGS = ["--prompt", "a red square moving right", "--negative-prompt", "", "--size", "48x32", "--steps", "3",
        "--seed", "2", "--max-sequence-length", "32", "--guidance", "4"]


def _inputs(tmp_path):
  y, x = np.mgrid[0:32, 0:48] / 48.0
  video = np.stack([np.stack([x, y, np.full_like(x, 0.3)], -1)] * 9).astype(np.float32)
  for f in range(9):
    video[f, 8:20, 4 + 3 * f:16 + 3 * f] = (0.95, 0.1, 0.1)
  video_path = str(tmp_path / "in.mp4")
  video_io.write_video(video, video_path, fps=16)
  import PIL.Image

  mask = np.zeros((32, 48), np.uint8)
  mask[:, 24:] = 255
  PIL.Image.fromarray(mask).save(tmp_path / "mask.png")
  PIL.Image.fromarray(np.full((20, 28, 3), (200, 40, 90), np.uint8)).save(tmp_path / "ref.png")
  return video_path, str(tmp_path / "mask.png"), str(tmp_path / "ref.png")


def test_generate_vace_equals_the_python_call(tmp_path, capsys):
  from pipelines.pipeline.vace_pipeline import WanVACEPipeline

  folder = build_vace_folder(str(tmp_path / "vace"))
  video, mask, ref = _inputs(tmp_path)
  out = tmp_path / "out.npy"
  argv = ARGS + ["--model", folder, "--dtype", "float32", "--video", video, "--mask", mask, "--reference-image", ref,
                 "--conditioning-scale", "0.8,1.2", "--out", str(out)]
  assert generate.main(argv) == 0, capsys.readouterr().err
  written = np.load(out)
  pipe = WanVACEPipeline.from_pretrained(folder)
  pipe.set_progress_bar_config(disable=True)
  frames, mask_image, ref_image = (video_reading.read_video(video), images.read_image(mask).pixels,
                                   images.read_image(ref).pixels)
  expected = pipe("a red square moving right", "", video=frames, mask=mask_image, reference_images=[ref_image],
                  conditioning_scale=[0.8, 1.2], height=32, width=48, num_inference_steps=3, guidance_scale=4.0,
                  seed=2, max_sequence_length=32)[0]
  assert written.shape == (9, 32, 48, 3)  # the video's frames; the reference frame dropped
  assert_psnr_at_least(written, expected, FP32_VIDEO_PSNR_DB, name="generate VACE vs the Python call")
  settings = json.load(open(f"{out}.json"))["settings"]
  assert settings["vace_video_sha256"] == digest(frames) and settings["vace_mask_sha256"] == digest(mask_image[None])
  assert settings["reference_images_sha256"] == [digest(ref_image)] and settings["conditioning_scale"] == [0.8, 1.2]
  plain = tmp_path / "plain.npy"
  assert generate.main(ARGS + ["--model", folder, "--dtype", "float32", "--frames", "9", "--out", str(plain)]) == 0
  assert np.mean((np.load(plain) - written) ** 2) > 1e-4  # control: the VACE inputs change the result


@pytest.mark.parametrize("extra,words", [
    (["--reference-image", "{ref}"], "reference_images=[<uint8 array [20, 28, 3]>] given, but this model has no VACE blocks"),
    (["--conditioning-scale", "0.5"], "conditioning_scale=0.5 given, but this model has no VACE blocks"),
    (["--mask", "{mask}"], "--mask {mask} needs --video"),
    (["--reference-image", "nothing.png"], "--reference-image 'nothing.png' is not a file"),
])
def test_vace_flags_refused_before_loading(tmp_path, capsys, monkeypatch, extra, words):
  from pipelines.pipeline import wan_pipeline

  monkeypatch.setattr(wan_pipeline.WanPipeline, "from_pretrained", lambda *a, **k: pytest.fail("loaded weights"))
  _, mask, ref = _inputs(tmp_path)
  extra = [e.format(mask=mask, ref=ref) for e in extra]
  code = generate.main(ARGS + ["--frames", "9", "--out", str(tmp_path / "o.npy")] + extra)
  err = capsys.readouterr().err
  assert code == 2 and words.format(mask=mask) in err, err


def test_resume_refuses_a_changed_reference_image(tmp_path, capsys):
  """The reference image's digest is part of the run's identity: another image behind the same path
  is refused on --resume, naming the digest, and nothing is written; the same image resumes."""
  import PIL.Image

  folder = build_vace_folder(str(tmp_path / "vace"))
  _, _, ref = _inputs(tmp_path)
  ckpt = str(tmp_path / "ckpt")
  argv = ARGS + ["--model", folder, "--dtype", "float32", "--frames", "9", "--reference-image", ref,
                 "--out", str(tmp_path / "a.npy"), "--checkpoint-dir", ckpt, "--keep-checkpoint"]
  assert generate.main(argv) == 0, capsys.readouterr().err
  assert generate.main(["--resume", ckpt, "--out", str(tmp_path / "same.npy"), "--keep-checkpoint"]) == 0, (
      capsys.readouterr().err)
  np.testing.assert_array_equal(np.load(tmp_path / "same.npy"), np.load(tmp_path / "a.npy"))  # control
  PIL.Image.fromarray(np.full((20, 28, 3), (20, 200, 90), np.uint8)).save(ref)  # another image, same path
  code = generate.main(["--resume", ckpt, "--out", str(tmp_path / "b.npy")])
  err = capsys.readouterr().err
  assert code != 0 and "reference_images_sha256" in err, err
  assert not (tmp_path / "b.npy").exists()
