"""The input checks every attention path runs before any compute (attention/masks.py `validate_qkv`),
through `local_attention` (which adds the implementation name's check), each naming what is wrong."""

import jax.numpy as jnp
import pytest

from attention import local_attention

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


@pytest.mark.parametrize("case,match", [
    (dict(q=(2, 8, 4)), "rank 4"),
    (dict(k=(2, 9, 3, 16), v=(2, 9, 3, 16)), "multiple of kv heads"),
    (dict(v=(2, 10, 2, 16)), "k and v shapes differ"),
    (dict(k=(3, 9, 2, 16), v=(3, 9, 2, 16)), "batch/head-dim mismatch"),
    (dict(kdtype=jnp.bfloat16), "dtypes differ"),
    (dict(kv_valid_len=jnp.ones((3,), jnp.int32)), "kv_valid_len"),
    (dict(window=-1), "window"),
    (dict(implementation="flash"), "unknown implementation"),
])
def test_bad_input_raises(case, match):
  q = jnp.zeros(case.get("q", (2, 8, 4, 16)))
  k = jnp.zeros(case.get("k", (2, 9, 2, 16)), case.get("kdtype", jnp.float32))
  v = jnp.zeros(case.get("v", (2, 9, 2, 16)), case.get("kdtype", jnp.float32))
  with pytest.raises(ValueError, match=match):
    local_attention(q, k, v, kv_valid_len=case.get("kv_valid_len"), window=case.get("window"),
                    implementation=case.get("implementation", "auto"))
