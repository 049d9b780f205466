"""The durable job table: one SQLite database (WAL journal, fsync on commit) in the data folder.

A job row is written before the API answers, and every change of status is one transaction, so a
server killed at any moment (kill -9 included) restarts with its queue as it was: queued jobs stay
queued, a batch that was running is run again with the same members in the same order (so its
denoising checkpoint matches and it resumes), and finished jobs stay served.

Statuses: queued -> in_progress -> completed | failed; queued or in_progress -> cancelled. A job
deleted while its batch runs is `HIDDEN` until the batch ends (`JobStore.delete`, `purge`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import sqlite3
import threading
import time
from typing import Any, Iterator

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT UNIQUE NOT NULL,
  created_at REAL NOT NULL,
  status TEXT NOT NULL,
  params TEXT NOT NULL,
  batch_key TEXT NOT NULL,
  progress INTEGER NOT NULL DEFAULT 0,
  step INTEGER NOT NULL DEFAULT 0,
  batch_id TEXT,
  batch_index INTEGER,
  batch_size INTEGER,
  started_at REAL,
  completed_at REAL,
  output TEXT,
  timings TEXT,
  error TEXT,
  warnings TEXT
);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status, seq);
CREATE INDEX IF NOT EXISTS jobs_batch ON jobs (batch_id, batch_index);
"""
DB_FILE = "jobs.sqlite3"
LOCK_FILE = "serve.lock"
# The status of a job deleted while its batch runs: no read of the API finds it, the worker drops it as
# a cancelled one, and its batch keeps its members (a restarted server resumes the batch's checkpoint).
HIDDEN = "deleted"


def new_id() -> str:
  """A server-made job id: "video_" and 24 random hex digits (never a client's string)."""
  return "video_" + secrets.token_hex(12)


class DataDirBusy(OSError):
  """Another server holds the data folder (two would run each other's batches)."""


