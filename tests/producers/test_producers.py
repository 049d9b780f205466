"""Tests for producers/ (issue 4): fused == reference, diffusers parity, shard invariance, memory."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import producers
from tests.numerics import EPS_BF16, EPS_F32, assert_close_scaled, assert_mostly_equal
from producers import (layernorm_adaln, layernorm_adaln_reference, rmsnorm_rope,
                       rmsnorm_rope_reference, wan_rope_table, wan_rope_table_reference)

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2

GRID = (3, 5, 7)  # odd (F, Hl/2, Wl/2): T = 105
NUM_TOKENS = math.prod(GRID)
Q_SCALE = 0.125 * math.log2(math.e)  # H ** -0.5 * log2(e) for H = 64


def _round_to(values, dtype):
  """float64 values rounded once to dtype, returned as float64."""
  return np.asarray(np.asarray(values, np.float64).astype(dtype), np.float64)


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


def _f32_rel(width):
  """fp32 error bound of a normalised output (RMSNorm or LayerNorm over D = width, then gain,
  modulation or rotation), in units of its scale.

  sqrt(D) eps: the D-term statistics sum, in whatever order and vector width XLA picks for the CPU
  (rounding errors of a sum grow like sqrt(D) in any order; the rsqrt halves them); 4 eps: the
  rsqrt (XLA's approximation differs by CPU), the gain, the rotation's two products and sum (an
  FMA or not) and out_scale, about one rounding each. Against torch, whose own rounding is within
  the same bound, the difference is at most twice this; the 4x margin over the worst error
  measured under three ISA settings (tests/numerics.py) leaves room for that.
  """
  return (4 + math.sqrt(width)) * EPS_F32


def _assert_bf16_rounding_points(out, want, scale, *, roundings, width, name):
  """bf16 results with the reference's rounding points.

  The fp32 intermediates differ from the reference's by <= _f32_rel(D) of the scale, so a rounding
  point rounds the other way only where the exact value lies that close to a bf16 rounding
  boundary: a fraction <= 2 _f32_rel(D) / EPS_BF16 of the values at each rounding point (both sides
  of a boundary), each flip reaching <= 2 outputs (a flipped norm output moves both outputs of its
  rotated pair). A flip moves an output by <= 1.5 bf16 ulps (EPS_BF16 of the scale; sqrt(2) through
  the rotation). Bounds: 4x both (a flip is all or nothing, so the measured worst equals the
  analysis whenever one happens). A missing or extra bf16 rounding moves 10-25 % of the outputs.
  """
  assert_close_scaled(out, want, rel=4 * roundings * 1.5 * EPS_BF16, scale=scale, name=name)
  flip_fraction = 2 * 2 * _f32_rel(width) / EPS_BF16  # two sides of a boundary, <= 2 outputs
  assert_mostly_equal(out, want, max_fraction_differing=4 * roundings * flip_fraction, name=name)


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


# ----------------------------------------------------------------------------- rotary table


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("start,length", [(0, None), (81, 27), (100, 10)])
def test_rope_table_matches_numpy_reference(head_dim, start, length):
  # Bit-exact by construction: both gather the same host-computed float32 table (float64 angles,
  # one rounding); a gather or a select does no arithmetic.
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
  # Both take cos / sin of the same float64 angles and round once to fp32 (host side, no XLA): only
  # a float64 libm difference landing on a rounding boundary could flip one fp32 rounding, <= 1 eps
  # of the tables' scale 1. 4 eps.
  assert_close_scaled(cos, cos_t[0, :, 0, 0::2].numpy(), rel=4 * EPS_F32, scale=1.0, name="cos")
  assert_close_scaled(sin, sin_t[0, :, 0, 1::2].numpy(), rel=4 * EPS_F32, scale=1.0, name="sin")


# ----------------------------------------------------------------------------- rmsnorm_rope


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


# ----------------------------------------------------------------------------- layernorm_adaln


def _layer_norm_exact(x, eps=1e-6):
  """float64 LayerNorm over the last axis (biased variance, no affine) of x's values."""
  xd = np.asarray(x, np.float64)
  centred = xd - xd.mean(axis=-1, keepdims=True)
  return centred / np.sqrt(np.mean(centred**2, axis=-1, keepdims=True) + eps)


def _larger_term(*terms):
  """Element-wise max |term|: the scale of a sum's rounding error where the sum cancels."""
  return np.max(np.abs(np.stack(np.broadcast_arrays(*terms))), axis=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("per_token", [False, True])
def test_layernorm_adaln_matches_exact_math(dtype, per_token):
  # The property we own: fp32 statistics and modulation, one rounding to x.dtype at the end (as
  # diffusers' block): fp32 results within fp32 rounding of the exact math in units of the output's
  # scale; bf16 results are the exact math rounded once, up to rounding-boundary flips.
  batch, tokens, width = 2, NUM_TOKENS, 192
  kx, ks, kb = jax.random.split(jax.random.key(3), 3)
  mod_shape = (batch, tokens if per_token else 1, width)
  x = (2.0 + 3.0 * jax.random.normal(kx, (batch, tokens, width))).astype(dtype)
  scale = 0.2 * jax.random.normal(ks, mod_shape)
  shift = 0.2 * jax.random.normal(kb, mod_shape)
  fused = layernorm_adaln(x, scale, shift)
  assert fused.shape == x.shape and fused.dtype == dtype
  modulated = _layer_norm_exact(x) * (1 + np.asarray(scale, np.float64))
  exact = modulated + np.asarray(shift, np.float64)
  if dtype == jnp.float32:
    assert_close_scaled(fused, exact, rel=_f32_rel(width), name="layernorm_adaln")
    return
  terms = _larger_term(exact, modulated, shift)
  _assert_bf16_rounding_points(fused, _round_to(exact, dtype), terms, roundings=1, width=width,
                               name="layernorm_adaln")
  # Positive control: an extra bf16 rounding of the LayerNorm output before the modulation.
  extra = _round_to(_round_to(_layer_norm_exact(x), dtype) * (1 + np.asarray(scale, np.float64))
                    + np.asarray(shift, np.float64), dtype)
  assert np.mean(np.asarray(fused, np.float64) != extra) > 0.1


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
  with torch.no_grad():
    modulated = (norm1(x.float()) * (1 + scale)).numpy()
  want = (norm1(x.float()) * (1 + scale) + shift).type_as(x).float().numpy()
  out = layernorm_adaln(jnp.asarray(x.float().numpy()).astype(jnp.bfloat16),
                        jnp.asarray(scale.numpy()), jnp.asarray(shift.numpy()))
  _assert_bf16_rounding_points(out, want, _larger_term(want, modulated, shift.numpy()), roundings=1,
                               width=width, name="layernorm_adaln vs diffusers bf16")


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
  # Bit-exact: a gather of the same host table (see test_rope_table_matches_numpy_reference).
  np.testing.assert_array_equal(np.asarray(cos), wan_rope_table_reference(GRID, 64, start=100,
                                                                           length=8)[0])


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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_affine_layer_norm_matches_torch(dtype):
  # diffusers FP32LayerNorm(D, elementwise_affine=True): Wan's cross-attention norm2.
  import torch
  rng = np.random.default_rng(5)
  x = rng.standard_normal((2, 70, 48)).astype(np.float32)
  w, b = rng.standard_normal(48).astype(np.float32), rng.standard_normal(48).astype(np.float32)
  xj = jnp.asarray(x, dtype)
  out = producers.layer_norm(xj, jnp.asarray(w), jnp.asarray(b))
  x_t = torch.from_numpy(np.asarray(xj, np.float32))
  normed = torch.nn.functional.layer_norm(x_t, (48,), eps=1e-6).numpy()
  ref = torch.nn.functional.layer_norm(x_t, (48,), torch.from_numpy(w), torch.from_numpy(b), 1e-6)
  ref = ref.numpy()
  assert out.dtype == dtype
  if dtype == jnp.float32:
    assert_close_scaled(out, ref, rel=_f32_rel(48), name="layer_norm vs torch")
  else:
    _assert_bf16_rounding_points(out, _round_to(ref, dtype), _larger_term(ref, normed * w, b),
                                 roundings=1, width=48, name="layer_norm vs torch")
  with pytest.raises(ValueError, match="weight and bias"):
    producers.layer_norm(xj, jnp.asarray(w[:4]), jnp.asarray(b))
