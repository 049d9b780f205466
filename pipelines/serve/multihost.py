"""Serving on several processes (hosts): process 0 answers HTTP and owns the job table; it broadcasts
each decision (a batch to run, idle, stop; before every denoising step: go on, cancelled, stopping)
and every other process makes the same `WanPipeline.generate` calls in the same order, so their
collectives meet. Before a batch starts every process prepares it (its LoRAs fused, its request
built) and all agree (`Channel.agree`): when any process failed, none runs it, process 0 fails its
jobs and every process goes on with the next decision. Only process 0 writes (videos, sidecars,
checkpoints); the data folder must be shared storage (every process reads a checkpoint to resume,
as `generate --resume` needs).

A process that dies stops the others through JAX's heartbeat (`distributed.initialize`); start them
all again and the batch resumes from its checkpoint. A failure inside `generate` on one process
(after the agreement) is not caught on the others: they wait in the step's collectives until the
heartbeat stops them.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

GO, CANCELLED, STOPPING = 0, 1, 2


class Channel:
  """Process 0's messages to every process (collectives: every process calls each method in turn).

  Messages are JSON objects sent as a length, then the bytes padded to a power of two of at least
  256 (so only a few buffer shapes are ever compiled)."""

  def __init__(self, broadcast: Any = None, allgather: Any = None, process_index: int | None = None):
    """Args (the defaults: JAX's multi-process runtime):
      broadcast: process 0's array on every process (`multihost_utils.broadcast_one_to_all`).
      allgather: every process's array stacked, on every process (`multihost_utils.process_allgather`).
      process_index: this process (`jax.process_index()`).
    """
    if broadcast is None or allgather is None or process_index is None:
      import jax
      from jax.experimental import multihost_utils

      broadcast, allgather = multihost_utils.broadcast_one_to_all, multihost_utils.process_allgather
      process_index = jax.process_index()
    self._broadcast, self._allgather = broadcast, allgather
    self.is_source = process_index == 0

  def message(self, data: dict[str, Any] | None) -> dict[str, Any]:
    """Process 0's `data` on every process (the others pass None)."""
    text = json.dumps(data).encode() if self.is_source else b""
    length = int(np.asarray(self._broadcast(np.int32(len(text)))))
    buffer = np.zeros(max(256, 1 << (length - 1).bit_length()), np.uint8)
    buffer[:len(text)] = np.frombuffer(text, np.uint8)
    received = np.asarray(self._broadcast(buffer))
    return json.loads(received[:length].tobytes())

  def action(self, code: int | None) -> int:
    """Process 0's per-step decision (`GO`, `CANCELLED`, `STOPPING`) on every process."""
    return int(np.asarray(self._broadcast(np.int32(code if self.is_source else 0))))

  def agree(self, ok: bool) -> list[int]:
    """The processes that said not `ok` (empty: every process is ready), on every process."""
    flags = np.asarray(self._allgather(np.int32(bool(ok)))).reshape(-1)
    return [int(i) for i in np.flatnonzero(flags == 0)]
