"""The cache's slots against the reference's shifting buffer, simulated frame by frame."""

import jax.numpy as jnp
import numpy as np
import pytest

from pipelines.wan.causal import CacheWindow, KVCache, write_chunk


def _reference_frames(window: CacheWindow, chunks: int) -> list[set[int]]:
  """The past frames each chunk attends to in Self-Forcing's buffer (`CausalWanSelfAttention.forward`
  in tests/reference/self_forcing, in frames): W frames, the first s kept, the oldest others shifted
  out when a new chunk does not fit; the chunk's own frames removed."""
  c, w, s = window.chunk_frames, window.window_frames, window.sink_frames
  buffer, seen = [], []
  for k in range(chunks):
    new = list(range(k * c, (k + 1) * c))
    if w is not None and len(buffer) + c > w:
      evicted = len(buffer) + c - w
      buffer = buffer[:s] + buffer[s + evicted:]
    buffer = buffer + new
    seen.append(set(buffer) - set(new))
  return seen


@pytest.mark.parametrize("window", [CacheWindow(3, None, 0), CacheWindow(3, 6, 0), CacheWindow(3, 9, 3),
                                    CacheWindow(1, 4, 1), CacheWindow(2, 7, 2), CacheWindow(3, 3, 0),
                                    CacheWindow(2, 4, 2)])
def test_the_cache_holds_the_frames_the_reference_attends_to(window):
  """Eight chunks: before each, the frames in the filled slots are the reference's past frames."""
  chunks, per_frame = 8, 2
  capacity = window.capacity(chunks * window.chunk_frames)
  cache = KVCache.empty(layers=1, batch=1, capacity=capacity, tokens_per_frame=per_frame, heads=1, head_dim=1,
                        dtype=jnp.float32)
  c = window.chunk_frames
  for k, expected in enumerate(_reference_frames(window, chunks)):
    valid = int(cache.valid_tokens(per_frame))
    held = set(np.asarray(cache.k_ZBSNH[0, 0, :valid, 0, 0]).astype(int).tolist())
    assert held == expected, (k, held, expected)
    frames = np.repeat(np.arange(k * c, (k + 1) * c), per_frame).astype(np.float32)
    kv = jnp.asarray(frames).reshape(1, 1, -1, 1, 1)
    cache = write_chunk(cache, kv, kv, window, per_frame)
    assert int(cache.frames) == (k + 1) * c


def test_windows_that_cannot_hold_a_chunk_are_refused():
  with pytest.raises(ValueError, match="at least 5 frames"):
    CacheWindow(3, 4, 2)
  with pytest.raises(ValueError, match="chunk_frames"):
    CacheWindow(0)
  with pytest.raises(ValueError, match="sink_frames"):
    CacheWindow(3, None, -1)
