"""The mesh planner (pipelines/parallel/planner.py): which candidates fit a chip (the 14B model on v5e
only with sharded weights) and the held cross-attention K/V in the memory per device."""

from __future__ import annotations

import pytest

from pipelines.parallel import planner
from pipelines.pipeline.checked.model_facts import token_facts
from pipelines.wan.transformer import PRESETS, param_counts


def wan21_tokens(model):
  """The `TokenFacts` of a Wan 2.1 folder's model (its VAE: 8x spatial, 4x temporal; L = 512)."""
  return token_facts(model, spatial_factor=8, temporal_factor=4, text_tokens=512)


def test_planner_fits_14b_only_with_sharded_weights_on_v5e():
  model = PRESETS["wan2.1-t2v-14b"]
  found = planner.candidates(model, wan21_tokens(model), param_counts=param_counts(model), devices=8, frames=81,
                             height=720, width=1280, chip=planner.CHIPS["v5e"])
  assert {c.mesh.shard_weights for c in found if c.fits} == {True}
  assert any(not c.fits for c in found)  # replicated 28.6 GB of weights: not on a 16 GiB chip
  best = planner.recommend(found)
  assert best is not None and best.fits and best.mesh.devices == 8
  # every candidate is valid: U splits the 40 heads, C * R * U = 8, CFG=2 present
  assert all(40 % c.mesh.ulysses == 0 and c.mesh.devices == 8 for c in found)
  assert {c.mesh.cfg for c in found} == {1, 2}


def test_planner_counts_the_held_cross_attention_kv():
  """The text K/V held for the run ([Z, rows/C, L, N, H] x 2; Wan 2.1 I2V: + the image's 257 tokens)
  are in the memory per device: 14B under CFG in bf16, 2 x 40 x 2 x 512 x 5120 x 2 bytes = 0.84 GB
  (DESIGN.md section 2), halved by a CFG-split mesh; the I2V model holds 769 tokens' worth."""
  kwargs = dict(devices=8, frames=81, height=720, width=1280, chip=planner.CHIPS["v6e"])
  t2v, i2v = PRESETS["wan2.1-t2v-14b"], PRESETS["wan2.1-i2v-14b"]
  for model, tokens in ((t2v, 512), (i2v, 512 + 257)):
    for c in planner.candidates(model, wan21_tokens(model), param_counts=param_counts(model), **kwargs):
      want = 2 * 40 * (2 // c.mesh.cfg) * tokens * 5120 * 2
      assert c.kv_bytes == want, (str(c.mesh), c.kv_bytes, want)
      assert c.bytes_per_device == c.weight_bytes + c.activation_bytes + c.kv_bytes
      assert c.to_dict()["kv_bytes"] == want
  assert 2 * 40 * 2 * 512 * 5120 * 2 == pytest.approx(0.84e9, rel=2e-3)


def test_planner_counts_the_vace_blocks():
  """A VACE 14B (8 VACE blocks on the 14B's 40) against the 14B itself, mesh by mesh: the 8 blocks'
  weights, FLOPs (48 / 40 of the 14B's), exchanges and text K/V, and the 8 hints held at once (one
  [rows/C, T/(R U), D] stream each); then the planner's pick for 720p x 81 on v6e fits with sharded
  weights, as the step compiled for that topology does (docs/measurements/tpu-step.md)."""
  from pipelines.parallel import estimate

  kwargs = dict(devices=8, frames=81, height=720, width=1280, chip=planner.CHIPS["v6e"])
  t2v, vace = PRESETS["wan2.1-t2v-14b"], PRESETS["wan2.1-vace-14b"]
  assert estimate.forward_blocks(t2v) == 40 and estimate.forward_blocks(vace) == 48
  plain = {str(c.mesh): c for c in planner.candidates(t2v, wan21_tokens(t2v), param_counts=param_counts(t2v), **kwargs)}
  found = planner.candidates(vace, wan21_tokens(vace), param_counts=param_counts(vace), **kwargs)
  assert {str(c.mesh) for c in found} == set(plain)
  tokens = 21 * 45 * 80
  for c in found:
    base, sequence = plain[str(c.mesh)], c.mesh.ulysses * c.mesh.ring
    assert c.flops_per_device == pytest.approx(base.flops_per_device * 48 / 40, rel=1e-12)
    assert c.kv_bytes == base.kv_bytes * 48 // 40
    assert c.collective_bytes["all_to_all"] == pytest.approx(base.collective_bytes["all_to_all"] * 48 / 40, rel=1e-12)
    hints = 8 * (2 // c.mesh.cfg) * -(-tokens // sequence) * 5120 * 2
    assert c.activation_bytes == base.activation_bytes + hints, str(c.mesh)
    assert c.weight_bytes > base.weight_bytes
  best = planner.recommend(found)
  assert best is not None and best.fits and best.mesh.shard_weights


def test_context_windows_size_memory_by_a_window_and_consider_w():
  """With context windows the planner sizes activations by one window's tokens (not the video's),
  offers W up to the windows' count, and models W windows a round: the 14B at 720p x 241 frames in
  windows of 81 (5 windows) on 8 v6e chips."""
  from pipelines.parallel import planner

  config = PRESETS["wan2.1-t2v-14b"]
  facts = token_facts(config, spatial_factor=8, temporal_factor=4, text_tokens=512)
  common = dict(param_counts=param_counts(config), devices=8, frames=241, height=720, width=1280,
                chip=planner.CHIPS["v6e"])
  clip = {str(c.mesh) + str(c.mesh.shard_weights): c for c in planner.candidates(config, facts, **common)}
  found = planner.candidates(config, facts, **common, windows=(81, 5))
  windowed = {str(c.mesh) + str(c.mesh.shard_weights): c for c in found}
  assert {c.mesh.windows for c in found} == {1, 2, 4}  # W <= 5 windows and not {c.mesh.windows for c in clip.values()} - {1}
  one, two = windowed["U=8,R=1False"], windowed["W=2,U=4,R=1False"]
  assert one.activation_bytes < clip["U=8,R=1False"].activation_bytes / 2  # 75,600 tokens a forward, not 219,600
  assert two.flops_per_device == pytest.approx(one.flops_per_device * 6 / 5)  # 3 rounds of 2 (a padding slot)
  assert two.collective_bytes["windows_all_reduce"] > 0 == one.collective_bytes["windows_all_reduce"]
