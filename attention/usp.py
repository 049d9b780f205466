"""2D Unified Sequence Parallel attention over the (ring, ulysses) mesh, and cross-attention.

One call, inside `jax.shard_map` (DESIGN.md section 3; USP: Fang & Zhao 2024, arXiv:2405.07719;
Ulysses: Jacobs et al. 2023; ring attention: Liu et al. 2023):

1. local shards q [B, T/(UR), N, H], k/v [B, S/(UR), K, H]; q pre-scaled by scale * log2(e);
2. pre-all-to-all reductions: the k sum for the global valid-key mean in ONE `psum`, then per-head
   max ||q~||, max ||k - k_mean||, max |v| in ONE packed `pmax`, both over (ring, ulysses); the
   fixed-m gate computed from them is therefore the same on every device;
3. ONE packed all-to-all over `ulysses` for q, k and v (split heads, gather the ring group's tokens);
4. R ring steps over `ring`: the packed K/V buffer is `ppermute`d to the next rank before the block
   compute it overlaps, R - 1 permutes in all; a mesh-uniform `lax.cond` picks the fixed-m or the
   LSE block update inside each step, over one (o, l, m) carry;
5. ONE all-to-all back to [B, T/(UR), N, H].
Per call: 2 all-to-alls, R - 1 collective-permutes, 1 psum + 1 pmax of O(B N H), no all-gather.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from attention import blockwise as bw
from attention import fixed_m as fm
from attention.masks import validate_qkv
from attention.padding import pad_axis, round_up
from attention.mesh import (CFG_AXIS, RING_AXIS, SEQUENCE_AXES, ULYSSES_AXIS, MeshSpec, batch_axis, heads_fit,
                            sequence_spec)


def workable_degrees(num_devices: int, num_heads: int, num_kv_heads: int) -> list[tuple[int, int]]:
  """The (U, R) pairs with U * R == num_devices that `usp_attention` accepts for these heads."""
  return [(u, num_devices // u) for u in range(1, num_devices + 1)
          if num_devices % u == 0 and heads_fit(u, num_heads, num_kv_heads)]


def _mesh_parts(mesh: Mesh, batch: int) -> tuple[int, int, int]:
  """(U, R, C) of the mesh, checking that C splits the batch.

  Raises:
    ValueError: a mesh without the mesh axes, or a batch that the cfg axis does not split.
  """
  spec = MeshSpec.of(mesh)
  if batch % spec.cfg:
    raise ValueError(f"mesh {spec} splits the batch over CFG={spec.cfg} but the batch has {batch} rows; "
                     "the cfg axis needs an even batch (cond and uncond rows)")
  return spec.ulysses, spec.ring, spec.cfg


def check_heads(num_heads: int, num_kv_heads: int, ulysses: int, ring: int) -> None:
  """Raises ValueError, naming the workable (U, R), when the heads do not split over U."""
  ok = workable_degrees(ulysses * ring, num_heads, num_kv_heads)
  if num_heads % ulysses:
    raise ValueError(
        f"query heads N={num_heads} are not divisible by the Ulysses degree U={ulysses}; with "
        f"{ulysses * ring} devices use one of (U, R) = {ok}")
  if num_kv_heads % ulysses and ulysses % num_kv_heads:
    raise ValueError(
        f"kv heads K={num_kv_heads} and U={ulysses}: need K % U == 0 or U % K == 0 (kv heads are "
        f"repeated U/K times in grouped order); with {ulysses * ring} devices use one of (U, R) = {ok}")


def _split_heads_for_a2a(x, U):
  """[B, L, Hd, H] -> [U, B*L*(Hd/U)*H]: row j goes to Ulysses rank j (its head group)."""
  B, L, Hd, H = x.shape
  return x.reshape(B, L, U, Hd // U, H).transpose(2, 0, 1, 3, 4).reshape(U, -1)


def _gather_sequence_from_a2a(buf, B, L, hd, H):
  """[U, B*L*hd*H] received rows (row j = source rank j's tokens) -> [B, U*L, hd, H]."""
  U = buf.shape[0]
  return buf.reshape(U, B, L, hd, H).transpose(1, 0, 2, 3, 4).reshape(B, U * L, hd, H)


def usp_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    kv_valid_len: jax.Array | None = None,
    implementation: str = "auto",
    scale: float | None = None,
    block_sizes: bw.BlockSizes | None = None,
    q_prescaled: bool = False,
) -> jax.Array:
  """Exact attention with tokens sharded over the (ring, ulysses) mesh (2D USP).

  Args:
    q: [B, T, N, H] global array (sharded `P(None, ("ring", "ulysses"))` or not: it is resharded).
    k, v: [B, S, K, H]; GQA needs K % U == 0, or K < U with U % K == 0 (each kv head is then
      repeated U/K times in grouped order, kv0 kv0 kv1 kv1, before the exchange).
    mesh: a Mesh with axes "ring" and "ulysses" (`attention.make_mesh`).
    kv_valid_len: None or int [B]: keys at positions >= it are padding.
    implementation: "auto" | "fixed_m" | "lse", as in `local_attention`; for "auto" the choice is
      made once from globally reduced statistics, so every device takes the same path.
    scale: logit scale, default 1 / sqrt(H).
    block_sizes: blockwise tunables for the per-device compute.
    q_prescaled: q already multiplied by scale * log2(e).

  Returns:
    [B, T, N, H] in q's dtype, sharded `P(None, ("ring", "ulysses"))` when T is a multiple of
    U * R. T and S need not be: they are padded (padded keys masked) and the padded rows dropped,
    which leaves an uneven length that XLA lays out as it chooses (callers that keep tokens
    sharded, like the Wan transformer, pad once themselves and pass `kv_valid_len`).

  Raises:
    ValueError: bad shapes/dtypes, unknown implementation, heads that do not split over U (the
      message names the workable (U, R)), before any compute.
  """
  B, T, N, H = validate_qkv(q, k, v, kv_valid_len=kv_valid_len)
  K = k.shape[2]
  U, R, _ = _mesh_parts(mesh, B)
  check_heads(N, K, U, R)
  if implementation not in bw.IMPLEMENTATIONS:
    raise ValueError(f"unknown {implementation=}; expected one of {bw.IMPLEMENTATIONS}")
  block_sizes = bw.BlockSizes.get_default() if block_sizes is None else block_sizes
  scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
  return _usp(q, k, v, kv_valid_len, mesh=mesh, implementation=implementation, scale=scale,
              block_sizes=block_sizes, q_prescaled=bool(q_prescaled))


