"""Tests for pipelines/serve/app.py: the HTTP routes of a server whose model is not loaded (requests
are checked and queued, nothing runs): the cancel route on a job that finished meanwhile, and the
warnings a job keeps as its routes return them.

The whole HTTP contract with a loaded model, and real server processes: tests/system/test_serve.py.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pipelines.serve.app import create_app
from pipelines.serve.main import model_facts
from pipelines.serve.options import ServeConfig
from pipelines.serve.service import Service


@pytest.fixture
def unloaded(tmp_path):
  """(service, client) of a server of the tiny default whose model is never loaded."""
  config = ServeConfig(model="tiny", data_dir=str(tmp_path))
  service = Service(config, model_facts(config), load=None)
  yield service, TestClient(create_app(service))
  service.store.close()


SMALL = {"size": "32x32", "num_frames": 5, "num_inference_steps": 3, "output_format": "npy"}


def test_cancel_route_never_deletes_a_finished_job(unloaded):
  """The page's Cancel (POST .../cancel) on a job that completed before the click arrived: 409 naming
  its status, the job and its video kept (DELETE, by contrast, forgets a finished job)."""
  service, client = unloaded
  queued, done = (client.post("/v1/videos", json={**SMALL, "prompt": p}).json()["id"] for p in ("cancel", "done"))
  cancelled = client.post(f"/v1/videos/{queued}/cancel")
  assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
  again = client.post(f"/v1/videos/{queued}/cancel")
  assert again.status_code == 409 and again.json()["error"]["code"] == "not_cancellable", again.text
  assert "is cancelled already" in again.json()["error"]["message"]
  assert service.store.next_batch(1)[1][0]["id"] == done  # as the worker takes it
  service.store.complete(done, "", {})  # ... and finishes it just before the click arrives
  late = client.post(f"/v1/videos/{done}/cancel")
  assert late.status_code == 409 and "is completed already" in late.json()["error"]["message"], late.text
  assert client.get(f"/v1/videos/{done}").json()["status"] == "completed"  # kept
  assert client.post("/v1/videos/video_" + "0" * 24 + "/cancel").status_code == 404
  assert client.delete(f"/v1/videos/{done}").json() == {"id": done, "object": "video.deleted", "deleted": True,
                                                         "status": "completed"}  # DELETE forgets it


def test_delete_answers_deleted_in_every_state(unloaded):
  """DELETE forgets a job whatever its status and says so as OpenAI's SDK reads it (`deleted` true; the
  SDK's `videos.delete()` returned deleted=None for a queued job, which used to get the video
  object): queued, in_progress (hidden at once, its row kept for its batch until the batch ends) and
  finished; every route then answers 404 and the list and counts leave it out. Control: the job
  beside them stays listed and counted."""
  service, client = unloaded
  running, done, queued, kept = (client.post("/v1/videos", json={**SMALL, "prompt": p}).json()["id"]
                                 for p in ("running", "done", "queued", "kept"))
  service.store._db.execute("UPDATE jobs SET batch_key='other' WHERE id IN (?, ?)", (queued, kept))
  assert [r["id"] for r in service.store.next_batch(2)[1]] == [running, done]  # as the worker takes them
  service.store.complete(done, "", {})
  for job, status in ((queued, "queued"), (running, "in_progress"), (done, "completed")):
    answer = client.delete(f"/v1/videos/{job}")
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"id": job, "object": "video.deleted", "deleted": True, "status": status}
    assert client.get(f"/v1/videos/{job}").status_code == 404
    assert client.delete(f"/v1/videos/{job}").status_code == 404
    assert client.post(f"/v1/videos/{job}/cancel").status_code == 404
  assert [v["id"] for v in client.get("/v1/videos").json()["data"]] == [kept]
  assert service.store.counts() == {"queued": 1, "in_progress": 0, "completed": 0, "failed": 0, "cancelled": 0}


@pytest.mark.parametrize("size", ["100000x100000", "4096x64", "64x" + "9" * 5000])
def test_a_size_over_the_servers_limit_is_too_large_not_malformed(unloaded, size):
  """A well-formed size past the server's side limit is a 400 naming size that says it is too large,
  the limit and why (it said "malformed" past 5 digits; thousands of digits must not reach int()).
  Controls: a size that is not WIDTHxHEIGHT is still malformed; the limit itself is queued."""
  service, client = unloaded
  answer = client.post("/v1/videos", json={**SMALL, "prompt": "x", "size": size})
  error = answer.json()["error"]
  assert answer.status_code == 400 and error["param"] == "size", answer.text
  assert "is too large" in error["message"] and "at most 2048 pixels a side" in error["message"], error
  assert "malformed" not in error["message"] and "memory" in error["message"], error
  malformed = client.post("/v1/videos", json={**SMALL, "prompt": "x", "size": "64"}).json()["error"]
  assert "malformed" in malformed["message"], malformed
  assert client.post("/v1/videos", json={**SMALL, "prompt": "x", "size": "2048x64"}).status_code == 200
  assert service.store.counts()["queued"] == 1


def test_job_warnings_are_kept_and_returned(unloaded):
  _, client = unloaded
  trained = client.post("/v1/videos", json={"prompt": "x", "size": "64x64", "num_frames": 17}).json()
  off = client.post("/v1/videos", json={**SMALL, "prompt": "x", "num_frames": 6}).json()
  assert trained["warnings"] == [], trained
  got = client.get(f"/v1/videos/{off['id']}").json()["warnings"]
  assert got == off["warnings"] and len(got) == 2, got
  assert got[0].startswith("num_frames=6 rounded to 5") and "trained at 64x64 x 17 frames only; 32x32 x 5" in got[1]
  assert client.get("/v1/videos").json()["data"][0]["warnings"] == got  # the listing too


HOSTILE_TEXT = ["a red \ud8a0 square", "\udc00", "a\x00b", "\x01start", "ansi \x1b[2J clear", "del \x7f",
                "next line \x85", "csi \x9b", "bell \x07", "back\x08space", "form\x0cfeed", "non \ufffe char",
                "non \uffff char"]


@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
def test_hostile_text_is_refused_before_anything_is_stored(unloaded, field):
  """Each string a client could send in JSON that a job could not store and send back (lone
  surrogates, NUL and other controls, noncharacters): 400 naming the field, nothing queued, the
  list and the page as before. Positive control: tab, newline and any printable text are kept."""
  import json

  service, client = unloaded
  before = client.get("/v1/videos").json()
  for text in HOSTILE_TEXT:
    body = json.dumps({**SMALL, "prompt": "x", field: text})  # ASCII JSON: \\u escapes, as a client sends them
    answer = client.post("/v1/videos", content=body, headers={"content-type": "application/json"})
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == field, (repr(text), answer.text)
  assert service.store.counts()["queued"] == 0
  assert client.get("/v1/videos").json() == before and client.get("/").status_code == 200
  kept = client.post("/v1/videos", json={**SMALL, "prompt": "x", field: "tab\there\nnew line, ünïcödé 日本 🦊"})
  assert kept.status_code == 200, kept.text


def test_a_row_that_cannot_be_read_does_not_break_the_list(unloaded):
  """Rows written into the SQLite table by another program: text that is not UTF-8, params that are
  not JSON, a prompt holding a lone surrogate (as JSON escapes it): the list still answers, each such
  job shown as failed with the reason, and the good job beside them as it is."""
  service, client = unloaded
  good = client.post("/v1/videos", json={**SMALL, "prompt": "a good job"}).json()["id"]
  params = {"prompt": "a red \ud8a0 square", "negative_prompt": "", "width": 32, "height": 32, "num_frames": 5,
            "num_inference_steps": 3, "guidance_scale": 5.0, "flow_shift": None, "seed": 1, "fps": 16.0,
            "output_format": "npy", "lora": []}
  import json

  db = service.store._db  # as another program writing the table would
  rows = [("video_" + "a" * 24, b'{"prompt": "\xff\xfe not utf-8"}'),
          ("video_" + "b" * 24, "{not json"), ("video_" + "c" * 24, json.dumps(params))]
  for job_id, text in rows:
    db.execute("INSERT INTO jobs (id, created_at, status, params, batch_key) VALUES (?, 0, 'completed', "
               "CAST(? AS TEXT), '')", (job_id, text))  # bytes stored as TEXT: not UTF-8
  listing = client.get("/v1/videos?limit=100")
  assert listing.status_code == 200, listing.text
  shown = {job["id"]: job for job in listing.json()["data"]}
  assert shown[good]["prompt"] == "a good job" and shown[good]["error"] is None
  for job_id in ("video_" + "a" * 24, "video_" + "b" * 24):
    assert shown[job_id]["error"]["code"] == "unreadable_job", shown[job_id]
  assert shown["video_" + "c" * 24]["prompt"] == "a red \ufffd square"  # sent as valid UTF-8
  assert client.get("/v1/videos/" + "video_" + "b" * 24).status_code == 200
  assert client.get("/").status_code == 200


@pytest.mark.parametrize("shift", ["1e7", "1e30", "1e-30", "-1", "NaN", "Infinity"])
def test_a_flow_shift_without_a_usable_schedule_is_a_400(unloaded, shift):
  """Checked when queued by the same `GenerationRequest.build` (it used to be queued and fail in the
  worker): 400 naming flow_shift, nothing queued."""
  service, client = unloaded
  body = '{"prompt": "x", "size": "32x32", "num_frames": 5, "flow_shift": %s}' % shift
  answer = client.post("/v1/videos", content=body, headers={"content-type": "application/json"})
  assert answer.status_code == 400 and answer.json()["error"]["param"] == "flow_shift", answer.text
  form = client.post("/v1/videos", data={"prompt": "x", "size": "32x32", "flow_shift": shift.lower()})
  assert form.status_code == 400 and form.json()["error"]["param"] == "flow_shift", form.text
  assert service.store.counts()["queued"] == 0


def test_strength_without_a_video_is_refused(unloaded):
  """strength is video-to-video's: alone it would be silently ignored, so it is a 400 naming it."""
  service, client = unloaded
  answer = client.post("/v1/videos", json={**SMALL, "prompt": "x", "strength": 0.5})
  assert answer.status_code == 400 and answer.json()["error"]["param"] == "strength", answer.text
  assert service.store.counts()["queued"] == 0


