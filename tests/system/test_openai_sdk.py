"""`serve` driven by the official `openai` SDK, unmodified and without extra headers, over a real
uvicorn server: create (the SDK's multipart form), poll, create_and_poll, retrieve, list in both
orders, download_content for each variant, remix, delete, models; and `input_reference` with a PNG
on a TI2V model, whose video must start from the image (the first frame its VAE reconstruction),
and a PNG or an mp4 on a VACE model (a reference image; the video VACE conditions on).

Our own fields travel as the SDK's `extra_body` (form fields beside its own).
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

openai = pytest.importorskip("openai")

from pipelines.commands.presets import PRESETS  # noqa: E402
from pipelines.serve.app import create_app  # noqa: E402
from pipelines.serve.main import build_service  # noqa: E402
from pipelines.serve.options import ServeConfig  # noqa: E402
from tests.harness import http_thread  # noqa: E402
from tests.numerics import assert_psnr_at_least  # noqa: E402

# The SDK marks its videos resource deprecated (OpenAI's hosted Sora API); the protocol is what we serve.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
SMALL = {"num_frames": 5, "num_inference_steps": 3, "seed": 7}


def _client(url: str) -> openai.OpenAI:
  return openai.OpenAI(base_url=f"{url}/v1", api_key="not-checked", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  """(service, SDK client) of a tiny-default server on a real uvicorn thread."""
  config = ServeConfig(model="tiny", data_dir=str(tmp_path_factory.mktemp("sdk") / "data"), max_batch=1)
  service = build_service(config)
  service.start(block=True)
  with http_thread(create_app(service)) as url:
    yield service, _client(url)
  service.stop()


def _image(kind: str, data: bytes) -> tuple[str, tuple[int, int]]:
  import PIL.Image

  with PIL.Image.open(io.BytesIO(data)) as image:
    return image.format, image.size


def test_sdk_create_poll_list_download_remix_delete(server):
  service, client = server
  first = client.videos.create(prompt="a red fox running", size="32x32", extra_body={**SMALL, "output_format": "npy"})
  assert first.status == "queued" and first.object == "video" and first.model == "tiny", first
  done = client.videos.poll(first.id)
  assert done.status == "completed" and done.progress == 100 and done.size == "32x32", done
  assert done.completed_at >= done.created_at and done.expires_at is None and done.error is None
  second = client.videos.create_and_poll(prompt="a blue bird", size="32x32", seconds="0.25",
                                         extra_body={"num_inference_steps": 3, "seed": 8})
  assert second.status == "completed" and second.seconds == "0.25", second  # 0.25 s at 16 fps: 5 frames
  assert client.videos.retrieve(second.id).prompt == "a blue bird"

  asc = [v.id for v in client.videos.list(order="asc").data]
  desc = [v.id for v in client.videos.list(order="desc").data]
  assert asc[-2:] == [first.id, second.id] and desc[:2] == [second.id, first.id], (asc, desc)
  paged = client.videos.list(order="asc", limit=1, after=first.id).data
  assert [v.id for v in paged] == [second.id]

  frames = np.load(io.BytesIO(client.videos.download_content(first.id).read()))
  assert frames.shape == (5, 32, 32, 3) and frames.std() > 0.01
  mp4 = client.videos.download_content(second.id, variant="video").read()
  assert mp4[4:8] == b"ftyp", mp4[:16]  # the video itself
  from pipelines.storage import video_tags
  tags = video_tags.read_metadata(service.content_path(service.store.get(second.id)))
  assert tags["title"] == "a blue bird" and json.loads(tags["comment"])["seed"] == 8, tags  # as generate tags it
  thumbnail = client.videos.download_content(first.id, variant="thumbnail").read()
  assert _image("thumbnail", thumbnail) == ("WEBP", (32, 32))
  import PIL.Image
  shown = np.asarray(PIL.Image.open(io.BytesIO(thumbnail)).convert("RGB"))
  np.testing.assert_array_equal(shown, np.clip(np.rint(frames[0] * 255), 0, 255).astype(np.uint8))  # lossless
  sheet_format, (sheet_w, sheet_h) = _image("spritesheet", client.videos.download_content(
      first.id, variant="spritesheet").read())
  assert sheet_format == "JPEG" and sheet_w > 5 * 32 and sheet_h > 32  # the 5 frames side by side

  remixed = client.videos.remix(first.id, prompt="the fox, at night")
  assert remixed.remixed_from_video_id == first.id and remixed.size == "32x32", remixed
  remixed = client.videos.poll(remixed.id)
  assert remixed.status == "completed", remixed
  night = np.load(io.BytesIO(client.videos.download_content(remixed.id).read()))
  assert night.shape == frames.shape and np.mean((night - frames) ** 2) > 1e-5  # a new video, from the old one
  with pytest.raises(openai.NotFoundError):
    client.videos.remix("video_" + "0" * 24, prompt="x")

  assert [m.id for m in client.models.list().data] == ["tiny"]
  deleted = client.videos.delete(first.id)
  assert deleted.deleted is True and deleted.id == first.id and deleted.object == "video.deleted", deleted
  service.worker.paused.set()  # a queued job: DELETE forgets it too, and says deleted (it used to say None)
  queued = client.videos.create(prompt="never made", size="32x32", extra_body=SMALL)
  dropped = client.videos.delete(queued.id)
  service.worker.paused.clear()
  assert queued.status == "queued" and dropped.deleted is True and dropped.id == queued.id, dropped
  with pytest.raises(openai.NotFoundError):
    client.videos.retrieve(queued.id)
  with pytest.raises(openai.NotFoundError) as gone:
    client.videos.retrieve(first.id)
  assert gone.value.body["code"] == "not_found"
  assert not any(name.startswith(first.id) for name in __import__("os").listdir(f"{service.config.data_dir}/videos"))


def test_sdk_errors_are_openai_errors(server):
  """The SDK raises its typed errors with OpenAI's body: a bad field (400, `param`), an image on a
  text-to-video model (400 naming input_reference and the model), an unknown model."""
  _, client = server
  with pytest.raises(openai.BadRequestError) as bad:
    client.videos.create(prompt="x", size="33x32")
  assert bad.value.body["param"] == "size" and "multiple of 16" in bad.value.body["message"]
  with pytest.raises(openai.BadRequestError) as image:
    client.videos.create(prompt="x", input_reference=("first.png", _png(np.zeros((32, 32, 3), np.uint8)), "image/png"))
  error = image.value.body
  assert error["param"] == "input_reference" and "'tiny' is text-to-video: it takes a video" in error["message"]
  with pytest.raises(openai.BadRequestError) as model:
    client.videos.create(prompt="x", model="sora-2")
  assert model.value.body["param"] == "model" and "serves 'tiny' only" in model.value.body["message"]


def test_sdk_video_input_reference_runs_video_to_video(server, tmp_path):
  """An mp4 sent as `input_reference` on a text-to-video model: a video-to-video job whose video
  equals the Python call on the decoded frames at the job's strength; the frame count comes from
  the video. Control: the same request at another strength gives another video."""
  from pipelines.storage import video_io, video_reading

  service, client = server
  y, x = np.mgrid[0:32, 0:32] / 32.0
  source = np.stack([np.stack([x, y, np.full_like(x, 0.5)], -1)] * 5).astype(np.float32)
  for f in range(5):
    source[f, 10:20, 2 + 4 * f:12 + 4 * f] = (0.9, 0.2, 0.1)
  video_io.write_video(source, str(tmp_path / "in.mp4"), fps=16)
  upload = ("in.mp4", (tmp_path / "in.mp4").read_bytes(), "video/mp4")
  extra = {"num_inference_steps": 4, "seed": 3, "strength": 0.5, "output_format": "npy"}
  job = client.videos.create_and_poll(prompt="a red fox", size="32x32", input_reference=upload, extra_body=extra)
  assert job.status == "completed" and job.model_extra["num_frames"] == 5, job
  served = np.load(io.BytesIO(client.videos.download_content(job.id).read()))
  frames = video_reading.read_video(str(tmp_path / "in.mp4"))
  pipe = service.worker.pipe
  expected = pipe("a red fox", height=32, width=32, num_frames=5, num_inference_steps=4, seed=3, video=frames,
                  strength=0.5, guidance_scale=PRESETS["tiny"].guidance[0])[0]  # serve's default for the model
  assert_psnr_at_least(served, expected, 80.0, name="served video-to-video vs the Python call")
  other = client.videos.create_and_poll(prompt="a red fox", size="32x32", input_reference=upload,
                                        extra_body={**extra, "strength": 1.0})
  assert np.mean((np.load(io.BytesIO(client.videos.download_content(other.id).read())) - served) ** 2) > 1e-5


def _png(pixels: np.ndarray) -> bytes:
  import PIL.Image

  buffer = io.BytesIO()
  PIL.Image.fromarray(pixels).save(buffer, format="PNG")
  return buffer.getvalue()


def test_sdk_input_reference_starts_a_ti2v_video(tmp_path):
  """A PNG sent as the SDK's `input_reference` on the tiny TI2V model: the video equals the Python
  call with that image (`pipe(image=...)`, checked against diffusers in test_ti2v.py), its first
  frame is the image's VAE reconstruction, and the sidecar records the image's digest. Positive
  controls: the same request without the image gives another video; a video file is refused."""
  pytest.importorskip("diffusers")
  from pipelines.pipeline.checked.image_inputs import digest, to_video_frame
  from pipelines.wan.conditioning import ti2v
  from tests.pipelines.wan.conditioning.test_ti2v import CALL, NEGATIVE, PROMPT, TI2V_PSNR_DB, _image, _save_folder

  folder = str(tmp_path / "ti2v")
  _save_folder(folder)
  pixels = (_image()[0].transpose(1, 2, 0) * 255).round().astype(np.uint8)  # [64, 96, 3]
  config = ServeConfig(model=folder, data_dir=str(tmp_path / "data"), max_batch=1)
  service = build_service(config)
  service.start(block=True)
  extra = {"num_frames": 9, "num_inference_steps": 2, "guidance_scale": 4.0, "seed": 0, "negative_prompt": NEGATIVE,
           "output_format": "npy"}
  try:
    with http_thread(create_app(service)) as url:
      client = _client(url)
      job = client.videos.create_and_poll(prompt=PROMPT, size="96x64", extra_body=extra,
                                          input_reference=("first.png", _png(pixels), "image/png"))
      assert job.status == "completed", job
      video = np.load(io.BytesIO(client.videos.download_content(job.id).read()))
      plain = client.videos.create_and_poll(prompt=PROMPT, size="96x64", extra_body=extra)
      text_only = np.load(io.BytesIO(client.videos.download_content(plain.id).read()))
      with pytest.raises(openai.BadRequestError) as refused:
        client.videos.create(prompt=PROMPT, input_reference=("clip.mp4", b"\0\0\0\x20ftypisom" + b"\0" * 64,
                                                             "video/mp4"))
      assert refused.value.body["param"] == "input_reference" and "is a video" in refused.value.body["message"]
    pipe = service.worker.pipe
    call = {k: v for k, v in CALL.items() if k != "max_sequence_length"}
    expected = pipe(PROMPT, NEGATIVE, **call, seed=0, image=pixels)[0]
    assert_psnr_at_least(video, expected, TI2V_PSNR_DB, name="served input_reference vs pipe(image=)")
    first = ti2v.encode_image(pipe.vae, to_video_frame(pixels, 64, 96)[None])  # as the pipeline encodes it
    reconstruction = pipe.decode(np.asarray(first))[0][0]
    assert_psnr_at_least(video[0], reconstruction, TI2V_PSNR_DB, name="first frame vs the image's VAE reconstruction")
    assert np.mean((text_only - video) ** 2) > 1e-4, "the image barely changes the video"
    sidecar = json.load(open(f"{config.data_dir}/videos/{job.id}.npy.json"))
    assert sidecar["settings"]["image_sha256"] == digest(pixels) == job.model_extra["input_reference_sha256"]
  finally:
    service.stop()


def test_sdk_input_reference_on_a_vace_model(tmp_path):
  """On a VACE folder an image input_reference is a reference image and a video the video VACE
  conditions on: each job equals the Python call with that input (`WanVACEPipeline`, equal to
  diffusers in test_vace_pipeline.py); remix conditions on the finished job's video; strength is
  refused (VACE does not use it). Controls: without the reference, and with another video, the
  videos differ."""
  pytest.importorskip("diffusers")
  from pipelines.pipeline.checked.image_inputs import digest
  from pipelines.storage import video_io, video_reading
  from tests.pipelines.pipeline.vace_folder import build_vace_folder

  folder = build_vace_folder(str(tmp_path / "vace"))
  config = ServeConfig(model=folder, data_dir=str(tmp_path / "data"), max_batch=1)
  service = build_service(config)
  service.start(block=True)
  extra = {"num_inference_steps": 2, "seed": 0, "output_format": "npy"}
  reference = np.zeros((20, 28, 3), np.uint8)
  reference[4:16, 6:22] = (230, 40, 30)
  y, x = np.mgrid[0:32, 0:48] / 48.0
  source = np.stack([np.stack([x, y, np.full_like(x, 0.5)], -1)] * 5).astype(np.float32)
  video_io.write_video(source, str(tmp_path / "in.mp4"), fps=16)
  clip = ("in.mp4", (tmp_path / "in.mp4").read_bytes(), "video/mp4")

  def run(client, **kwargs):
    job = client.videos.create_and_poll(prompt="a red fox", size="48x32", **kwargs)
    assert job.status == "completed", job
    return job, np.load(io.BytesIO(client.videos.download_content(job.id).read()))

  try:
    with http_thread(create_app(service)) as url:
      client = _client(url)
      job, referenced = run(client, input_reference=("ref.png", _png(reference), "image/png"),
                            extra_body={**extra, "num_frames": 5})
      _, plain = run(client, extra_body={**extra, "num_frames": 5})
      _, conditioned = run(client, input_reference=clip, extra_body=extra)
      remixed = client.videos.poll(client.videos.remix(job.id, prompt="a blue fox").id)
      assert remixed.status == "completed" and remixed.remixed_from_video_id == job.id, remixed
      with pytest.raises(openai.BadRequestError) as refused:
        client.videos.create(prompt="x", input_reference=clip, extra_body={"strength": 0.5})
      assert refused.value.body["param"] == "strength", refused.value.body
    pipe = service.worker.pipe
    call = dict(height=32, width=48, num_frames=5, num_inference_steps=2, seed=0)
    assert_psnr_at_least(referenced, pipe("a red fox", reference_images=[reference], **call)[0], 80.0,
                         name="served reference image vs the Python call")
    frames = video_reading.read_video(str(tmp_path / "in.mp4"))
    assert_psnr_at_least(conditioned, pipe("a red fox", video=frames, **call)[0], 80.0,
                         name="served VACE video vs the Python call")
    assert remixed.model_extra["input_reference_sha256"] == digest(
        video_reading.read_video(service.content_path(service.store.get(job.id))))
    assert np.mean((plain - referenced) ** 2) > 1e-5 and np.mean((plain - conditioned) ** 2) > 1e-5
  finally:
    service.stop()
