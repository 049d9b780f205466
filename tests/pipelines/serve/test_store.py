"""Tests for pipelines/serve/store.py: the durable job table; a table made before jobs kept warnings
opens with the column added."""

from __future__ import annotations

import json
import sqlite3

from pipelines.serve import api, store


def test_a_job_table_from_before_warnings_opens_with_the_column_added(tmp_path):
  old = store.SCHEMA.replace(",\n  warnings TEXT", "")
  assert old != store.SCHEMA
  params = {"prompt": "x", "seed": 1, "width": 64, "height": 64, "num_frames": 17, "fps": 16,
            "num_inference_steps": 8, "output_format": "mp4"}
  with sqlite3.connect(tmp_path / store.DB_FILE) as db:
    db.executescript(old)
    db.execute("INSERT INTO jobs (id, created_at, status, params, batch_key) VALUES ('video_1', 0, 'queued', ?, '')",
               (json.dumps(params),))
  table = store.JobStore(str(tmp_path))
  try:
    assert table.get("video_1")["warnings"] is None
    assert api.video_object(table.get("video_1"), "tiny")["warnings"] == []
    assert table.add(params, "", 8, warnings=["a note"])["warnings"] == ["a note"]
  finally:
    table.close()
