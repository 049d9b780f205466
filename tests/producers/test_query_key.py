"""Tests for producers/query_key.py (issue 4): q/k RMSNorm + RoPE against a float64 oracle with
diffusers' rounding points, diffusers' `WanAttention` parity (fp32 and bf16), shard invariance, and
the no-rotation form (Wan's cross-attention q/k)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import producers
from producers import rmsnorm_rope, wan_rope_table
from tests.numerics import assert_close_scaled
from tests.producers.rounding import GRID, NUM_TOKENS, Q_SCALE, _assert_bf16_rounding_points, _f32_rel, _round_to

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


def _rmsnorm_rope_exact(x, weight, cos, sin, *, num_heads, eps=1e-6, out_scale=None):
  """float64 oracle with diffusers' rounding points: the norm output is rounded to x.dtype (not for
  fp32), all else is exact. Returns float64 [B, T, N, H] before the final rounding to x.dtype."""
  xd, wd = np.asarray(x, np.float64), np.asarray(weight, np.float64)
  y = xd / np.sqrt(np.mean(xd**2, axis=-1, keepdims=True) + eps) * wd
  if x.dtype != jnp.float32:
    y = _round_to(y, x.dtype)
  batch, tokens, width = x.shape
  head_dim = width // num_heads
  if cos is None:
    out = y.reshape(batch, tokens, num_heads, head_dim)
  else:
    pairs = y.reshape(batch, tokens, num_heads, head_dim // 2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    c = np.asarray(cos, np.float64)[None, :, None, :]
    s = np.asarray(sin, np.float64)[None, :, None, :]
    out = np.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)
    out = out.reshape(batch, tokens, num_heads, head_dim)
  return out * (1.0 if out_scale is None else out_scale)


def _pair_norm(out_BTNH):
  """Norm of each rotated channel pair (2i, 2i+1), repeated to [B, T, N, H]."""
  pairs = np.asarray(out_BTNH, np.float64).reshape(*out_BTNH.shape[:-1], -1, 2)
  return np.repeat(np.sqrt((pairs**2).sum(-1)), 2, axis=-1)


def _assert_matches_exact(out, exact, dtype, *, width, name):
  """`out` (fp32 or bf16) against `_rmsnorm_rope_exact`, in units of each rotated pair's norm (the
  rotation's sums cancel, so an element's own magnitude is not its error's scale)."""
  scale = _pair_norm(exact)
  if np.dtype(dtype) == np.dtype(jnp.float32):
    assert_close_scaled(out, exact, rel=_f32_rel(width), scale=scale, name=name)
  else:
    _assert_bf16_rounding_points(out, _round_to(exact, dtype), scale, roundings=2, width=width,
                                 name=name)


def _random_qk(key, batch, tokens, num_heads, head_dim, dtype):
  kx, kw = jax.random.split(key)
  width = num_heads * head_dim
  x = (3.0 * jax.random.normal(kx, (batch, tokens, width))).astype(dtype)
  weight = (1.0 + 0.3 * jax.random.normal(kw, (width,))).astype(dtype)
  return x, weight


@pytest.mark.parametrize("dtype,num_heads,head_dim,out_scale", [
    (jnp.float32, 4, 64, None), (jnp.float32, 2, 128, Q_SCALE),
    (jnp.bfloat16, 4, 64, Q_SCALE), (jnp.bfloat16, 2, 128, None)])
