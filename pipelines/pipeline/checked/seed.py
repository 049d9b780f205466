"""The noise seed: one random draw (`random_seed`) and one rule from seeds to noise (`seeded_noise`).

Every entry point uses both: the Python call and `generate` draw a seed with `random_seed` when none
is given, and so does `serve` for a job sent without one. Video i of a call seeded with s starts from
`numpy.random.default_rng(s + i)` (`video_seeds`), so a batch equals its prompts run alone; a
server's batch gives each video its own job's seed. Imports no JAX (serve draws a job's seed before
the model loads).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

import numpy as np

# Drawn seeds lie in [0, SEED_LIMIT): they fit an int32 (a multi-process run broadcasts one).
SEED_LIMIT = 2 ** 31


def random_seed() -> int:
  """A seed drawn uniformly from [0, 2**31) (`SEED_LIMIT`) from the operating system's entropy,
  for a call given neither a seed nor latents."""
  return secrets.randbelow(SEED_LIMIT)


def video_seeds(seed: int | Sequence[int], videos: int) -> tuple[int, ...]:
  """The seed of each of `videos` videos: seed + i for one int, or the given seeds (one per video).

  Raises:
    ValueError: a sequence whose length is not `videos`.
  """
  if isinstance(seed, Sequence):
    if len(seed) != videos:
      raise ValueError(f"seed={list(seed)!r} holds {len(seed)} seeds for {videos} videos; give one int "
                       "(video i uses seed + i) or one seed per video")
    return tuple(int(s) for s in seed)
  return tuple(int(seed) + i for i in range(videos))


def seeded_noise(seeds: Sequence[int], shape: Sequence[int]) -> np.ndarray:
  """float32 [len(seeds), *shape]: video i is `numpy.random.default_rng(seeds[i])`'s standard
  normal draw of `shape` ([C, F, Hl, Wl]), the same whichever batch it runs in."""
  return np.stack([np.random.default_rng(s).standard_normal(tuple(shape), np.float32) for s in seeds])


def noise_digest(latents: np.ndarray) -> str:
  """SHA-256 (hex) of the initial noise float32 [B, C, F, Hl, Wl]: the same for one seed on every mesh."""
  array = np.ascontiguousarray(latents, dtype=np.float32)
  return hashlib.sha256(repr(array.shape).encode() + array.tobytes()).hexdigest()
