"""The host cache of encoded prompts (`pipeline.text_cache`); the pipeline's use of it:
test_memory_plan.py (`test_prompts_seen_before_need_no_encoder`)."""

import numpy as np
import pytest

from pipelines.pipeline.run.text_cache import TextStatesCache


def test_text_cache_keeps_the_most_recent_prompts():
  cache = TextStatesCache(capacity=2)
  encode = lambda prompts, length: np.stack([np.full((length, 3), len(p), np.float32) for p in prompts])
  cache.fill(["a", "bb", "ccc"], 4, encode)  # one call's prompts all stay, over the capacity
  assert len(cache) == 3 and cache.missing(["a", "dd"], 4) == ["dd"] and cache.missing(["a"], 5) == ["a"]
  cache.fill(["dd"], 4, encode)
  assert cache.missing(["a", "bb", "ccc", "dd"], 4) == ["a", "bb"]  # the least recently used left first
  np.testing.assert_array_equal(np.asarray(cache.get(["dd", "ccc"], 4))[:, 0, 0], [2, 3])



def test_a_prompt_not_filled_is_refused():
  cache = TextStatesCache()
  with pytest.raises(KeyError):
    cache.get(["never encoded"], 4)