def test_rmsnorm_rope_matches_exact_math_for_t_ne_s(dtype, num_heads, head_dim, out_scale):
  # The property we own: fp32 statistics (fp32 results within fp32 rounding of the exact math) and,
  # in bf16, diffusers' rounding points (the norm output rounded before the rotation).
  # q: T = 35 tokens (the middle third of the grid), k: S = 105 tokens (all of it).
  x_q, weight_q = _random_qk(jax.random.key(0), 2, 35, num_heads, head_dim, dtype)
  x_k, weight_k = _random_qk(jax.random.key(1), 2, NUM_TOKENS, num_heads, head_dim, dtype)
  cos_q, sin_q = wan_rope_table(GRID, head_dim, start=35, length=35)
  cos_k, sin_k = wan_rope_table(GRID, head_dim)
  kwargs = dict(num_heads=num_heads, out_scale=out_scale)
  width = num_heads * head_dim
  for x, weight, cos, sin in ((x_q, weight_q, cos_q, sin_q), (x_k, weight_k, cos_k, sin_k)):
    fused = rmsnorm_rope(x, weight, cos, sin, **kwargs)
    assert fused.shape == (2, x.shape[1], num_heads, head_dim) and fused.dtype == dtype
    exact = _rmsnorm_rope_exact(x, weight, cos, sin, **kwargs)
    _assert_matches_exact(fused, exact, dtype, width=width, name=f"T={x.shape[1]}")
  if dtype == jnp.bfloat16:  # positive control (k's call): no rounding before the rotation
    no_mid_rounding = _rmsnorm_rope_exact(x.astype(jnp.float32), weight, cos, sin, **kwargs)
    assert np.mean(np.asarray(fused, np.float64) != _round_to(no_mid_rounding, dtype)) > 0.1
  # q's rows are the matching rows of a full-length call on the same inputs (global positions).
  x_full = jnp.zeros((2, NUM_TOKENS, width), dtype).at[:, 35:70].set(x_q)
  full = rmsnorm_rope(x_full, weight_q, cos_k, sin_k, **kwargs)
  exact_q = _rmsnorm_rope_exact(x_q, weight_q, cos_q, sin_q, **kwargs)
  _assert_matches_exact(full[:, 35:70], exact_q, dtype, width=width, name="rows 35:70 of T=105")


def _capture_diffusers_qk(monkeypatch, torch, dtype, num_heads, head_dim):
  """Runs diffusers' WanAttention self-attention; returns (hidden, attn, q_after_rope, k_after)."""
  from diffusers.models.transformers import transformer_wan

  width = num_heads * head_dim
  torch.manual_seed(0)
  attn = transformer_wan.WanAttention(dim=width, heads=num_heads, dim_head=head_dim, eps=1e-6,
                                      processor=transformer_wan.WanAttnProcessor())
  with torch.no_grad():
    attn.norm_q.weight.copy_(1.0 + 0.3 * torch.randn(width))
    attn.norm_k.weight.copy_(1.0 + 0.3 * torch.randn(width))
  attn = attn.to(dtype)
  rope = transformer_wan.WanRotaryPosEmbed(head_dim, (1, 2, 2), max_seq_len=1024)
  rotary_emb = rope(torch.zeros(1, 4, GRID[0], 2 * GRID[1], 2 * GRID[2]))
  captured = {}

  def capture(query, key, value, **kwargs):
    captured["q"], captured["k"] = query, key
    return query

  monkeypatch.setattr(transformer_wan, "dispatch_attention_fn", capture)
  hidden = torch.randn(2, NUM_TOKENS, width).to(dtype)
  with torch.no_grad():
    attn(hidden, None, None, rotary_emb)
  return hidden, attn, captured["q"], captured["k"]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rmsnorm_rope_matches_diffusers_wan_attention_fp32(monkeypatch, head_dim):
  torch = pytest.importorskip("torch")
  num_heads = 2
  hidden, attn, q_torch, k_torch = _capture_diffusers_qk(monkeypatch, torch, torch.float32,
                                                         num_heads, head_dim)
  cos, sin = wan_rope_table(GRID, head_dim)
  for name, proj, norm, want in (("q", attn.to_q, attn.norm_q, q_torch),
                                 ("k", attn.to_k, attn.norm_k, k_torch)):
    with torch.no_grad():
      x = jnp.asarray(proj(hidden).numpy())
    out = rmsnorm_rope(x, jnp.asarray(norm.weight.detach().numpy()), cos, sin,
                       num_heads=num_heads, eps=norm.eps)
    want = want.numpy()
    assert_close_scaled(out, want, rel=_f32_rel(num_heads * head_dim), scale=_pair_norm(want),
                        name=f"{name} vs diffusers")


def test_rmsnorm_rope_matches_diffusers_wan_attention_bf16(monkeypatch):
  torch = pytest.importorskip("torch")
  num_heads, head_dim = 2, 128
  hidden, attn, q_torch, _ = _capture_diffusers_qk(monkeypatch, torch, torch.bfloat16,
                                                   num_heads, head_dim)
  with torch.no_grad():
    x = jnp.asarray(attn.to_q(hidden).float().numpy()).astype(jnp.bfloat16)
  weight = jnp.asarray(attn.norm_q.weight.detach().float().numpy()).astype(jnp.bfloat16)
  cos, sin = wan_rope_table(GRID, head_dim)
  out = rmsnorm_rope(x, weight, cos, sin, num_heads=num_heads)
  assert out.dtype == jnp.bfloat16
  want = q_torch.float().numpy()
  # Same roundings as diffusers (norm output rounded to bf16 before the rotation): nearly all equal.
  _assert_bf16_rounding_points(out, want, _pair_norm(want), roundings=2,
                               width=num_heads * head_dim, name="q vs diffusers bf16")