class JobStore:
  """Thread-safe access to the job table (one connection, one lock; every write one transaction).
  One process at a time holds a data folder (an exclusive `flock` on `LOCK_FILE`, released when the
  store is closed or the process dies, kill -9 included).

  Args:
    directory: the data folder (created if missing); the table is `DB_FILE` in it.

  Raises:
    DataDirBusy: another process holds the folder.
  """

  def __init__(self, directory: str):
    os.makedirs(directory, exist_ok=True)
    self._holder = open(os.path.join(directory, LOCK_FILE), "a")
    try:
      fcntl.flock(self._holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      self._holder.close()
      raise DataDirBusy(f"another serve process is using --data-dir {directory!r}; stop it or choose another "
                        "folder") from e
    self.path = os.path.join(directory, DB_FILE)
    self._lock = threading.Lock()
    self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
    self._db.row_factory = sqlite3.Row
    # Text that is not UTF-8 (a row written by another program) is read with U+FFFD, never an error
    # that would fail every query touching the row.
    self._db.text_factory = lambda raw: raw.decode("utf-8", "replace")
    self._db.execute("PRAGMA journal_mode=WAL")
    self._db.execute("PRAGMA synchronous=FULL")
    self._db.executescript(SCHEMA)
    if "warnings" not in {column[1] for column in self._db.execute("PRAGMA table_info(jobs)")}:
      self._db.execute("ALTER TABLE jobs ADD COLUMN warnings TEXT")  # a table from before jobs kept warnings

  def _write(self, sql: str, args: tuple = ()) -> int:
    with self._lock:
      return self._db.execute(sql, args).rowcount

  @contextlib.contextmanager
  def _transaction(self) -> Iterator[sqlite3.Connection]:
    """The connection, under the lock, in one transaction (rolled back on any error)."""
    with self._lock:
      self._db.execute("BEGIN IMMEDIATE")
      try:
        yield self._db
        self._db.execute("COMMIT")
      except BaseException:
        self._db.execute("ROLLBACK")
        raise

  def _rows(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
    with self._lock:
      rows = self._db.execute(sql, args).fetchall()
    return [_row(r) for r in rows]

  # --- the API's side ---

  def add(self, params: dict[str, Any], batch_key: str, max_queue: int, warnings: list[str] | tuple = ()
          ) -> dict[str, Any] | None:
    """Queues a job with the warnings its checks gave; None when `max_queue` jobs are queued already
    (checked in the same transaction)."""
    job_id = new_id()
    with self._transaction() as db:
      if db.execute("SELECT COUNT(*) FROM jobs WHERE status='queued'").fetchone()[0] >= max_queue:
        return None
      db.execute("INSERT INTO jobs (id, created_at, status, params, batch_key, warnings) VALUES (?, ?, 'queued', ?, "
                 "?, ?)", (job_id, time.time(), json.dumps(params), batch_key, json.dumps(list(warnings))))
    return self.get(job_id)

  def get(self, job_id: str) -> dict[str, Any] | None:
    """The job's row (params and timings decoded), or None."""
    rows = self._rows("SELECT * FROM jobs WHERE id=? AND status!=?", (job_id, HIDDEN))
    return rows[0] if rows else None

  def page(self, limit: int, after: str | None = None, order: str = "desc"
           ) -> tuple[list[dict[str, Any]], bool] | None:
    """Jobs newest first (`order` "desc") or oldest first ("asc"), `limit` of them, starting after the
    job `after`; (rows, has_more), or None when there is no job `after`."""
    if order not in ("asc", "desc"):
      raise ValueError(f"order={order!r} must be 'asc' or 'desc'")
    start = None
    if after is not None:
      found = self._rows("SELECT seq FROM jobs WHERE id=? AND status!=?", (after, HIDDEN))
      if not found:
        return None
      start = found[0]["seq"]
    where, args = (f"AND seq {'<' if order == 'desc' else '>'} ?", (start,)) if start is not None else ("", ())
    rows = self._rows(f"SELECT * FROM jobs WHERE status!=? {where} ORDER BY seq {order.upper()} LIMIT ?",
                      (HIDDEN, *args, limit + 1))
    return rows[:limit], len(rows) > limit

  def uses_reference(self, sha256: str) -> bool:
    """Whether any job keeps the input_reference of that digest."""
    with self._lock:
      return self._db.execute("SELECT 1 FROM jobs WHERE json_valid(params) AND "
                              "json_extract(params, '$.input_reference.sha256') = ? LIMIT 1",
                              (sha256,)).fetchone() is not None

  def cancel(self, job_id: str) -> bool:
    """Marks a queued or running job cancelled; False when it had finished."""
    return bool(self._write("UPDATE jobs SET status='cancelled', completed_at=? WHERE id=? AND status IN "
                            "('queued', 'in_progress')", (time.time(), job_id)))

  def delete(self, job_id: str) -> tuple[dict[str, Any], bool] | None:
    """Forgets a job in any status, in one transaction; returns (its row as it was, whether the row is
    gone), None when there is no such job. A job whose batch is running (a member in_progress, itself
    included) is `HIDDEN` instead, and removed when the batch ends (`purge`)."""
    with self._transaction() as db:
      found = db.execute("SELECT * FROM jobs WHERE id=? AND status!=?", (job_id, HIDDEN)).fetchone()
      if found is None:
        return None
      running = found["batch_id"] is not None and db.execute(
          "SELECT 1 FROM jobs WHERE batch_id=? AND status='in_progress' LIMIT 1", (found["batch_id"],)).fetchone()
      if running:
        db.execute("UPDATE jobs SET status=? WHERE id=?", (HIDDEN, job_id))
      else:
        db.execute("DELETE FROM jobs WHERE id=?", (job_id,))
    return _row(found), not running

  def purge(self) -> list[dict[str, Any]]:
    """Removes the `HIDDEN` rows of every batch that no longer runs (no member in_progress: the worker
    calls it when a batch ends, a server when it starts); returns them (their files are the caller's)."""
    ended = ("status=? AND (batch_id IS NULL OR batch_id NOT IN (SELECT batch_id FROM jobs WHERE "
             "status='in_progress' AND batch_id IS NOT NULL))")
    with self._transaction() as db:
      rows = db.execute(f"SELECT * FROM jobs WHERE {ended}", (HIDDEN,)).fetchall()
      db.execute(f"DELETE FROM jobs WHERE {ended}", (HIDDEN,))
    return [_row(r) for r in rows]

  def counts(self) -> dict[str, int]:
    """Jobs per status (every status, 0 included)."""
    with self._lock:
      found = dict(self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall())
    return {s: int(found.get(s, 0)) for s in ("queued", "in_progress", "completed", "failed", "cancelled")}

  # --- the worker's side ---

  def next_batch(self, max_batch: int) -> tuple[str, list[dict[str, Any]]] | None:
    """The next batch to run: (batch id, its jobs in batch order, cancelled ones included).

    A batch left running by a killed server comes first, with its members as they were; else up
    to `max_batch` queued jobs of the oldest job's batch key, oldest first, marked in_progress."""
    with self._transaction():
      return self._pick(max_batch)

  def _pick(self, max_batch: int) -> tuple[str, list[dict[str, Any]]] | None:
    running = self._db.execute("SELECT batch_id FROM jobs WHERE status='in_progress' ORDER BY seq LIMIT 1").fetchone()
    if running is None:
      first = self._db.execute("SELECT batch_key FROM jobs WHERE status='queued' ORDER BY seq LIMIT 1").fetchone()
      if first is None:
        return None
      ids = [r[0] for r in self._db.execute("SELECT id FROM jobs WHERE status='queued' AND batch_key=? ORDER BY seq "
                                             "LIMIT ?", (first[0], max_batch)).fetchall()]
      batch_id = "batch_" + secrets.token_hex(8)
      for index, job_id in enumerate(ids):
        self._db.execute("UPDATE jobs SET status='in_progress', batch_id=?, batch_index=?, batch_size=?, started_at=? "
                         "WHERE id=?", (batch_id, index, len(ids), time.time(), job_id))
    else:
      batch_id = running[0]
    rows = self._db.execute("SELECT * FROM jobs WHERE batch_id=? ORDER BY batch_index", (batch_id,)).fetchall()
    return batch_id, [_row(r) for r in rows]

  def statuses(self, job_ids: list[str]) -> dict[str, str]:
    """{job id: status} of the given jobs."""
    marks = ",".join("?" * len(job_ids))
    with self._lock:
      return dict(self._db.execute(f"SELECT id, status FROM jobs WHERE id IN ({marks})", job_ids).fetchall())

  def progress(self, job_ids: list[str], step: int, steps: int) -> None:
    """After `step` of `steps` denoising steps (only jobs still running are updated)."""
    marks = ",".join("?" * len(job_ids))
    self._write(f"UPDATE jobs SET step=?, progress=? WHERE status='in_progress' AND id IN ({marks})",
                (step, int(100 * step / max(steps, 1)) if step < steps else 99, *job_ids))

  def complete(self, job_id: str, output: str, timings: dict[str, float]) -> bool:
    """Marks a running job completed with its video; False when it was cancelled meanwhile."""
    return bool(self._write("UPDATE jobs SET status='completed', progress=100, output=?, timings=?, completed_at=? "
                            "WHERE id=? AND status='in_progress'", (output, json.dumps(timings), time.time(), job_id)))

  def fail(self, job_ids: list[str], error: str) -> int:
    """Marks the given jobs that are still running failed, with the error message; returns how many
    it marked (a job cancelled or deleted meanwhile is left as it is)."""
    marks = ",".join("?" * len(job_ids))
    return self._write(f"UPDATE jobs SET status='failed', error=?, completed_at=? WHERE status='in_progress' AND "
                       f"id IN ({marks})", (error, time.time(), *job_ids))

  def close(self) -> None:
    with self._lock:
      self._db.close()
    self._holder.close()  # releases the folder


def _row(row: sqlite3.Row) -> dict[str, Any]:
  """A row as a dict, its JSON columns decoded; a column that does not decode is kept as its text
  under "unreadable" (the API shows such a job as failed, `api.unreadable_object`)."""
  out = dict(row)
  for name in ("params", "timings", "warnings"):
    if name in out:
      try:
        out[name] = json.loads(out[name]) if out[name] else None
      except (TypeError, ValueError):
        out.setdefault("unreadable", []).append(name)
        out[name] = None
  return out
