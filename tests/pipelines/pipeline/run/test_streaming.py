"""A loaded pipeline's causal stream: chunks decoded as they come equal the whole video's decode."""

import numpy as np
import pytest

from pipelines.pipeline import WanPipeline
from pipelines.pipeline.run.streaming import StreamSettings, check_streamable, stream_video
from pipelines.wan.causal import CacheWindow


@pytest.fixture(scope="module")
def pipe():
  return WanPipeline.tiny()


def test_chunks_decoded_one_by_one_are_the_whole_videos_decode(pipe):
  """Three chunks of 3 latent frames at 64x64: 9, 12 and 12 frames, which are, frame for frame,
  the one-shot decode of the nine latent frames (the VAE's causal cache carried between chunks;
  fp32, the same programs: equal to rounding)."""
  settings = StreamSettings(window=CacheWindow(3, 6, 0))
  chunks = list(stream_video(pipe, ["a red square moving left"], num_chunks=3, height=64, width=64, seed=0,
                             settings=settings))
  assert [c.frames.shape for c in chunks] == [(1, 9, 64, 64, 3), (1, 12, 64, 64, 3), (1, 12, 64, 64, 3)]
  assert [c.index for c in chunks] == [0, 1, 2] and all(c.seconds > 0 for c in chunks)
  latents = np.concatenate([c.latents for c in chunks], axis=2)
  whole = pipe.decode(latents)
  np.testing.assert_allclose(np.concatenate([c.frames for c in chunks], axis=1), whole, atol=1e-5)
  assert StreamSettings.frames_of(3, 3) == 33 and settings.chunks_for(33) == 3 and settings.chunks_for(34) == 4
  assert float(np.std(whole)) > 1e-2  # a video, not a constant


def test_another_seed_gives_another_stream(pipe):
  """Positive control for the test above: the seed reaches the chunks."""
  one, two = (next(stream_video(pipe, ["a red square moving left"], num_chunks=1, height=64, width=64, seed=s))
              for s in (0, 1))
  assert float(np.mean(np.abs(one.frames - two.frames))) > 1e-3


def test_sizes_that_do_not_patch_are_refused(pipe):
  with pytest.raises(ValueError, match="multiples of 16"):
    check_streamable(pipe, 72, 64)


def test_a_cache_over_the_device_memory_is_refused_naming_a_window(pipe):
  """The cache of a long global-attention stream against a small budget: refused before any compute,
  naming the sizes and a window that fits (which then passes the same check)."""
  from flax import nnx

  from pipelines.pipeline.run.streaming import check_cache_fits

  model = nnx.merge(pipe.compiled_steps.graphdef, pipe.weights.experts[0])
  weights = sum(x.nbytes for x in __import__("jax").tree.leaves(nnx.state(model)))
  budget = weights + 100_000
  with pytest.raises(ValueError, match=r"window of at most (\d+) latent frames") as refused:
    check_cache_fits(model, CacheWindow(3, None, 0), batch=1, num_chunks=400, latent_size=(8, 8), budget=budget)
  room = int(refused.value.args[0].split("window of at most ")[1].split(" ")[0])
  assert check_cache_fits(model, CacheWindow(3, room, 0), batch=1, num_chunks=400, latent_size=(8, 8),
                          budget=budget) <= budget - weights


def test_a_prompt_changed_at_a_chunk_changes_that_chunk_on(pipe):
  """Interactive: "a blue circle ..." from chunk 1 on. Chunk 0 is the plain stream's, bit for bit
  (the change is not seen before it); chunk 1 differs (positive control)."""
  args = dict(num_chunks=2, height=64, width=64, seed=0, settings=StreamSettings(window=CacheWindow(3, 6, 0)))
  plain = list(stream_video(pipe, ["a red square moving left"], **args))
  switched = list(stream_video(pipe, ["a red square moving left"], prompts_at={1: ["a blue circle moving up"]},
                               **args))
  np.testing.assert_array_equal(switched[0].latents, plain[0].latents)
  assert float(np.mean(np.abs(switched[1].latents - plain[1].latents))) > 1e-2
