"""The seed's one owner (pipelines/pipeline/checked/seed.py): the random draw, seed -> noise, and the request
seeded with one int or one seed per video."""

import numpy as np
import pytest

from pipelines.pipeline.checked import seed as seeding
from pipelines.pipeline.checked.model_facts import ModelFacts
from pipelines.pipeline.checked.request import GenerationRequest

CALL = dict(height=32, width=32, num_frames=5, num_inference_steps=1)


def test_random_seeds_lie_in_the_int32_range_and_differ():
  drawn = [seeding.random_seed() for _ in range(64)]
  assert all(isinstance(s, int) and 0 <= s < 2 ** 31 for s in drawn)
  assert len(set(drawn)) > 1  # 64 equal draws from 2**31 values: p = 2**-1984


def test_video_seeds_count_up_from_one_int_or_are_given_one_per_video():
  assert seeding.video_seeds(7, 3) == (7, 8, 9)
  assert seeding.video_seeds([5, 1, 5], 3) == (5, 1, 5)
  with pytest.raises(ValueError, match=r"seed=\[1, 2\] holds 2 seeds for 3 videos"):
    seeding.video_seeds([1, 2], 3)


def test_seeded_noise_is_each_seeds_own_draw():
  """Video i is default_rng(seed_i)'s draw of [C, F, Hl, Wl], whatever else is in the batch: the rule
  the pipeline has used since its first release (old checkpoints' noise digests still match)."""
  shape = (4, 2, 3, 5)
  noise = seeding.seeded_noise((3, 11), shape)
  assert noise.shape == (2, *shape) and noise.dtype == np.float32
  for i, s in enumerate((3, 11)):
    np.testing.assert_array_equal(noise[i], np.random.default_rng(s).standard_normal(shape, np.float32))
  np.testing.assert_array_equal(seeding.seeded_noise((11,), shape)[0], noise[1])


@pytest.fixture(scope="module")
def facts():
  return ModelFacts.tiny_random("float32")


def test_a_request_seeded_per_video_equals_its_videos_run_alone(facts):
  batch = GenerationRequest.build(facts, ["a fox", "an owl"], ["blur", "noise"], seed=[4, 9], **CALL)
  alone = [GenerationRequest.build(facts, p, n, seed=s, **CALL) for p, n, s in (("a fox", "blur", 4),
                                                                                ("an owl", "noise", 9))]
  np.testing.assert_array_equal(batch.noise(), np.concatenate([r.noise() for r in alone]))
  settings = batch.settings()
  assert settings["seed"] == [4, 9] and settings["explicit_latents"] is False
  for i, one in enumerate(alone):
    assert batch.video_settings(settings, i) == one.settings()  # its sidecar says what a run alone says


def test_video_settings_of_one_seed_and_videos_per_prompt(facts):
  """Video i of B prompts x n comes from prompt i // n with seed + i (n = 2 here)."""
  request = GenerationRequest.build(facts, ["a fox", "an owl"], seed=10, num_videos_per_prompt=2, **CALL)
  third = request.video_settings(request.settings(), 3)
  assert (third["prompts"], third["seed"], third["num_videos_per_prompt"]) == (["an owl"], 13, 1)
  alone = GenerationRequest.build(facts, "an owl", seed=13, **CALL)
  np.testing.assert_array_equal(request.noise()[3], alone.noise()[0])
  given = GenerationRequest.build(facts, "a fox", latents=alone.noise(), **CALL)
  assert given.video_settings(given.settings(), 0)["seed"] is None  # latents given: no seed to name


@pytest.mark.parametrize("seed, words", [([1], "holds 1 seeds for 2 videos"),
                                         ([1, -2], r"seed\[1\]=-2 must be a non-negative"),
                                         ([1, 2.0], r"seed\[1\]=2.0 must be a non-negative int"),
                                         (-1, "seed=-1 must be a non-negative")])
def test_bad_seeds_are_refused_naming_them(facts, seed, words):
  with pytest.raises(ValueError, match=words):
    GenerationRequest.build(facts, ["a fox", "an owl"], seed=seed, **CALL)


def test_no_seed_draws_one_and_reports_it(facts):
  request = GenerationRequest.build(facts, "a fox", **CALL)
  assert isinstance(request.seed, int) and 0 <= request.seed < 2 ** 31
  assert request.settings()["seed"] == request.seed and request.latents is None
