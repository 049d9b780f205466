"""USP with the fp8 Ulysses exchange (attention/fp8_exchange.py) against a numpy twin of its rounding.

Twin: each device's token chunk of q and v rounded to e4m3 with its own per-(row, head) scale
(absmax / 448), k rounded to bf16, then the dense fp32 reference attention of those inputs. What
the twin leaves out is the output's own e4m3 rounding: <= 2^-4 |o| per element, + 2^-10 of the
(destination block, head) scale in the subnormal range.
"""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from attention import attention_reference, make_mesh, usp_attention
from tests.numerics import fp32_attention_tol

pytestmark = pytest.mark.numerics


def _rounded(x: np.ndarray, chunks: int) -> np.ndarray:
  """x [B, T, N, H] rounded to e4m3 with a scale per (row, token chunk, head)."""
  B, T, N, H = x.shape
  blocks = x.reshape(B, chunks, T // chunks, N, H)
  amax = np.abs(blocks).max(axis=(2, 4), keepdims=True)
  s = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
  return ((blocks / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s).reshape(x.shape)


@pytest.mark.parametrize("implementation", ["lse", "auto"])
def test_fp8_exchange_matches_its_twin(implementation):
  R, U, B, T, N, H = 2, 2, 2, 64, 4, 16
  mesh = make_mesh(ulysses=U, ring=R)
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((B, T, N, H)).astype(np.float32) * w for w in (1.0, 1.0, 1e-3))
  v[:, :5] *= 1e3  # rows of very different sizes: the scale is per (row, chunk, head)
  run = jax.jit(lambda q, k, v: usp_attention(q, k, v, mesh=mesh, implementation=implementation,
                                               exchange="fp8"))
  got = np.asarray(run(q, k, v))
  twin_in = (_rounded(q, R * U), k.astype(ml_dtypes.bfloat16).astype(np.float32), _rounded(v, R * U))
  twin = np.asarray(attention_reference(*(jnp.asarray(x) for x in twin_in)))
  blocks = np.abs(twin).reshape(B, R * U, T // (R * U), N, H).max(axis=(2, 4), keepdims=True)
  s_out = np.broadcast_to(blocks / 448, (B, R * U, T // (R * U), N, H)).reshape(twin.shape)
  bound = 2.0 ** -4 * np.abs(twin) + 2.0 ** -10 * s_out + 2 * fp32_attention_tol(twin_in[2])
  assert np.all(np.abs(got - twin) <= bound), np.max(np.abs(got - twin) / bound)
  plain = np.asarray(usp_attention(q, k, v, mesh=mesh, implementation=implementation))
  assert np.max(np.abs(got - plain)) > 1e-3 * np.max(np.abs(plain))  # control: fp8 did round
  # Still one all-to-all in and one out, each of one byte buffer.
  hlo = run.lower(q, k, v).compile().as_text()
  exchanges = [line for line in hlo.splitlines() if "all-to-all(" in line]
  assert len(exchanges) == 2 and all(re.search(r"= \(?u8\[", line) for line in exchanges), exchanges


def test_bad_exchange_is_refused():
  x = jnp.zeros((1, 8, 4, 16))
  with pytest.raises(ValueError, match="exchange='int4'"):
    usp_attention(x, x, x, mesh=make_mesh(ulysses=2, ring=1), exchange="int4")


def test_request_carries_the_exchange():
  from pipelines.pipeline.checked.model_facts import ModelFacts
  from pipelines.pipeline.checked.request import GenerationRequest

  facts = ModelFacts.tiny_random("bfloat16")
  call = dict(height=32, width=32, num_frames=5, num_inference_steps=1, seed=0, mesh="U=2,R=1")
  fp8 = GenerationRequest.build(facts, "a fox", **call, attention_exchange="fp8")
  bf16 = GenerationRequest.build(facts, "a fox", **call)
  assert fp8.plan.attention_exchange == "fp8" and fp8.settings()["attention_exchange"] == "fp8"
  noise = fp8.noise()
  assert fp8.identity("f" * 64, noise) == bf16.identity("f" * 64, noise) | {"attention_exchange": "fp8"}
  with pytest.raises(ValueError, match="attention_exchange='e5m2'"):
    GenerationRequest.build(facts, "a fox", **call, attention_exchange="e5m2")
