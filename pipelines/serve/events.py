"""What the operator of `serve` reads on stderr: the model loading, each warm-up shape, the ready line
with the URL, one line per job as it starts and ends, failures. Python's `logging` under the
"wan.serve" logger (`configure` sets `serve --log-level`; uvicorn's access log follows the same level).

    serve: loading model tiny (float32) ...
    serve: model loaded in 2.1 s
    serve: warm-up 1/2: 64x64 x 17 frames, 8 steps, batch 1: 9.8 s
    serve: ready at http://127.0.0.1:8000/ (model tiny, mesh one device): POST /v1/videos, schema at /docs
    serve: job video_3f2a... started: 64x64 x 17 frames, 8 steps (batch of 2)
    serve: job video_3f2a... completed: 64x64 x 17 frames, 8 steps, 9.4 s (batch of 2)
"""

from __future__ import annotations

import logging
import sys
from typing import Any

LOGGER = "wan.serve"
LEVELS = ("debug", "info", "warning", "error")


def log() -> logging.Logger:
  """The operator's logger ("wan.serve")."""
  return logging.getLogger(LOGGER)


def configure(level: str) -> None:
  """`serve`'s own lines to stderr as "serve: ..." at `level` (one of `LEVELS`); called once by the
  command (a library user of `Service` keeps their own logging set-up)."""
  logger = log()
  logger.setLevel(level.upper())
  if not any(getattr(h, "_wan_serve", False) for h in logger.handlers):
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("serve: %(message)s"))
    handler._wan_serve = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
  logger.propagate = False


def job_line(row: dict[str, Any], status: str, *, seconds: float | None = None, batch: int | None = None,
             error: str | None = None) -> str:
  """One job's line: "job ID STATUS: WxH x F frames, S steps[, T s][ (batch of B)][: error]"."""
  p = row.get("params") or {}
  shape = (f"{p.get('width')}x{p.get('height')} x {p.get('num_frames')} frames, "
           f"{p.get('num_inference_steps')} steps")
  took = "" if seconds is None else f", {seconds:.1f} s"
  together = "" if not batch or batch == 1 else f" (batch of {batch})"
  why = "" if error is None else f": {error}"
  return f"job {row.get('id')} {status}: {shape}{took}{together}{why}"
