"""Causal (streaming) Wan: a transformer that makes a few latent frames at a time, each chunk
attending to a KV cache of the frames before it (Self-Forcing, CausVid, Causal-Forcing checkpoints
of Wan 2.1): the cache and its window, one chunk's forward, each chunk's few-step schedule, and
the stream that runs them.

The names below are imported on first use (`lazy_facade`), so that importing the package imports
none of its modules.
"""

from lazy_facade import lazy_facade

_HOMES = (
    ("pipelines.wan.causal.cache", ("CacheWindow", "KVCache", "write_chunk")),
    ("pipelines.wan.causal.forward", ("MAX_FRAMES", "cache_bytes", "check_chunk", "chunk_forward")),
    ("pipelines.wan.causal.schedule", ("ChunkSchedule",)),
    ("pipelines.wan.causal.stream", ("CausalStream", "chunk_noise")),
)

__all__, __getattr__ = lazy_facade(__name__, _HOMES)
