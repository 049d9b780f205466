"""Work done in a background thread ahead of the stage that needs it (`CompileAhead`): the VAE
decoder's programs compiled beside the text encoder, the step's compile and the denoising loop."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from typing import Any


class CompileAhead:
  """`work()` run in a background thread, started at construction: typically compiles whose
  executables JAX's in-memory caches hand to a later call of the same programs (lowered for the
  same argument shapes, dtypes and shardings). On an accelerator the host is idle while the device
  computes, so a compile that overlaps another stage leaves the path to the first video.

  The thread is not a daemon: a process that ends while it compiles waits for it at its exit (a
  daemon thread inside XLA at the interpreter's shutdown aborts the process, exit 134, measured),
  so a caller that gives up on the work (a failing run) loses no exit status, and a long-lived
  process keeps the compiled programs.

  The thread calls `on_start()` first (the stage's name for the compile cache's per-thread
  accounting, `CallOptions.on_stage`). A failure is kept, not raised: the later call compiles the
  program itself and raises there, where it belongs; `join` warns with the error so that it is seen.
  """

  def __init__(self, work: Callable[[], Any], on_start: Callable[[], None] | None = None, *,
               name: str = "compile-ahead"):
    self.seconds = 0.0
    self.error: Exception | None = None
    self._thread = threading.Thread(target=self._run, args=(work, on_start), name=name, daemon=False)
    self._thread.start()

  def _run(self, work: Callable[[], Any], on_start: Callable[[], None] | None) -> None:
    start = time.perf_counter()
    try:
      if on_start is not None:
        on_start()
      work()
    except Exception as e:  # noqa: BLE001 -- the caller's own compile raises it again
      self.error = e
    self.seconds = time.perf_counter() - start

  def join(self) -> float:
    """Waits for the work; returns its wall seconds (overlapped with whatever ran meanwhile)."""
    self._thread.join()
    if self.error is not None:
      warnings.warn(f"compiling ahead ({self._thread.name}) failed, so it compiles when called: "
                    f"{type(self.error).__name__}: {self.error}", RuntimeWarning, stacklevel=2)
      self.error = None
    return self.seconds
