"""end_to_end.bench.int8: its flash kernel computes attention (bf16 and int8 QK^T, Pallas interpret
mode, against fp32 softmax attention within bounds derived from the rounding), and its command runs."""

import json
import math

import jax
import jax.numpy as jnp
import pytest

from end_to_end.bench import int8 as bench


def _case(N=2, T=256, H=128, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  q, k, v = (jax.random.normal(key, (N, T, H), jnp.float32) for key in keys)
  return q * (H ** -0.5 * math.log2(math.e)), k, v.astype(jnp.bfloat16)


def _check(out, q, k, v):
  """The kernel against fp32 softmax attention on the same q, k values (base-2 logits) and v.

  Left to the kernel: p = 2^(s - offset) rounded once to bf16 for P V (<= 2^-9 relative), the output
  rounded once to bf16 (<= 2^-9 of |out| <= softmax |v|), fp32 sums: per element |out - ref| <=
  3 2^-9 (softmax |v|), doubled for the sums' order."""
  w = jax.nn.softmax(jnp.einsum("nth,nsh->nts", q, k) * math.log(2.0), axis=-1)
  v32 = v.astype(jnp.float32)
  err = jnp.abs(out.astype(jnp.float32) - w @ v32)
  bound = 3 * 2.0 ** -8 * (w @ jnp.abs(v32))
  assert bool(jnp.all(err <= bound)), float(jnp.max(err / bound))
  return float(jnp.max(err))


@pytest.mark.numerics
def test_flash_bf16_is_attention():
  q, k, v = (x.astype(jnp.bfloat16) for x in _case())
  out = bench.flash(q, k, v, jnp.ones((*q.shape[:2], bench.LANES)), bq=128, bk=128, offset=4.0, interpret=True)
  _check(out, q.astype(jnp.float32), k.astype(jnp.float32), v)


@pytest.mark.numerics
def test_flash_int8_qk_is_attention_and_its_scales_matter():
  q, k, v = _case(seed=1)
  q8, k8, scales = bench.int8_attention_inputs(q, k)
  assert q8.dtype == k8.dtype == jnp.int8 and scales.shape == (*q.shape[:2], bench.LANES)
  out = bench.flash(q8, k8, v, scales, bq=128, bk=128, offset=4.0, interpret=True)
  # The values the kernel multiplies: q8 q_scale and k8 k_scale (k centred: a constant per row of
  # logits, which softmax ignores); their product is exact in int32, then scaled in fp32.
  k_c = k - jnp.mean(k, axis=1, keepdims=True)
  k_scale = jnp.max(jnp.abs(k_c), axis=(1, 2), keepdims=True) / 127.0
  q_scale = scales[..., :1] / k_scale
  err = _check(out, q8 * q_scale, k8 * k_scale, v)
  unscaled = bench.flash(q8, k8, v, jnp.full_like(scales, 1e-3), bq=128, bk=128, offset=4.0, interpret=True)
  assert float(jnp.max(jnp.abs(unscaled.astype(jnp.float32) - out.astype(jnp.float32)))) > 10 * err  # control


def test_command_runs_and_writes_every_row(tmp_path, capsys):
  path = tmp_path / "int8.json"
  assert bench.main(["--tokens", "128", "--matmuls", "128x256", "--seq", "256", "--heads", "1", "--blocks", "128x128",
                     "--repeats", "1", "--interpret", "--json", str(path)]) == 0
  result = json.loads(path.read_text())
  assert set(result["attention"]) == {"bf16 128x128", "int8 128x128"}
  assert set(result["matmul"]["128x128x256"]) == {"bf16", "int8->int32", "int8 scaled", "x quantized + int8 scaled",
                                                   "Dense weight-only", "Dense w8a8"}
  assert "int8 / bf16 at 128x128" in capsys.readouterr().out


def test_a_length_off_the_blocks_is_refused(capsys):
  assert bench.main(["--seq", "1000", "--skip", "matmul"]) == 2
  assert "--seq 1000" in capsys.readouterr().err
