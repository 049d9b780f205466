"""The VAE's moves in `PlacedWeights` (pipelines/pipeline/load/placement.py): dropped and restored as
it was placed (committed or not), and a VAE assigned while one is dropped is the one kept."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pipelines import WanPipeline


def _leaf(vae):
  return jax.tree.leaves(vae)[0]


@pytest.mark.parametrize("committed", [False, True])
def test_a_dropped_vae_comes_back_as_it_was_placed(committed):
  weights = WanPipeline.tiny(random=True).weights
  if committed:
    weights.vae = jax.device_put(weights.vae, jax.devices()[1])
  before = np.asarray(_leaf(weights.vae))
  assert _leaf(weights.vae).committed == committed
  weights.drop_vae()
  assert isinstance(_leaf(weights.vae), np.ndarray)  # off the device: the host copy
  weights.restore_vae()
  leaf = _leaf(weights.vae)
  assert leaf.committed == committed and leaf.devices() == {jax.devices()[1 if committed else 0]}
  np.testing.assert_array_equal(np.asarray(leaf), before)


def test_a_vae_assigned_while_one_is_dropped_is_kept():
  """`restore_vae` (run at the start of every call) must not bring the dropped VAE's host copy back
  over a VAE the caller set meanwhile; positive control: without the assignment it does restore."""
  weights = WanPipeline.tiny(random=True).weights
  other = WanPipeline.tiny(random=True).weights.vae
  other = jax.tree.map(lambda x: x + 1 if np.issubdtype(x.dtype, np.floating) else x, other)
  weights.drop_vae()
  weights.vae = other
  weights.restore_vae()
  assert weights.vae is other
  weights.drop_vae()
  weights.restore_vae()
  np.testing.assert_array_equal(np.asarray(_leaf(weights.vae)), np.asarray(_leaf(other)))
