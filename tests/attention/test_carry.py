"""The blockwise carry (attention/carry.py): merging partial outputs, and the described empty carry.

`merge_partials` of two key sets equals one pass over all keys (an empty partial is exact); a
`Start` is refused by the kernel and by `attend` when its offsets do not fit the mode, and its
materialised offsets are `fixed_m.row_offsets` bit for bit. Inputs: test_blockwise.py's and
test_kernels.py's first-key-set case.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from attention import BlockSizes, merge_partials
from attention import block_layout, blockwise, fixed_m, kernels
from attention.carry import Start, carry_lse, finish, init_carry
from tests.attention.test_blockwise import _err, _inputs, _scaled
from tests.attention.test_kernels import _start_case
from tests.numerics import fp32_attention_tol as fp32_tol
from tests.numerics import within

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


def test_merge_partials_equals_full_and_guards_empty():
  B, T, S, N, H = 1, 16, 96, 2, 64
  q, k, v = _inputs(B, T, S, N, N, H)
  qs = _scaled(q, 1 / 8).reshape(B, T, N, 1, H).transpose(0, 2, 3, 1, 4)
  ks, vs = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

  @functools.partial(jax.jit, static_argnums=(0, 1))
  def part(lo, hi):
    layout = block_layout.BlockLayout.make(T, hi - lo, BlockSizes(16, 96))
    c = blockwise.attend(init_carry(qs), qs, ks[:, :, lo:hi], vs[:, :, lo:hi], mode="lse",
                         layout=layout, q_pos=jnp.arange(T), kv_pos=jnp.arange(lo, hi))
    return finish(c), carry_lse(c)

  o, lse = merge_partials(*part(0, 40), *part(40, 96))
  o_full, lse_full = part(0, 96)
  within(_err(o, o_full), fp32_tol(v), "merged output")
  # LSE values are ~log2(96) + max logit ~ 10: fp32 ulp ~1e-6; 4e-6 is 4 ulps (measured <= 1 ulp).
  within(_err(lse, lse_full), 4e-6, "merged LSE")
  empty_o, empty_lse = jnp.zeros_like(o), jnp.full_like(lse, -jnp.inf)
  o2, lse2 = merge_partials(o_full, lse_full, empty_o, empty_lse)
  # Bit-exact by arithmetic: the empty partial's weight is exactly 0 and the other's exactly 2^0 = 1.
  assert _err(o2, o_full) == 0.0 and _err(lse2, lse_full) == 0.0
  o3, lse3 = merge_partials(empty_o, empty_lse, empty_o, empty_lse)
  assert bool(jnp.all(o3 == 0)) and bool(jnp.all(jnp.isneginf(lse3)))


def test_start_must_match_the_mode():
  """A Start whose offsets do not fit the mode is refused by the kernel call and by `attend` on
  either backend (the XLA loops would otherwise pin m = -inf: an all-NaN output)."""
  start, layout, qp, kp, vp, kw = _start_case("fixed_m", None, seed=1)
  args = (qp, kp, vp, kw["q_pos"], kw["kv_pos"], None)
  common = dict(bq=128, bk=128, S=layout.S, kv_padded=True, window=None, causal=False, logit_scale=1.0)
  with pytest.raises(ValueError, match="takes no fixed-m offsets"):
    kernels.attend_kernel(start, *args, mode="lse", **common)
  with pytest.raises(ValueError, match="needs fixed-m offsets"):
    kernels.attend_kernel(Start(), *args, mode="fixed_m", **common)
  for backend in ("xla", "pallas"):
    with pytest.raises(ValueError, match="needs fixed-m offsets"):
      blockwise.attend(Start(), qp, kp, vp, mode="fixed_m", layout=dataclasses.replace(layout, backend=backend),
                       q_pos=kw["q_pos"], kv_pos=kw["kv_pos"])


def test_start_offsets_are_row_offsets():
  """`Start.materialise` (the XLA and GPU form of the kernel's offsets) is `fixed_m.row_offsets`:
  one formula, `fixed_m.offsets_of_rows`, bit for bit."""
  start, layout, qp, _, _, kw = _start_case("fixed_m", None, seed=2)
  x = start.offsets
  stats = fixed_m.KeyStats(x.k_mean, x.k_centred_max, jnp.ones_like(x.c_max), jnp.ones((2,)))
  want = fixed_m.row_offsets(qp, stats, x.c_max, windowed=True, logit_scale=kw["logit_scale"])
  got = start.materialise(qp, kw["logit_scale"]).m
  assert bool(jnp.all(got == want)) and bool(jnp.all(jnp.isfinite(got)))