def _pad_tokens(x, total):
  return jnp.pad(x, ((0, 0), (0, total - x.shape[1]), (0, 0)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16])
def test_rmsnorm_rope_four_shards_concatenate_to_unsharded(dtype):
  num_heads, head_dim, shards = 2, 64, 4
  shard_len = -(-NUM_TOKENS // shards)  # 27; the last shard holds 24 tokens + 3 padding
  x, weight = _random_qk(jax.random.key(2), 2, NUM_TOKENS, num_heads, head_dim, dtype)
  cos, sin = wan_rope_table(GRID, head_dim)
  full = rmsnorm_rope(x, weight, cos, sin, num_heads=num_heads, out_scale=Q_SCALE)
  exact = _rmsnorm_rope_exact(x, weight, cos, sin, num_heads=num_heads, out_scale=Q_SCALE)
  x_padded = _pad_tokens(x, shards * shard_len)

  # Python-int offsets, one shard at a time.
  parts = []
  for i in range(shards):
    cos_i, sin_i = wan_rope_table(GRID, head_dim, start=i * shard_len, length=shard_len)
    parts.append(rmsnorm_rope(x_padded[:, i * shard_len:(i + 1) * shard_len], weight, cos_i, sin_i,
                              num_heads=num_heads, out_scale=Q_SCALE))
  looped = np.asarray(jnp.concatenate(parts, axis=1), np.float32)

  # Traced offsets inside shard_map, as USP runs it (a 1-D mesh: only the offsets matter here).
  mesh = jax.make_mesh((shards,), ("tokens",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:shards])
  token_spec = P(None, "tokens")

  def per_shard(x_shard, weight):
    start = jax.lax.axis_index("tokens") * shard_len
    cos_s, sin_s = wan_rope_table(GRID, head_dim, start=start, length=shard_len)
    return rmsnorm_rope(x_shard, weight, cos_s, sin_s, num_heads=num_heads, out_scale=Q_SCALE)

  sharded_fn = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(token_spec, P()),
                                     out_specs=token_spec))
  sharded = np.asarray(sharded_fn(x_padded, weight), np.float32)

  # Each way of cutting the tokens computes every row as the exact math does (a wrong offset
  # rotates by the wrong angles: O(1) errors); not bit-exact, as the programs differ in shape.
  width = num_heads * head_dim
  _assert_matches_exact(full, exact, dtype, width=width, name="unsharded")
  for name, got in (("looped", looped), ("shard_map", sharded)):
    assert got.shape == (2, shards * shard_len, num_heads, head_dim)
    _assert_matches_exact(got[:, :NUM_TOKENS], exact, dtype, width=width, name=name)
    # Exact: zero padding stays zero through the norm (0 * rsqrt(eps)) and the rotation.
    assert (got[:, NUM_TOKENS:] == 0).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rmsnorm_without_rotation_is_plain_rmsnorm(dtype):
  # Wan's cross-attention q/k: RMSNorm across heads, no RoPE (cos = sin = None).
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((2, 90, 64)), dtype)
  weight = jnp.asarray(rng.standard_normal(64), dtype)
  out = producers.rmsnorm_rope(x, weight, None, None, num_heads=4)
  assert out.shape == (2, 90, 4, 16) and out.dtype == dtype
  exact = _rmsnorm_rope_exact(x, weight, None, None, num_heads=4)
  # A product x * rsqrt(mean square) * gain: no cancellation, so each element's own magnitude is
  # its error's scale.
  if dtype == jnp.float32:
    assert_close_scaled(out, exact, rel=_f32_rel(64), scale=np.abs(exact), name="rmsnorm")
  else:
    _assert_bf16_rounding_points(out, _round_to(exact, dtype), np.abs(exact), roundings=1,
                                 width=64, name="rmsnorm")
  with pytest.raises(ValueError, match="both rotary tables"):
    producers.rmsnorm_rope(x, weight, jnp.ones((90, 8)), None, num_heads=4)


