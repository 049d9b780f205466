"""`end_to_end.bench.block`: one block's parts timed on CPU at tiny sizes (a smoke run; the numbers
are the chip's), its FLOP model against XLA's own count, and bad sizes refused before anything runs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import attention_reference
from end_to_end.bench import block


def test_the_parts_add_up_to_the_block(capsys):
  result = block.main(["--preset", "tiny", "--frames", "5", "--height", "32", "--width", "32", "--text-len", "8",
                       "--dtype", "float32", "--layers", "1,2", "--repeats", "1"])
  assert result["tokens"] == 2 * 2 * 2  # 2 latent frames x (32 / 16)^2 patches
  assert result["matmuls"] > 0 and result["attention"] > 0 and result["cross"] > 0
  assert result["rest"] == result["block"] - result["matmuls"] - result["attention"] - result["cross"]
  out = capsys.readouterr().out
  assert all(name in out for name in ("block", "matmuls", "attention", "cross", "rest")) and "peak" not in out  # CPU


def test_the_parts_operands_are_made_after_the_forwards_are_freed(monkeypatch):
  """The two timing groups never hold their arrays together (a 14B block at 720p on one 16-GB chip):
  while the matmuls and attentions are timed, no forward argument lives (its latents), while the
  forwards are, no part's operand (the [rows T, D] activations); each is alive in its own group."""
  live_shapes = []
  real = block.time_median

  def spy(fns, args, repeats):
    live_shapes.append({a.shape for a in jax.live_arrays()})
    return real(fns, args, repeats)

  monkeypatch.setattr(block, "time_median", spy)
  config = block.PRESETS["tiny"]
  block.parts(config, 2, 5, 32, 32, 8, jnp.float32, (1, 2), 1)
  latents, x = (2, config.in_channels, 2, 4, 4), (2 * 8, config.dim)
  assert latents in live_shapes[0] and x not in live_shapes[0]
  assert x in live_shapes[1] and latents not in live_shapes[1]


def test_attention_parts_take_q_prescaled_as_the_block_writes_it():
  """The self- and cross-attention parts read q as pre-scaled by H^-1/2 log2 e (base-2 logits q.k):
  equal to the dense fp32 reference at scale ln 2 (fp32 blockwise against dense: a few ulps of |v|),
  and not to the reference at the unscaled 1/sqrt(H) (a part that scaled q again)."""
  fns, args = {}, {}
  block.attention_parts(fns, args, np.random.default_rng(0), (1, 40, 2, 16), 8, jnp.float32, "auto")
  for name in ("attention", "cross"):
    got = fns[name](*args[name])
    want = attention_reference(*args[name], scale=math.log(2.0))
    assert float(jnp.max(jnp.abs(got - want))) < 1e-5, name
    assert float(jnp.max(jnp.abs(got - attention_reference(*args[name])))) > 1e-3, name  # control


def test_the_matmul_flops_are_xlas_count():
  """`matmul_flops` against XLA's cost analysis of `matmul_chain` at the 1.3B widths (the GELU's few
  elementwise FLOPs beside 1.3 GFLOP of products: well inside 1 %); a wrong count (the FFN once) is not."""
  D, F, M, Mt = 1536, 8960, 16, 8
  w = {n: jax.ShapeDtypeStruct(s, jnp.float32) for n, s in block.weight_shapes(D, F).items()}
  cost = jax.jit(block.matmul_chain).lower(jax.ShapeDtypeStruct((M, D), jnp.float32),
                                           jax.ShapeDtypeStruct((Mt, D), jnp.float32), w).compile().cost_analysis()
  counted = (cost[0] if isinstance(cost, list) else cost)["flops"]
  modelled = block.matmul_flops(1, M, Mt, D, F)
  assert abs(counted - modelled) < 0.01 * modelled, (counted, modelled)
  assert abs(counted - (modelled - 2.0 * M * D * F)) > 0.01 * modelled  # control


@pytest.mark.parametrize("flags, message", [
    (["--layers", "3,1"], "--layers '3,1': give two block counts"),
    (["--layers", "two"], "--layers 'two': give two block counts"),
    (["--frames", "6"], "frames=6, height=480, width=832: frames must be 4k + 1"),
    (["--height", "100"], "frames=81, height=100, width=832"),
])
def test_bad_sizes_are_refused_naming_the_value(capsys, flags, message):
  with pytest.raises(SystemExit):
    block.main(["--preset", "tiny", *flags])
  assert message in capsys.readouterr().err
