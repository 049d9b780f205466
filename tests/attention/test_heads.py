"""Operands read in place from one heads-major buffer (attention/heads.py): both Pallas kernels (in
interpret mode) and the XLA loops give the bits they give for the same heads sliced into arrays."""

import jax.numpy as jnp
import numpy as np
import pytest

from attention import block_layout, blockwise, kernels
from attention.carry import Start
from attention.heads import Heads, update_dims

pytestmark = pytest.mark.numerics


def _buffer(B, K, G, T, H, seed=0):
  """USP's received layout [B, K * G + 2K, T, H]: query heads, then keys, then values."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal((B, K * G + 2 * K, T, H)), jnp.float32)


@pytest.mark.parametrize("K,G", [(2, 1), (1, 4), (2, 2)])  # (1, 4): 6 heads, no multiple of G = 4
@pytest.mark.parametrize("kernel", ["tpu", "gpu", None])
def test_in_place_equals_sliced(K, G, kernel):
  B, T, H, N = 1, 256, 32, K * G
  buf = _buffer(B, K, G, T, H, seed=K * 10 + G)
  q, kv = Heads(buf, 0, N), Heads(buf, N, 2 * K)
  assert update_dims(q, kv, None) == (B, K, G, T, H)
  q_arr, kv_arr = buf[:, :N].reshape(B, K, G, T, H), buf[:, N:]
  pos = jnp.arange(T, dtype=jnp.int32)
  limit = jnp.asarray([200], jnp.int32)
  if kernel is None:  # the XLA loops slice the heads out
    layout = block_layout.BlockLayout.make(T, T, blockwise.BlockSizes(block_q=128, block_kv=128))
    call = lambda q, kv: blockwise.attend(Start(), q, kv, None, mode="lse", layout=layout, q_pos=pos, kv_pos=pos,
                                          kv_limit=limit, logit_scale=0.25, finish_to=jnp.float32)
  else:
    call = lambda q, kv: kernels.attend_kernel(Start(), q, kv, None, pos, pos, limit, mode="lse", bq=128, bk=128,
                                               S=T, kv_padded=False, window=None, causal=False, logit_scale=0.25,
                                               finish_to=jnp.float32, kernel=kernel)
  got, want = call(q, kv), call(q_arr, kv_arr)
  assert got.shape == (B, K, G, T, H)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert float(jnp.max(jnp.abs(want))) > 0.1  # not vacuous


def test_queries_that_do_not_split_over_the_kv_heads_are_refused():
  buf = _buffer(1, 2, 1, 128, 32)
  with pytest.raises(ValueError, match="do not split"):
    update_dims(Heads(buf, 0, 3), Heads(buf, 3, 4), None)
