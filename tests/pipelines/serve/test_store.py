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


def test_a_job_deleted_while_its_batch_runs_stays_its_member_until_the_batch_ends(tmp_path):
  """`delete` of a job whose batch runs hides it (no read of the API finds it) but keeps the batch's
  members, so a restarted server picks the same batch to resume its checkpoint; `purge` forgets it
  once the batch has ended. Control: a queued job is gone at once."""
  params = {"prompt": "x", "seed": 1}
  table = store.JobStore(str(tmp_path))
  running, other, queued = (table.add({**params, "prompt": p}, key, 8)["id"]
                            for p, key in (("running", "a"), ("other", "a"), ("queued", "b")))
  batch_id, rows = table.next_batch(2)
  assert [r["id"] for r in rows] == [running, other]
  row, gone = table.delete(running)
  assert (row["status"], gone) == ("in_progress", False)
  assert table.get(running) is None and table.delete(running) is None
  assert [r["id"] for r in table.page(10)[0]] == [queued, other] and table.counts()["in_progress"] == 1
  assert table.purge() == []  # its batch still runs
  assert table.delete(queued)[1] and table.statuses([queued]) == {}  # not in a running batch: gone at once
  table.close()
  table = store.JobStore(str(tmp_path))  # a restarted server
  try:
    assert table.next_batch(2) == (batch_id, [table._rows("SELECT * FROM jobs WHERE id=?", (j,))[0]
                                              for j in (running, other)])
    assert table.statuses([running]) == {running: store.HIDDEN}
    table.complete(other, "", {})
    assert [r["id"] for r in table.purge()] == [running] and table.statuses([running, other]) == {other: "completed"}
  finally:
    table.close()
