"""Tests for pipelines/wan/step_cache/forward.py: step caching through `WanPipeline.run(step_cache=...)`.

- threshold 0 never skips, and the cached program's latents equal the uncached ones bit for bit;
- on 2x2, 1x4 and 4x1 meshes a run that skips some steps (and runs others: a positive control)
  skips the same steps as one device and gives the same latents to fp32 tolerance, for both
  methods; the decision is a globally reduced scalar, so a device taking another branch would
  deadlock or show here;
- bad specs refused before compute (what a spec string means: test_spec.py).

Tiny model, 48x80 x 9 frames (45 tokens: every mesh here pads, so the statistics' padding mask is
exercised), 8 steps, CFG on (cond and uncond rows share one decision). Latents are compared
instead of decoded frames (equal latents decode to equal frames; the VAE is not under test). The
pipeline (`tiny`, per module) comes from conftest.py.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

import attention
from pipelines.wan import pretrained, step_cache
from tests.harness import TESTS_DIR

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2

PROMPT = "a red fox running through snow"
KWARGS = dict(height=48, width=80, num_frames=9, num_inference_steps=8, seed=7, max_sequence_length=32,
              progress=False, decode=False)
# MagCache ratios of the random-weight tiny model (measured at 256x256, 50 steps, 512 tokens; the
# shipped mag_ratios_tiny.json belongs to the trained default).
RANDOM_RATIOS = os.path.join(TESTS_DIR, "mag_ratios_tiny_random.json")
# Thresholds that skip some of the 8 steps but not all (checked below, with their margins):
# first-block: the relative L1 change of block 0's residual is 0.10-0.16 per step here; MagCache:
# the random model's ratios are within 1 % of 1, so the error accumulates 0.002-0.01 per step.
SKIPPING = {"first-block": "first-block:0.13", "mag": f"mag:0.01:2@{RANDOM_RATIOS}"}
# fp32 latents of two meshes differ only in summation order (attention, statistics); 1e-5 of the
# latents' unit scale is >= 4x the largest difference measured (2.4e-7 on frames, ~1e-6 latents).
FP32_LATENT_TOL = 1e-5


@pytest.fixture(scope="module")
def uncached(tiny):
  return tiny.run(PROMPT, **KWARGS)


@pytest.mark.parametrize("spec", ["first-block:0", f"mag:0@{RANDOM_RATIOS}"])
def test_threshold_zero_is_the_uncached_run_bit_for_bit(tiny, uncached, spec):
  result = tiny.run(PROMPT, step_cache=spec, **KWARGS)
  record = result.settings["step_cache"]
  assert record["skipped_steps"] == [] and record["skipped_fraction"] == 0.0
  assert len(record["metrics"]) == KWARGS["num_inference_steps"]
  # Bit-exact: block 0 and blocks 1..Z-1 are the same scanned block as the uncached forward, and
  # the statistics never feed back into the computed path.
  np.testing.assert_array_equal(result.latents, uncached.latents)
  assert uncached.settings["step_cache"] is None


@pytest.fixture(scope="module")
def one_device(tiny):
  """Per method: the 1-device run at the skipping threshold."""
  return {method: tiny.run(PROMPT, step_cache=spec, **KWARGS) for method, spec in SKIPPING.items()}


def test_skipping_thresholds_have_margins(one_device, uncached):
  """Positive control: some steps skipped, some run; the decisions are not near a tie (so that a
  different summation order on a mesh cannot flip one); the skipped runs differ from the uncached."""
  steps = KWARGS["num_inference_steps"]
  for method, result in one_device.items():
    record = result.settings["step_cache"]
    assert 0 < len(record["skipped_steps"]) < steps - 1, (method, record)
    assert not np.array_equal(result.latents, uncached.latents), method
  fb = one_device["first-block"].settings["step_cache"]
  margins = [abs(m / fb["threshold"] - 1) for m in fb["metrics"] if m is not None]
  assert min(margins) > 1e-3, fb["metrics"]


# (method, R, U): first-block on the three meshes of the acceptance list; MagCache's decision
# reads no activations, so one mesh covers its cached residual.
MESH_CASES = [("first-block", 2, 2), ("first-block", 1, 4), ("first-block", 4, 1), ("mag", 2, 2)]


@pytest.mark.parametrize("method,ring,ulysses", MESH_CASES, ids=[f"{m}-R{r}xU{u}" for m, r, u in MESH_CASES])
def test_meshes_skip_the_same_steps_as_one_device(tiny, one_device, method, ring, ulysses):
  reference = one_device[method]
  mesh = attention.make_mesh(ulysses=ulysses, ring=ring)
  result = tiny.run(PROMPT, step_cache=SKIPPING[method], mesh=mesh, **KWARGS)
  name = f"{method} R={ring},U={ulysses}"
  assert (result.settings["step_cache"]["skipped_steps"]
          == reference.settings["step_cache"]["skipped_steps"]), name
  err = float(np.max(np.abs(result.latents - reference.latents)))
  assert err <= FP32_LATENT_TOL, f"{name}: max |latents - 1 device| = {err}"


def test_settings_record_and_repeat_call_compiles_nothing(tiny, one_device):
  """The record is JSON-ready; another threshold reuses the compiled step (it is state, not code)."""
  record = one_device["first-block"].settings["step_cache"]
  assert json.loads(json.dumps(record)) == record
  assert record["method"] == "first-block" and record["spec"] == SKIPPING["first-block"]
  assert record["skipped_block_fraction"] == pytest.approx(record["skipped_fraction"] / 2)  # 2 blocks
  traced = tiny.compiled_steps.traces
  again = tiny.run(PROMPT, step_cache="first-block:0.5", **KWARGS)
  assert tiny.compiled_steps.traces == traced
  assert len(again.settings["step_cache"]["skipped_steps"]) > len(record["skipped_steps"])


@pytest.mark.parametrize("spec,match", [
    ("first-block", "not understood"),
    ("first-block:", "not understood"),
    ("first-block:-0.1", "not understood"),
    ("first-block:nan", "not understood"),
    ("first-block:0.1:3", "first-block takes only a threshold"),
    ("teacache:0.1", "not understood"),
    ("mag:0.1:0", "K=0 must be >= 1"),
    ("mag:0.1@/no/such/ratios.json", "does not exist"),
    (0.05, "must be None, 'first-block:THRESH'"),
    (step_cache.StepCacheSpec, "must be None"),
])
def test_bad_specs_refused_before_compute(tiny, spec, match):
  traced = tiny.compiled_steps.traces
  with pytest.raises(ValueError, match=match):
    tiny.run(PROMPT, step_cache=spec, **KWARGS)
  assert tiny.compiled_steps.traces == traced


def test_reset_keeps_the_layout():
  """An expert switch (Wan 2.2) restarts the cache; the state keeps the shardings the compiled step
  expects (residuals sequence-sharded, scalars replicated)."""
  mesh = attention.make_mesh(ulysses=2, ring=2)
  spec = step_cache.parse_step_cache("mag:0.1", model="tiny")
  state = step_cache.init_state(spec, rows=2, tokens=45, config=pretrained.TINY_TRANSFORMER,
                                dtype=np.float32, steps=8, mesh=mesh)
  assert state.residual.shape == (2, 48, pretrained.TINY_TRANSFORMER.dim)  # 45 padded to 4 * 12
  state = dataclasses.replace(state, valid=~state.valid, acc_steps=state.acc_steps + 2)
  again = step_cache.reset(state)
  assert not bool(again.valid) and int(again.acc_steps) == 0 and int(again.step) == 0
  for before, after in zip(jax.tree.leaves(state), jax.tree.leaves(again)):
    assert after.sharding.is_equivalent_to(before.sharding, before.ndim)


class Stop(Exception):
  """Stands for an interruption after a step (as tests/pipelines/pipeline/run/test_resume.py)."""


def test_interrupted_cached_run_resumes_to_the_same_video(tiny, one_device, tmp_path):
  """The cache state is part of the denoising checkpoint: a cached run on 2x2 stopped after step 4
  and resumed on one device skips the uninterrupted run's steps, gives its latents and records
  every step's skip (the earlier ones from the checkpoint); resuming with another step-cache
  setting is refused."""
  folder = str(tmp_path / "ckpt")
  spec = SKIPPING["first-block"]

  def stop_after_4(k, seconds):
    if k + 1 == 4:
      raise Stop

  with pytest.raises(Stop):
    tiny.run(PROMPT, step_cache=spec, mesh="U=2,R=2", checkpoint_dir=folder, on_step=stop_after_4, **KWARGS)
  with pytest.raises(ValueError, match="step_cache"):
    tiny.run(PROMPT, step_cache="first-block:0.5", checkpoint_dir=folder, resume=True, **KWARGS)
  result = tiny.run(PROMPT, step_cache=spec, checkpoint_dir=folder, resume=True, **KWARGS)
  reference = one_device["first-block"].settings["step_cache"]
  record = result.settings["step_cache"]
  # The record covers the whole video, the steps before the resume read from the checkpoint.
  assert record["steps_recorded"] == list(range(KWARGS["num_inference_steps"])) == reference["steps_recorded"]
  assert record["skipped_steps"] == reference["skipped_steps"] and any(k < 4 for k in reference["skipped_steps"])
  assert np.allclose(record["metrics"][1:], reference["metrics"][1:], rtol=1e-4), (record, reference)
  err = float(np.max(np.abs(result.latents - one_device["first-block"].latents)))
  assert err <= FP32_LATENT_TOL, f"resumed cached run: max |latents - uninterrupted| = {err}"