@pytest.mark.parametrize("field,value", [("guidance_scale", "1e30"), ("guidance_scale", "-1"),
                                         ("strength", "NaN"), ("strength", "2")])
def test_a_number_out_of_its_range_is_a_400(unloaded, field, value):
  """Every number is checked when queued by `GenerationRequest.build` (a 1e30 guidance used to be
  queued and fail in the worker; a strength without a video was not checked): 400 naming the field."""
  service, client = unloaded
  body = f'{{"prompt": "x", "size": "32x32", "num_frames": 5, "{field}": {value}}}'
  answer = client.post("/v1/videos", content=body, headers={"content-type": "application/json"})
  assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text
  assert service.store.counts()["queued"] == 0


def test_context_windows_are_queued_and_bad_ones_named(unloaded):
  """context_frames / context_overlap / context_fuse reach the request (JSON and the SDK's form): a
  65-frame job in 17-frame windows of the trained default is queued without the trained-size
  warning (each window is a trained clip), jobs with other windows do not batch together, and a bad
  window is a 400 naming its field."""
  service, client = unloaded
  long = {"prompt": "x", "size": "64x64", "num_frames": 65, "context_frames": 17, "context_overlap": 8}
  queued = client.post("/v1/videos", json=long)
  assert queued.status_code == 200 and queued.json()["warnings"] == [], queued.text
  form = client.post("/v1/videos", data={**{k: str(v) for k, v in long.items()}, "context_fuse": "flat"})
  assert form.status_code == 200, form.text
  from pipelines.serve import api
  first, second = (service.store.get(job["id"])["params"] for job in (queued.json(), form.json()))
  assert first["context_frames"] == 17 and second["context_fuse"] == "flat"
  assert api.batch_key(first) != api.batch_key(second)
  continued = client.post("/v1/videos", json={**long, "context_fuse": "continue"})  # windows one after another
  assert continued.status_code == 200, continued.text
  assert service.store.get(continued.json()["id"])["params"]["context_fuse"] == "continue"
  for field, value in (("context_frames", 16), ("context_overlap", 6), ("context_fuse", '"mean"')):
    body = '{"prompt": "x", "size": "64x64", "num_frames": 65, "context_frames": 17, "%s": %s}' % (field, value)
    answer = client.post("/v1/videos", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text
  assert service.store.counts()["queued"] == 3


def test_a_long_job_without_windows_warns_with_the_window_fields():
  """A job longer than a Wan folder's trained 81 frames, without context windows, keeps a warning
  naming context_frames / context_overlap; with windows (control) it has none."""
  import dataclasses

  from pipelines.pipeline.checked.model_facts import ModelFacts
  from pipelines.serve import api
  facts = dataclasses.replace(ModelFacts.tiny_random("float32"), name="/models/wan-folder")  # trained on 81 frames
  params = {"prompt": "x", "negative_prompt": "", "seed": 0, "width": 32, "height": 32, "num_frames": 85,
            "num_inference_steps": 2, "guidance_scale": 5.0, "flow_shift": None}
  _, notes = api.check_request(dict(params), facts, None)
  assert len(notes) == 1 and "context_frames=81, context_overlap=20" in notes[0], notes
  _, notes = api.check_request(dict(params, context_frames=81, context_overlap=20), facts, None)
  assert notes == []



@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_schema_pages_work_offline(unloaded, page):
  """/docs (Swagger UI) and /redoc load every script, stylesheet and icon from the server itself (they
  came from a CDN: offline, a blank page): each one the page names answers 200 with a body, and the page
  names no other host. Control: the page names a script (the check is not vacuous); the schema it
  reads answers too."""
  import re

  _, client = unloaded
  html = client.get(page)
  assert html.status_code == 200 and html.headers["content-type"].startswith("text/html"), html.text
  assets = re.findall(r"""<(?:script|link)\b[^>]*?\b(?:src|href)=["']([^"']+)["']""", html.text)
  scripts = re.findall(r"""<script\b[^>]*?\bsrc=["']([^"']+)["']""", html.text)
  assert scripts and assets, html.text
  if page == "/docs":
    assert any(a.endswith(".css") for a in assets), assets  # Swagger UI's stylesheet
  off_host = re.findall(r"(?:https?:)?//[\w.-]+", html.text)
  assert not off_host, f"{page} names another host: {off_host}"
  for url in assets:
    assert url.startswith("/") and not url.startswith("//"), url
    got = client.get(url)
    assert got.status_code == 200 and len(got.content) > 1000, (url, got.status_code)
  assert client.get("/openapi.json").json()["openapi"].startswith("3.")


def test_an_mp4_is_refused_up_front_where_it_could_not_be_encoded(unloaded, tmp_path, monkeypatch):
  """A server without ffmpeg (IMAGEIO_FFMPEG_EXE naming a missing file) answers an mp4 request with a
  400 naming output_format, nothing queued, instead of failing the job after its generation; a gif
  and an npy are still queued there, and an mp4 where ffmpeg exists (positive controls)."""
  service, client = unloaded
  assert client.post("/v1/videos", json={**SMALL, "prompt": "x", "output_format": "mp4"}).status_code == 200
  monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(tmp_path / "no-such-ffmpeg"))
  queued = service.store.counts()["queued"]
  for body in ({**SMALL, "prompt": "x", "output_format": "mp4"}, {"prompt": "x"}):  # mp4 is the default
    answer = client.post("/v1/videos", json=body)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == "output_format", answer.text
    assert "imageio-ffmpeg finds no ffmpeg" in error["message"] and "'gif' or 'npy'" in error["message"]
  assert service.store.counts()["queued"] == queued
  for kind in ("gif", "npy"):
    assert client.post("/v1/videos", json={**SMALL, "prompt": "x", "output_format": kind}).status_code == 200


