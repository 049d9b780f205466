"""Encoded prompts kept on the host, so that a call whose text encoder is off the device (a memory
plan's `encoder-offloaded` or `encoder-on-host`) uploads or runs it only for prompts it has not
seen: serve's jobs mostly repeat the negative prompt, and a repeated prompt costs no upload at all.

Each prompt's states are its own row of the encoder's output (UMT5 attends within a prompt, its
padding masked), so a row encoded beside other prompts serves the prompt alone; rows computed in
batches of other sizes may differ from each other in the last fp32 bit (XLA's matmul tiling).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


class TextStatesCache:
  """Least-recently-used encoded prompts: (prompt, L) -> [L, text_dim] numpy in the model dtype.

  Attributes:
    capacity: prompts kept at most (the least recently used leaves first).
  """

  def __init__(self, capacity: int = 64):
    self.capacity = capacity
    self._rows: collections.OrderedDict[tuple[str, int], np.ndarray] = collections.OrderedDict()

  def __len__(self) -> int:
    return len(self._rows)

  def missing(self, prompts: Sequence[str], length: int) -> list[str]:
    """The prompts of `prompts` not cached at `length` tokens, each once, in order."""
    return list(dict.fromkeys(p for p in prompts if (p, length) not in self._rows))

  def fill(self, prompts: Sequence[str], length: int, encode: Callable[[list[str], int], jax.Array]) -> None:
    """Encodes the missing prompts with `encode(prompts, length)` ([P, L, D]) and keeps their rows."""
    todo = self.missing(prompts, length)
    if not todo:
      return
    states = np.asarray(jax.device_get(encode(todo, length)))
    for prompt, row in zip(todo, states):
      self._rows[(prompt, length)] = row
    for p in prompts:  # this call's prompts are the most recent, and stay while it runs
      self._rows.move_to_end((p, length))
    while len(self._rows) > max(self.capacity, len(set(prompts))):
      self._rows.popitem(last=False)

  def get(self, prompts: Sequence[str], length: int) -> jax.Array:
    """[len(prompts), L, D] of cached prompts (`fill` them first).

    Raises:
      KeyError: a prompt not cached at `length`.
    """
    for p in prompts:
      self._rows.move_to_end((p, length))
    return jnp.asarray(np.stack([self._rows[(p, length)] for p in prompts]))

  def clear(self) -> None:
    self._rows.clear()
