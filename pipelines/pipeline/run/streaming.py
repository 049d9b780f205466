"""A causal stream of a loaded Wan pipeline: each chunk's latents made (`wan.causal.CausalStream`)
and decoded (the VAE's causal cache carried from chunk to chunk, `vae.decode_continued`) as soon as
it is ready, so a caller can show or write the video while the rest is made.

Glossary (DESIGN.md section 1): B batch, C latent channels, c chunk frames, Hl / Wl latent height /
width. A stream of n chunks has n * c latent frames, 1 + 4 (n c - 1) video frames: chunk 0 decodes to
1 + 4 (c - 1) frames, every later chunk to 4 c.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from pipelines.parallel.plan import ParallelPlan
from pipelines.pipeline.run.decoding import to_unit_range, vae_latents
from pipelines.pipeline.run.precision import matmul_precision
from pipelines.wan import causal as wan_causal, vae as wan_vae


@dataclasses.dataclass(frozen=True)
class StreamSettings:
  """How a causal checkpoint streams (Self-Forcing's defaults: chunks of 3 latent frames, global
  attention, warped steps 1000/750/500/250 at shift 5).

  Attributes:
    window: which past frames each chunk attends to (`wan.causal.CacheWindow`).
    schedule: each chunk's few steps (`wan.causal.ChunkSchedule`).
  """
  window: Any = dataclasses.field(default_factory=lambda: wan_causal.CacheWindow())
  schedule: Any = dataclasses.field(default_factory=lambda: wan_causal.ChunkSchedule())

  def chunks_for(self, num_frames: int) -> int:
    """Chunks whose video holds at least `num_frames` frames (>= 1)."""
    latent_frames = (max(num_frames, 1) - 1 + 3) // 4 + 1
    return -(-latent_frames // self.window.chunk_frames)

  @staticmethod
  def frames_of(num_chunks: int, chunk_frames: int) -> int:
    """Video frames of `num_chunks` chunks: 1 + 4 (n c - 1)."""
    return 1 + 4 * (num_chunks * chunk_frames - 1)


@dataclasses.dataclass(frozen=True)
class StreamChunk:
  """One finished chunk.

  Attributes:
    index: 0-based chunk number.
    latents: float32 numpy [B, C, c, Hl, Wl], the chunk's clean latents.
    frames: float32 numpy [B, T, H, W, 3] in [0, 1], its decoded video frames.
    seconds: wall time from the previous chunk's end (the stream's start for chunk 0).
  """
  index: int
  latents: np.ndarray
  frames: np.ndarray
  seconds: float


def check_streamable(pipe: Any, height: int, width: int) -> tuple[int, int]:
  """(Hl, Wl) after checking the pipeline can stream at height x width.

  Raises:
    ValueError: a two-expert (A14B) or TI2V pipeline, an image-to-video one, or a size that is not a
      multiple of the VAE's spatial factor times the patch, each naming the fix.
  """
  if pipe.num_experts != 1 or pipe.expand_timesteps:
    raise ValueError(f"{pipe.name!r} is a Wan 2.2 two-expert or TI2V pipeline; a causal stream runs one Wan 2.1 "
                     "transformer (a Self-Forcing / CausVid checkpoint as --transformer of Wan2.1-T2V-1.3B)")
  if pipe.transformer_config.has_image_branch:
    raise ValueError(f"{pipe.name!r} has an image branch (Wan 2.1 I2V); stream with a text-to-video transformer")
  step = pipe.vae.config.spatial_factor * pipe.transformer_config.patch_size[1]
  if height % step or width % step or height <= 0 or width <= 0:
    raise ValueError(f"a stream's height and width must be positive multiples of {step}, got {height}x{width}")
  factor = pipe.vae.config.spatial_factor
  return height // factor, width // factor


def check_cache_fits(model: Any, window: Any, *, batch: int, num_chunks: int, latent_size: tuple[int, int],
                     budget: int | None = None) -> int:
  """The KV cache's bytes (`wan.causal.cache_bytes`; replicated on every device of a mesh), after
  checking it fits beside the transformer's weights in the device's memory (`budget`: default
  `parallel.memory.device_budget()`, None on the CPU: no check).

  Raises:
    ValueError: cache and weights over the budget, naming the sizes and a window that fits.
  """
  from pipelines.parallel.memory import device_budget

  per_frame = latent_size[0] * latent_size[1] // 4
  frames = num_chunks * window.chunk_frames
  need = wan_causal.cache_bytes(model, batch=batch, capacity_frames=window.capacity(frames), tokens_per_frame=per_frame)
  budget = device_budget() if budget is None else budget
  weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
  if budget is not None and need + weights > budget:
    per_window_frame = wan_causal.cache_bytes(model, batch=batch, capacity_frames=1, tokens_per_frame=per_frame)
    room = max((budget - weights) // per_window_frame, 0) + window.chunk_frames
    raise ValueError(f"the stream's KV cache ({window.capacity(frames)} past latent frames, "
                     f"{need / 2**30:.2f} GiB) and "
                     f"the transformer's weights ({weights / 2**30:.2f} GiB) need more than the device's "
                     f"{budget / 2**30:.2f} GiB: stream with a window of at most {room} latent frames "
                     "(--stream-window), or fewer frames")
  return need


def stream_video(pipe: Any, prompts: Sequence[str], *, num_chunks: int, height: int, width: int, seed: int,
                 settings: StreamSettings = StreamSettings(), plan: ParallelPlan | None = None,
                 max_sequence_length: int | None = None,
                 prompts_at: Mapping[int, Sequence[str]] | None = None) -> Iterator[StreamChunk]:
  """Yields each chunk of a causal video as it is made and decoded.

  Args:
    pipe: a loaded `WanPipeline` whose transformer holds causal weights (a tiny or random one runs,
      drawing what an uncausal model draws chunk by chunk).
    prompts: one prompt per video (B); no negative prompt (causal checkpoints run without CFG).
    num_chunks: chunks to make (`StreamSettings.chunks_for` a frame count).
    height, width: pixels, multiples of the VAE's spatial factor times the patch.
    seed: the stream's noise (`wan.causal.chunk_noise` of `jax.random.key(seed)`).
    settings: window and schedule (`StreamSettings`).
    plan: where the transformer runs (None: one device); the decode runs on one device.
    max_sequence_length: text tokens (None: the pipeline's).
    prompts_at: {chunk k: prompts} the prompts from chunk k on (an interactive stream; the frames
      made stay in the cache), or None.

  Raises:
    ValueError: as `check_streamable`, and `wan.causal.CausalStream.latents`'s, before any chunk.
  """
  latent_size = check_streamable(pipe, height, width)
  model = nnx.merge(pipe.compiled_steps.graphdef, pipe.weights.experts[0])
  check_cache_fits(model, settings.window, batch=len(prompts), num_chunks=num_chunks, latent_size=latent_size)
  length = max_sequence_length or pipe.max_sequence_length
  text = pipe.encode_prompts(list(prompts), length)
  text_at = {k: pipe.encode_prompts(list(later), length) for k, later in (prompts_at or {}).items()}
  stream = wan_causal.CausalStream(model, settings.window, settings.schedule, plan)
  chunks = stream.latents(text, num_chunks=num_chunks, latent_size=latent_size, key=jax.random.key(seed),
                          text_at=text_at)
  vae, cache = pipe.vae, None
  start = time.perf_counter()
  for index, latents in enumerate(chunks):
    with matmul_precision(vae.dtype):
      z = vae_latents(vae.config, latents, vae.dtype)
      video, cache = wan_vae.decode_continued(vae, z, cache)
      frames = np.asarray(to_unit_range(video))
    now = time.perf_counter()
    yield StreamChunk(index, np.asarray(latents), frames, now - start)
    start = now