def test_a_remix_of_an_mp4_is_refused_where_it_could_not_be_read(unloaded, tmp_path, monkeypatch):
  """Remixing a finished mp4 reads it with ffmpeg: where none is found, a 400 "unsupported" naming
  video_id, not a 500 from the reader; with ffmpeg the remix goes on to read the file (positive
  control: the stand-in file is no video, so the reader's own refusal comes next)."""
  from pipelines.serve import api

  service, _ = unloaded
  clip = tmp_path / "video_done.mp4"
  clip.write_bytes(b"not a video")
  monkeypatch.setattr(service, "content_path", lambda row: str(clip))
  row = {"id": "video_done", "status": "completed", "params": {"width": 32, "height": 32}}
  monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(tmp_path / "no-such-ffmpeg"))
  with pytest.raises(api.ApiError) as refused:
    service.remix(row, api.VideoRemix(prompt="a blue circle"))
  assert (refused.value.status, refused.value.param, refused.value.code) == (400, "video_id", "unsupported")
  assert "no ffmpeg" in refused.value.message
  monkeypatch.delenv("IMAGEIO_FFMPEG_EXE")
  with pytest.raises(Exception) as read:
    service.remix(row, api.VideoRemix(prompt="a blue circle"))
  assert not (isinstance(read.value, api.ApiError) and read.value.code == "unsupported"), read.value