def test_prescaled_query_without_rotation_is_rounded_once():
  """The cross-attention q (no RoPE) with out_scale: round(norm * out_scale), one rounding to bf16
  as diffusers' q has, not round(round(norm) * out_scale) (two, doubling q's error; the control:
  the twice-rounded values differ from the output in many elements)."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((2, 90, 64)) * 3.0, jnp.bfloat16)
  weight = jnp.asarray(1.0 + 0.3 * rng.standard_normal(64), jnp.bfloat16)
  out = producers.rmsnorm_rope(x, weight, None, None, num_heads=4, out_scale=Q_SCALE)
  xd, wd = np.asarray(x, np.float64), np.asarray(weight, np.float64)
  norm = (xd / np.sqrt(np.mean(xd**2, axis=-1, keepdims=True) + 1e-6) * wd).reshape(2, 90, 4, 16)
  exact = norm * Q_SCALE
  _assert_bf16_rounding_points(out, _round_to(exact, jnp.bfloat16), np.abs(exact), roundings=1, width=64,
                               name="prescaled q")
  twice = _round_to(_round_to(norm, jnp.bfloat16) * Q_SCALE, jnp.bfloat16)
  assert np.mean(np.asarray(out, np.float64) != twice) > 0.05


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rotate", [True, False])
def test_input_split_into_heads_gives_the_same_output(dtype, rotate):
  """x already [B, T, N, H] (`Dense.heads`, what the Wan block passes) gives the [B, T, D] input's
  output bitwise: the statistics sum the same D squares, the rest is elementwise."""
  x, weight = _random_qk(jax.random.key(7), 2, 90, 4, 32, dtype)
  cos, sin = wan_rope_table(GRID, 32, length=90) if rotate else (None, None)
  want = producers.rmsnorm_rope(x, weight, cos, sin, num_heads=4, out_scale=Q_SCALE)
  got = producers.rmsnorm_rope(x.reshape(2, 90, 4, 32), weight, cos, sin, num_heads=4, out_scale=Q_SCALE)
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
  with pytest.raises(ValueError, match="N = num_heads=8"):
    producers.rmsnorm_rope(x.reshape(2, 90, 4, 32), weight, cos, sin, num_heads=8)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tpu_pair_partner_by_matmul_equals_the_flip(dtype, monkeypatch):
  # XLA:TPU finds each channel's RoPE partner by a matmul with the pair swap, the other platforms
  # by flipping a [..., H/2, 2] view: the same values (values of `dtype` held in fp32, zeros and
  # the extremes included; not subnormals, which a dot flushes to zero here as every op does on
  # TPU), and so the same rmsnorm_rope: bit for bit in bf16 (but for the sign of a zero).
  module = importlib.import_module("producers.query_key")

  info = jnp.finfo(dtype)
  rng = np.random.default_rng(5)
  y = (rng.standard_normal((3, 7, 4, 128)) * np.exp2(rng.integers(-20, 20, (3, 7, 4, 128))))
  y.reshape(-1)[:6] = [0.0, -0.0, float(info.max), float(info.min), float(info.smallest_normal), 1.0]
  y = jnp.asarray(y, dtype).astype(jnp.float32)
  flipped = np.asarray(module._partner_by_flip(y))
  assert (flipped == np.asarray(y).reshape(3, 7, 4, 64, 2)[..., ::-1].reshape(y.shape)).all()
  by_matmul = np.asarray(jax.jit(module._partner_by_matmul, static_argnums=1)(y, dtype))
  np.testing.assert_array_equal(by_matmul, flipped)

  x, weight = _random_qk(jax.random.key(6), 2, NUM_TOKENS, 2, 128, dtype)
  cos, sin = wan_rope_table(GRID, 128)
  want = rmsnorm_rope(x, weight, cos, sin, num_heads=2, out_scale=Q_SCALE)
  monkeypatch.setattr(module, "_pair_partner", module._partner_by_matmul)
  got = module.rmsnorm_rope.__wrapped__(x, weight, cos, sin, num_heads=2, out_scale=Q_SCALE)
  exact = _rmsnorm_rope_exact(x, weight, cos, sin, num_heads=2, out_scale=Q_SCALE)
  _assert_matches_exact(got, exact, dtype, width=256, name="partner by matmul")
  if dtype == jnp.bfloat16:  # fp32: XLA:CPU contracts the rotation into FMAs differently (1 ulp)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
