"""Tests for producers/ (issue 4): fused == reference, diffusers parity, shard invariance, memory."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import producers
from producers.layernorm_adaln import layer_norm_reference
from producers.rmsnorm_rope import rms_norm_reference
from producers import (layernorm_adaln, layernorm_adaln_reference, rmsnorm_rope,
                       rmsnorm_rope_reference, wan_rope_table, wan_rope_table_reference)

GRID = (3, 5, 7)  # odd (F, Hl/2, Wl/2): T = 105
NUM_TOKENS = math.prod(GRID)
Q_SCALE = 0.125 * math.log2(math.e)  # H ** -0.5 * log2(e) for H = 64


def _assert_within_ulps(actual, expected, dtype, ulps=1, magnitude=None):
  """Asserts |actual - expected| <= ulps * ulp(dtype) at `magnitude` (default max(|a|, |b|)).

  XLA contracts a * b - c * d into an FMA inside a fusion while the eager reference rounds each
  product, so where a sum cancels, the difference is an ulp of the larger TERM, not of the result:
  callers pass that term's magnitude (the rotated pair's norm, or |LayerNorm * (1 + scale)|).
  """
  a = np.asarray(actual, np.float32)
  b = np.asarray(expected, np.float32)
  mag = np.maximum(np.abs(a), np.abs(b))
  if magnitude is not None:
    mag = np.maximum(mag, np.asarray(magnitude, np.float32))
  spacing = np.spacing(mag)
  if np.dtype(dtype) == np.dtype(jnp.bfloat16):
    spacing = spacing * 2.0**16  # bf16 keeps 7 of fp32's 23 mantissa bits
  ok = np.abs(a - b) <= ulps * spacing
  assert ok.all(), (f"{(~ok).sum()} of {ok.size} elements differ by more than {ulps} ulp "
                    f"({np.dtype(dtype).name}); max abs diff {np.abs(a - b).max()}")


def _fma_ulps(dtype, fp32_ulps):
  """ulps allowed between a fused XLA result and the eager, op-by-op reference.

  Inside a fusion XLA:CPU contracts a * b + c into one FMA (one rounding instead of two), both in
  the rotation and in the LayerNorm's variance sum; the eager reference rounds every op, as torch
  does. Bound: 0.5 ulp of the product + 1 ulp of the result for the rotation (fp32_ulps=2), plus
  1 ulp through rsqrt of the variance for LayerNorm (fp32_ulps=3). Measured on these shapes: rope
  <= 2 (0.3-0.7% of elements above 1), LayerNorm <= 3 (0.01% above 2). In bf16 the fp32
  difference only moves the final rounding: 1 bf16 ulp.
  """
  return 1 if np.dtype(dtype) == np.dtype(jnp.bfloat16) else fp32_ulps


def _pair_norm(out_BTNH):
  """Norm of each rotated channel pair (2i, 2i+1), repeated to [B, T, N, H]."""
  pairs = np.asarray(out_BTNH, np.float32).reshape(*out_BTNH.shape[:-1], -1, 2)
  return np.repeat(np.sqrt((pairs.astype(np.float64)**2).sum(-1)), 2, axis=-1)


def _random_qk(key, batch, tokens, num_heads, head_dim, dtype):
  kx, kw = jax.random.split(key)
  width = num_heads * head_dim
  x = (3.0 * jax.random.normal(kx, (batch, tokens, width))).astype(dtype)
  weight = (1.0 + 0.3 * jax.random.normal(kw, (width,))).astype(dtype)
  return x, weight


# ----------------------------------------------------------------------------- rotary table


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("start,length", [(0, None), (81, 27), (100, 10)])
def test_rope_table_matches_numpy_reference(head_dim, start, length):
  cos, sin = wan_rope_table(GRID, head_dim, start=start, length=length)
  cos_ref, sin_ref = wan_rope_table_reference(GRID, head_dim, start=start, length=length)
  want_rows = NUM_TOKENS - start if length is None else length
  assert cos.shape == sin.shape == (want_rows, head_dim // 2)
  assert cos.dtype == sin.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(cos), cos_ref)
  np.testing.assert_array_equal(np.asarray(sin), sin_ref)
  pad_rows = np.arange(start, start + want_rows) >= NUM_TOKENS
  assert (np.asarray(cos)[pad_rows] == 1).all() and (np.asarray(sin)[pad_rows] == 0).all()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_table_matches_diffusers(head_dim):
  torch = pytest.importorskip("torch")
  from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

  rope = WanRotaryPosEmbed(head_dim, (1, 2, 2), max_seq_len=1024)
  latents = torch.zeros(1, 4, GRID[0], 2 * GRID[1], 2 * GRID[2])
  cos_t, sin_t = rope(latents)  # [1, T, 1, H], repeat-interleaved
  cos, sin = wan_rope_table(GRID, head_dim)
  assert producers.rope_axis_dims(head_dim) == (rope.t_dim, rope.h_dim, rope.w_dim)
  np.testing.assert_allclose(np.asarray(cos), cos_t[0, :, 0, 0::2].numpy(), rtol=0, atol=1e-6)
  np.testing.assert_allclose(np.asarray(sin), sin_t[0, :, 0, 1::2].numpy(), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- rmsnorm_rope


@pytest.mark.parametrize("dtype,num_heads,head_dim,out_scale", [
    (jnp.float32, 4, 64, None), (jnp.float32, 2, 128, Q_SCALE),
    (jnp.bfloat16, 4, 64, Q_SCALE), (jnp.bfloat16, 2, 128, None)])
def test_rmsnorm_rope_fused_matches_reference_for_t_ne_s(dtype, num_heads, head_dim, out_scale):
  # q: T = 35 tokens (the middle third of the grid), k: S = 105 tokens (all of it).
  x_q, weight_q = _random_qk(jax.random.key(0), 2, 35, num_heads, head_dim, dtype)
  x_k, weight_k = _random_qk(jax.random.key(1), 2, NUM_TOKENS, num_heads, head_dim, dtype)
  cos_q, sin_q = wan_rope_table(GRID, head_dim, start=35, length=35)
  cos_k, sin_k = wan_rope_table(GRID, head_dim)
  kwargs = dict(num_heads=num_heads, out_scale=out_scale)
  for x, weight, cos, sin in ((x_q, weight_q, cos_q, sin_q), (x_k, weight_k, cos_k, sin_k)):
    fused = rmsnorm_rope(x, weight, cos, sin, **kwargs)
    ref = rmsnorm_rope_reference(x, weight, cos, sin, **kwargs)
    assert fused.shape == (2, x.shape[1], num_heads, head_dim) and fused.dtype == dtype
    _assert_within_ulps(fused, ref, dtype, _fma_ulps(dtype, 2), magnitude=_pair_norm(ref))
    if dtype == jnp.bfloat16:  # the same roundings as the reference: nearly all bits equal
      assert (np.asarray(fused, np.float32) == np.asarray(ref, np.float32)).mean() > 0.99
  # q's rows are the matching rows of a full-length call on the same inputs (global positions).
  x_full = jnp.zeros((2, NUM_TOKENS, num_heads * head_dim), dtype).at[:, 35:70].set(x_q)
  full = rmsnorm_rope(x_full, weight_q, cos_k, sin_k, **kwargs)
  np.testing.assert_array_equal(np.asarray(full[:, 35:70], np.float32),
                                np.asarray(rmsnorm_rope(x_q, weight_q, cos_q, sin_q, **kwargs),
                                           np.float32))


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
  for proj, norm, want in ((attn.to_q, attn.norm_q, q_torch), (attn.to_k, attn.norm_k, k_torch)):
    with torch.no_grad():
      x = jnp.asarray(proj(hidden).numpy())
    out = rmsnorm_rope(x, jnp.asarray(norm.weight.detach().numpy()), cos, sin,
                       num_heads=num_heads, eps=norm.eps)
    np.testing.assert_allclose(np.asarray(out), want.numpy(), rtol=0, atol=1e-6)


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
  _assert_within_ulps(out, want, jnp.bfloat16, magnitude=_pair_norm(want))
  # Same roundings as diffusers (norm output rounded to bf16 before the rotation): nearly all equal.
  assert (np.asarray(out, np.float32) == want).mean() > 0.99


def _pad_tokens(x, total):
  return jnp.pad(x, ((0, 0), (0, total - x.shape[1]), (0, 0)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16])
def test_rmsnorm_rope_four_shards_concatenate_to_unsharded(dtype):
  num_heads, head_dim, shards = 2, 64, 4
  shard_len = -(-NUM_TOKENS // shards)  # 27; the last shard holds 24 tokens + 3 padding
  x, weight = _random_qk(jax.random.key(2), 2, NUM_TOKENS, num_heads, head_dim, dtype)
  cos, sin = wan_rope_table(GRID, head_dim)
  full = np.asarray(rmsnorm_rope(x, weight, cos, sin, num_heads=num_heads, out_scale=Q_SCALE),
                    np.float32)
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

  for got in (looped, sharded):
    assert got.shape == (2, shards * shard_len, num_heads, head_dim)
    np.testing.assert_array_equal(got[:, :NUM_TOKENS], full)
    assert (got[:, NUM_TOKENS:] == 0).all()  # zero padding stays zero through norm and rotation


# ----------------------------------------------------------------------------- layernorm_adaln


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("per_token", [False, True])
def test_layernorm_adaln_fused_matches_reference(dtype, per_token):
  batch, tokens, width = 2, NUM_TOKENS, 192
  kx, ks, kb = jax.random.split(jax.random.key(3), 3)
  mod_shape = (batch, tokens if per_token else 1, width)
  x = (2.0 + 3.0 * jax.random.normal(kx, (batch, tokens, width))).astype(dtype)
  scale = 0.2 * jax.random.normal(ks, mod_shape)
  shift = 0.2 * jax.random.normal(kb, mod_shape)
  fused = layernorm_adaln(x, scale, shift)
  ref = layernorm_adaln_reference(x, scale, shift)
  assert fused.shape == x.shape and fused.dtype == dtype
  product = np.asarray(layer_norm_reference(x)) * (1 + np.asarray(scale))
  _assert_within_ulps(fused, ref, dtype, _fma_ulps(dtype, 3), magnitude=np.abs(product))


def test_layernorm_adaln_matches_diffusers_block_formula():
  torch = pytest.importorskip("torch")
  from diffusers.models.normalization import FP32LayerNorm

  batch, tokens, width = 2, NUM_TOKENS, 192
  gen = torch.Generator().manual_seed(0)
  x = (2.0 + 3.0 * torch.randn(batch, tokens, width, generator=gen)).to(torch.bfloat16)
  scale = 0.2 * torch.randn(batch, 1, width, generator=gen)
  shift = 0.2 * torch.randn(batch, 1, width, generator=gen)
  norm1 = FP32LayerNorm(width, 1e-6, elementwise_affine=False)
  # WanTransformerBlock.forward, self-attention input.
  want = (norm1(x.float()) * (1 + scale) + shift).type_as(x).float().numpy()
  out = layernorm_adaln(jnp.asarray(x.float().numpy()).astype(jnp.bfloat16),
                        jnp.asarray(scale.numpy()), jnp.asarray(shift.numpy()))
  _assert_within_ulps(out, want, jnp.bfloat16)


# ----------------------------------------------------------------------------- memory


def test_fused_temp_bytes_not_larger_than_unfused_at_wan_480p():
  # Wan 2.1 1.3B at 480x832x81: T = 21 * 30 * 52 = 32,760 tokens, D = 1536, N = 12.
  tokens, width, num_heads = 32_760, 1536, 12
  x = jax.ShapeDtypeStruct((1, tokens, width), jnp.bfloat16)
  weight = jax.ShapeDtypeStruct((width,), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((tokens, width // num_heads // 2), jnp.float32)
  modulation = jax.ShapeDtypeStruct((1, 1, width), jnp.float32)

  def temp_bytes(jitted, *args, **static):
    return jitted.lower(*args, **static).compile().memory_analysis().temp_size_in_bytes

  kwargs = dict(num_heads=num_heads, out_scale=Q_SCALE)
  rr_fused = temp_bytes(rmsnorm_rope, x, weight, table, table, **kwargs)
  rr_unfused = temp_bytes(jax.jit(functools.partial(rmsnorm_rope_reference, **kwargs)),
                          x, weight, table, table)
  ln_fused = temp_bytes(layernorm_adaln, x, modulation, modulation)
  ln_unfused = temp_bytes(jax.jit(layernorm_adaln_reference), x, modulation, modulation)
  print(f"\nrmsnorm_rope temp bytes: fused {rr_fused:,} vs unfused {rr_unfused:,}")
  print(f"layernorm_adaln temp bytes: fused {ln_fused:,} vs unfused {ln_unfused:,}")
  assert rr_fused <= rr_unfused, (rr_fused, rr_unfused)
  assert ln_fused <= ln_unfused, (ln_fused, ln_unfused)
  # XLA:CPU keeps at most one fp32 [B, T, D] temporary for rmsnorm_rope (see its docstring); more
  # than that is a fusion regression, not a number to update.
  assert rr_fused <= 4 * tokens * width + (1 << 20), rr_fused
  assert ln_fused <= 1 << 20, ln_fused


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_value_error_naming_values():
  cos, sin = wan_rope_table(GRID, 64)
  weight = jnp.ones((128,))
  with pytest.raises(ValueError, match=r"width=100.*num_heads=3"):  # D != N * H
    rmsnorm_rope(jnp.zeros((1, NUM_TOKENS, 100)), jnp.ones((100,)), cos, sin, num_heads=3)
  with pytest.raises(ValueError, match=r"head_dim=5"):  # H odd
    rmsnorm_rope(jnp.zeros((1, NUM_TOKENS, 10)), jnp.ones((10,)), cos, sin, num_heads=2)
  with pytest.raises(ValueError, match=r"cos.shape=\(105, 32\).*T=100"):  # grid size != T
    rmsnorm_rope(jnp.zeros((1, 100, 128)), weight, cos, sin, num_heads=2)
  with pytest.raises(ValueError, match=r"weight.shape=\(64,\)"):
    rmsnorm_rope(jnp.zeros((1, NUM_TOKENS, 128)), jnp.ones((64,)), cos, sin, num_heads=2)
  with pytest.raises(ValueError, match=r"head_dim=63"):
    wan_rope_table(GRID, 63)
  with pytest.raises(ValueError, match=r"grid=\(3, 0, 7\)"):
    wan_rope_table((3, 0, 7), 64)
  with pytest.raises(ValueError, match=r"start=-1"):
    wan_rope_table(GRID, 64, start=-1)
  with pytest.raises(ValueError, match=r"scale.shape=\(1, 7, 128\)"):
    layernorm_adaln(jnp.zeros((1, 105, 128)), jnp.zeros((1, 7, 128)), jnp.zeros((1, 1, 128)))


def test_traced_start_needs_static_length():
  with pytest.raises(ValueError, match="length=None needs a Python int start"):
    jax.jit(lambda s: wan_rope_table(GRID, 64, start=s))(jnp.int32(3))
  cos, _ = jax.jit(lambda s: wan_rope_table(GRID, 64, start=s, length=8))(jnp.int32(100))
  np.testing.assert_array_equal(np.asarray(cos), wan_rope_table_reference(GRID, 64, start=100,
                                                                           length=8)[0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rmsnorm_without_rotation_is_plain_rmsnorm(dtype):
  # Wan's cross-attention q/k: RMSNorm across heads, no RoPE (cos = sin = None).
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((2, 9, 64)), dtype)
  weight = jnp.asarray(rng.standard_normal(64), dtype)
  out = producers.rmsnorm_rope(x, weight, None, None, num_heads=4)
  ref = rms_norm_reference(x, weight).reshape(2, 9, 4, 16)
  assert out.shape == (2, 9, 4, 16) and out.dtype == dtype
  tol = 0 if dtype == jnp.bfloat16 else 2e-6
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)
  with pytest.raises(ValueError, match="both rotary tables"):
    producers.rmsnorm_rope(x, weight, jnp.ones((9, 8)), None, num_heads=4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_affine_layer_norm_matches_torch(dtype):
  # diffusers FP32LayerNorm(D, elementwise_affine=True): Wan's cross-attention norm2.
  import torch
  rng = np.random.default_rng(5)
  x = rng.standard_normal((2, 7, 48)).astype(np.float32)
  w, b = rng.standard_normal(48).astype(np.float32), rng.standard_normal(48).astype(np.float32)
  xj = jnp.asarray(x, dtype)
  out = producers.layer_norm(xj, jnp.asarray(w), jnp.asarray(b))
  ref = torch.nn.functional.layer_norm(torch.from_numpy(np.asarray(xj, np.float32)), (48,),
                                       torch.from_numpy(w), torch.from_numpy(b), 1e-6)
  ref = np.asarray(jnp.asarray(ref.numpy()).astype(dtype), np.float32)
  assert out.dtype == dtype
  tol = 4e-6 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=tol, rtol=0)
  with pytest.raises(ValueError, match="weight and bias"):
    producers.layer_norm(xj, jnp.asarray(w[:4]), jnp.asarray(b))
