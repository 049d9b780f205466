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


def test_job_warnings_are_kept_and_returned(unloaded):
  _, client = unloaded
  trained = client.post("/v1/videos", json={"prompt": "x", "size": "64x64", "num_frames": 17}).json()
  off = client.post("/v1/videos", json={**SMALL, "prompt": "x", "num_frames": 6}).json()
  assert trained["warnings"] == [], trained
  got = client.get(f"/v1/videos/{off['id']}").json()["warnings"]
  assert got == off["warnings"] and len(got) == 2, got
  assert got[0].startswith("num_frames=6 rounded to 5") and "trained at 64x64 x 17 frames only; 32x32 x 5" in got[1]
  assert client.get("/v1/videos").json()["data"][0]["warnings"] == got  # the listing too