@functools.partial(jax.jit, static_argnames=("mesh", "implementation", "scale", "block_sizes", "q_prescaled"))
def _usp(q, k, v, kv_valid_len, *, mesh, implementation, scale, block_sizes, q_prescaled):
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  U, R, C = _mesh_parts(mesh, B)
  D = U * R
  if K < U:  # grouped order: rank u gets kv head u // (U // K), next to its query heads
    k, v = jnp.repeat(k, U // K, axis=2), jnp.repeat(v, U // K, axis=2)
  T_pad, S_pad = round_up(T, D), round_up(S, D)
  q, k, v = pad_axis(q, 1, T_pad), pad_axis(k, 1, S_pad), pad_axis(v, 1, S_pad)
  if kv_valid_len is None:
    limit = jnp.full((B,), S, jnp.int32)
  else:
    limit = jnp.minimum(kv_valid_len.astype(jnp.int32), S)
  body = functools.partial(
      _usp_body, U=U, R=R, C=C, num_heads=N, implementation=implementation, scale=scale,
      block_sizes=block_sizes, q_prescaled=q_prescaled, masked=(kv_valid_len is not None or S_pad != S))
  seq, rows = sequence_spec(mesh), P(batch_axis(mesh))
  out = jax.shard_map(body, mesh=mesh, in_specs=(seq, seq, seq, rows), out_specs=seq,
                      check_vma=False)(q, k, v, limit)
  return out[:, :T]


def _usp_body(q, k, v, limit, *, U, R, C, num_heads, implementation, scale, block_sizes, q_prescaled,
              masked):
  """Per-device program. q [B, Tl, N, H], k/v [B, Sl, Kp, H] local (B: this guidance branch's rows
  when C = 2); limit [B] global valid keys."""
  B, Tl, N, H = q.shape
  Sl, Kp = k.shape[1], k.shape[2]
  axes = SEQUENCE_AXES
  r = jax.lax.axis_index(RING_AXIS) if R > 1 else 0
  u = jax.lax.axis_index(ULYSSES_AXIS) if U > 1 else 0
  chunk = r * U + u
  qs, logit_scale = bw.query_scaling(q, scale, q_prescaled)

  # 2. Pre-all-to-all reductions (tiny; XLA overlaps them with the exchange).
  if implementation != "lse":
    kv_pos_local = chunk * Sl + jnp.arange(Sl)
    valid = kv_pos_local[None, :] < limit[:, None]
    count = limit.astype(jnp.float32)
    k_sum = fm.key_sum(k, valid)
    if U * R > 1:
      k_sum = jax.lax.psum(k_sum, axes)
    k_mean = k_sum / jnp.maximum(count, 1.0)[:, None, None]
    kc_max, v_max = fm.key_maxima(k, v, k_mean, valid)
    q_norm = jnp.max(fm.query_norms(qs), axis=1) * logit_scale  # [B, N] of q * scale * log2 e
    packed = jnp.concatenate([q_norm, kc_max, v_max], axis=1)
    if U * R > 1:
      # pmax has no JVP rule; these statistics only pick the shift m and the gate, and the
      # output o / l does not depend on m, so the exact gradient through them is zero.
      packed = jax.lax.pmax(jax.lax.stop_gradient(packed), axes)
    q_norm, kc_max, v_max = packed[:, :N], packed[:, N:N + Kp], packed[:, N + Kp:]
    gate = fm.fixed_m_gate(q_norm, kc_max, v_max, count)
    if C > 1:  # each branch's statistics are its own; the path is chosen for the whole mesh
      gate = fm.GateResult(jax.lax.pmin(gate.eligible.astype(jnp.int32), CFG_AXIS) > 0, gate.v_ok, gate.c_max)

  # 3. One packed all-to-all over ulysses: heads split, the ring group's tokens gathered.
  hq, hk = N // U, Kp // U
  if U > 1:
    parts = [_split_heads_for_a2a(x, U) for x in (qs, k, v)]
    sizes = [p.shape[1] for p in parts]
    buf = jax.lax.all_to_all(jnp.concatenate(parts, axis=1), ULYSSES_AXIS, 0, 0, tiled=True)
    qb, kb, vb = jnp.split(buf, [sizes[0], sizes[0] + sizes[1]], axis=1)
    qg = _gather_sequence_from_a2a(qb, B, Tl, hq, H)
    kg = _gather_sequence_from_a2a(kb, B, Sl, hk, H)
    vg = _gather_sequence_from_a2a(vb, B, Sl, hk, H)
  else:
    qg, kg, vg = qs, k, v
  Tg, Sg = U * Tl, U * Sl
  G = hq // hk

  # The block set-up: block padding of Tg / Sg is masked inside `attend` by construction; the
  # mesh padding (global positions >= S) and kv_valid_len by `kv_limit`.
  layout = bw.BlockLayout.make(Tg, Sg, block_sizes)
  q_BKGTH = layout.pad_q(qg.reshape(B, Tg, hk, G, H).transpose(0, 2, 3, 1, 4))
  kbuf = jnp.stack([layout.pad_kv(kg.transpose(0, 2, 1, 3)),
                    layout.pad_kv(vg.transpose(0, 2, 1, 3))])  # packed K/V [2, B, hk, Sg_pad, H]
  q_pos = layout.q_positions(r * Tg + jnp.arange(Tg))
  kv_limit = limit if masked else None

  if implementation != "lse":
    stats = fm.KeyStats(
        jax.lax.dynamic_slice_in_dim(k_mean, u * hk, hk, axis=1),
        jax.lax.dynamic_slice_in_dim(kc_max, u * hk, hk, axis=1),
        jax.lax.dynamic_slice_in_dim(v_max, u * hk, hk, axis=1), count)
    c_max = jax.lax.dynamic_slice_in_dim(gate.c_max, u * hk, hk, axis=1)
    b = fm.row_offsets(q_BKGTH, stats, c_max, logit_scale=logit_scale)
  match implementation:
    case "lse":
      carry = bw.init_carry(q_BKGTH)
    case "fixed_m":
      carry = bw.init_carry(q_BKGTH, b)
    case "auto":
      carry = bw.init_carry(q_BKGTH, jnp.where(gate.eligible, b, -jnp.inf))

  def block(carry, kv, src):
    kw = dict(layout=layout, q_pos=q_pos, kv_pos=layout.kv_positions(src * Sg + jnp.arange(Sg)),
              kv_limit=kv_limit, logit_scale=logit_scale)
    if implementation == "auto":
      return jax.lax.cond(
          gate.eligible,
          lambda c: bw.attend(c, q_BKGTH, kv[0], kv[1], mode="fixed_m", **kw),
          lambda c: bw.attend(c, q_BKGTH, kv[0], kv[1], mode="lse", **kw), carry)
    return bw.attend(carry, q_BKGTH, kv[0], kv[1], mode=implementation, **kw)

  # 4. Ring: send the buffer on before computing with it; the last step sends nothing.
  perm = [(j, (j + 1) % R) for j in range(R)]
  for step in range(R):
    nxt = jax.lax.ppermute(kbuf, RING_AXIS, perm) if step < R - 1 else None
    carry = block(carry, kbuf, (r - step) % R)
    kbuf = nxt

  out = layout.unpad_rows(bw.finish(carry))  # [B, hk, G, Tg, H]
  if implementation == "fixed_m":
    out = jnp.where(gate.eligible, out, jnp.nan)
  out = out.transpose(0, 3, 1, 2, 4).reshape(B, Tg, hq, H).astype(q.dtype)

  # 5. All-to-all back: my token chunk, all heads.
  if U > 1:
    out = out.reshape(B, U, Tl, hq, H).transpose(1, 0, 2, 3, 4)
    out = jax.lax.all_to_all(out, ULYSSES_AXIS, 0, 0, tiled=True)  # [U(head group), B, Tl, hq, H]
    out = out.transpose(1, 2, 0, 3, 4).reshape(B, Tl, N, H)
  return out


def cross_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    kv_valid_len: jax.Array | None = None,
    implementation: str = "auto",
    scale: float | None = None,
    block_sizes: bw.BlockSizes | None = None,
) -> jax.Array:
  """Attention of sequence-sharded queries to replicated keys (text cross-attention): no exchange.

  Args:
    q: [B, T, N, H], sharded (or to be sharded) `P(None, ("ring", "ulysses"))`.
    k, v: [B, L, K, H] text keys/values, replicated on every device.
    mesh, kv_valid_len, implementation, scale, block_sizes: as in `usp_attention`.

  Returns:
    [B, T, N, H] in q's dtype, sharded like q. T is padded to a multiple of U * R if needed.
  """
  B, T, N, H = validate_qkv(q, k, v, kv_valid_len=kv_valid_len)
  U, R, _ = _mesh_parts(mesh, B)
  T_pad = round_up(T, U * R)
  local = functools.partial(bw.local_attention, implementation=implementation, scale=scale,
                            block_sizes=block_sizes)
  seq, rows = sequence_spec(mesh), P(batch_axis(mesh))  # text rows follow their batch rows
  if kv_valid_len is None:
    fn = lambda q, k, v: local(q, k, v)
    args = (pad_axis(q, 1, T_pad), k, v)
    specs = (seq, rows, rows)
  else:
    fn = lambda q, k, v, vl: local(q, k, v, kv_valid_len=vl)
    args = (pad_axis(q, 1, T_pad), k, v, kv_valid_len)
    specs = (seq, rows, rows, rows)
  out = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=seq, check_vma=False)(*args)
  return out[:, :T]
