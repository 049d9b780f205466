"""GET /v1/streams: the first chunk's segment reaches the client before the second chunk is made, and
the segments make the whole mp4; bad queries are refused naming the parameter."""

import base64
import json
import threading

import httpx
import pytest

from pipelines.pipeline.run import streaming
from pipelines.serve.app import create_app
from pipelines.serve.main import build_service
from pipelines.serve.options import ServeConfig
from pipelines.storage import video_io
from tests.harness import http_thread

PROMPT = "a red square moving right"


def _events(response):
  """(name, data) of each server-sent event of a streamed response."""
  name = None
  for line in response.iter_lines():
    if line.startswith("event: "):
      name = line[7:]
    elif line.startswith("data: "):
      yield name, json.loads(line[6:])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  data = tmp_path_factory.mktemp("streams") / "data"
  service = build_service(ServeConfig(model="tiny", data_dir=str(data), max_batch=1))
  service.start(block=True)
  with http_thread(create_app(service)) as url:
    yield service, url
  service.stop()


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # fork + exec of ffmpeg is safe
def test_the_first_chunk_arrives_before_the_second_is_made(served, monkeypatch, tmp_path):
  """The stream's second chunk is made only once the client holds the first segment (it would wait
  out the 120 s otherwise and the test says so); the segments and the last bytes, concatenated, are
  the server's mp4, which ffmpeg decodes to the 33 frames of three chunks."""
  service, url = served
  received_first, waited_out = threading.Event(), []
  made = streaming.stream_video

  def gated(*args, **kwargs):
    for chunk in made(*args, **kwargs):
      yield chunk
      if chunk.index == 0 and not received_first.wait(120):
        waited_out.append(True)

  monkeypatch.setattr(streaming, "stream_video", gated)
  parts, names = [], []
  with httpx.stream("GET", url + "/v1/streams", params={"prompt": PROMPT, "num_frames": 33, "seed": 1,
                                                       "prompt_at": "2:a blue circle moving up"},
                    timeout=300) as response:
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    for name, data in _events(response):
      names.append(name)
      if name == "start":
        start = data
      if name in ("segment", "done"):
        parts.append(base64.b64decode(data["data"]))
      if name == "segment" and data["index"] == 0:
        assert data["mime"].startswith('video/mp4; codecs="avc1.') and data["frames"] == 9
        received_first.set()
  assert names == ["start", "segment", "segment", "segment", "done"] and not waited_out, names
  assert start["chunks"] == 3 and start["frames"] == 33
  path = tmp_path / "joined.mp4"
  path.write_bytes(b"".join(parts))
  with open(f"{service.config.data_dir}/streams/{start['id']}.mp4", "rb") as f:
    assert path.read_bytes() == f.read()
  assert video_io.read_back_mp4(str(path)) == (33, 64, 64)


@pytest.mark.parametrize("params, param", [({"prompt": " "}, "prompt"), ({"prompt": PROMPT, "size": "60x64"}, "size"),
                                           ({"prompt": PROMPT, "num_frames": 0}, "num_frames"),
                                           ({"prompt": PROMPT, "window_frames": 2}, "window_frames"),
                                           ({"prompt": PROMPT, "prompt_at": "1:a blue circle"}, "prompt_at")])
def test_bad_queries_are_refused_naming_the_parameter(served, params, param):
  _, url = served
  answer = httpx.get(url + "/v1/streams", params=params, timeout=60)
  assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def test_a_stream_is_refused_up_front_where_no_mp4_can_be_encoded(served, monkeypatch, tmp_path):
  """No ffmpeg (IMAGEIO_FFMPEG_EXE naming a missing file): a 400 "unsupported" before any event,
  not a 200 whose only event is an error; the same query is fine again with ffmpeg back (positive
  control: only the size of the answer is read)."""
  _, url = served
  monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(tmp_path / "no-such-ffmpeg"))
  answer = httpx.get(url + "/v1/streams", params={"prompt": PROMPT, "num_frames": 0}, timeout=60)
  assert answer.status_code == 400 and answer.json()["error"]["param"] == "num_frames"  # bad values first
  answer = httpx.get(url + "/v1/streams", params={"prompt": PROMPT}, timeout=60)
  error = answer.json()["error"]
  assert answer.status_code == 400 and error["code"] == "unsupported" and "no ffmpeg" in error["message"], answer.text
  monkeypatch.delenv("IMAGEIO_FFMPEG_EXE")
  from pipelines.serve import streams
  assert streams.check_session(served[0].facts, PROMPT, None, None, 1, None).prompt == PROMPT
