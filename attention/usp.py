"""2D Unified Sequence Parallel attention over the (ring, ulysses) mesh, and cross-attention.

One call, inside `jax.shard_map` (DESIGN.md section 3; USP: Fang & Zhao 2024, arXiv:2405.07719;
Ulysses: Jacobs et al. 2023; ring attention: Liu et al. 2023):

1. local shards q [B, T/(UR), N, H], k/v [B, S/(UR), K, H]; q pre-scaled by scale * log2(e);
2. pre-all-to-all reductions: the k sums for the global valid-key mean in ONE `all_gather` (added in
   mesh order, so the same bits whatever runs the collective), then per-head
   max ||q~||, max ||k - k_mean||, max |v| in ONE packed `pmax`, both over (ring, ulysses); the
   fixed-m gate computed from them is therefore the same on every device of a row group (when the
   batch rows are split over cfg and/or windows, one `pmin` over those axes makes it the mesh's);
3. ONE packed all-to-all over `ulysses` for q, k and v (split heads, gather the ring group's tokens);
4. R ring steps over `ring`: the packed K/V buffer is `ppermute`d to the next rank before the block
   compute it overlaps, R - 1 permutes in all; a mesh-uniform branch picks the fixed-m or the
   LSE block update inside each step, over one (o, l, m) carry (a `lax.cond` between the two
   updates: XLA's loops or the two single-mode Pallas kernels);
5. ONE all-to-all back to [B, T/(UR), N, H].
Per call: 2 all-to-alls, R - 1 collective-permutes, 1 all-gather (U R B K H) + 1 pmax of O(B N H).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint
from jax.sharding import Mesh, PartitionSpec as P

from attention.block_layout import PAD_POSITION, BlockLayout
from attention import blockwise as bw
from attention import fixed_m as fm
from attention import fp8_exchange as fp8x
from attention import heads
from attention.carry import Start
from attention.heads import Heads
from attention.masks import validate_qkv
from attention.padding import pad_axis, round_up
from attention.mesh import RING_AXIS, SEQUENCE_AXES, ULYSSES_AXIS, MeshSpec, batch_axis, heads_fit, sequence_spec
from attention.settings import IMPLEMENTATIONS, BlockSizes, resolve_backend


def workable_degrees(num_devices: int, num_heads: int, num_kv_heads: int) -> list[tuple[int, int]]:
  """The (U, R) pairs with U * R == num_devices that `usp_attention` accepts for these heads."""
  return [(u, num_devices // u) for u in range(1, num_devices + 1)
          if num_devices % u == 0 and heads_fit(u, num_heads, num_kv_heads)]


def _mesh_parts(mesh: Mesh, batch: int) -> tuple[int, int, int]:
  """(U, R, G) of the mesh, G = C * W the row groups, checking that G splits the batch.

  Raises:
    ValueError: a mesh without the mesh axes, or a batch that the cfg and windows axes do not split.
  """
  spec = MeshSpec.of(mesh)
  if batch % spec.row_groups:
    raise ValueError(f"mesh {spec} splits the batch over CFG={spec.cfg} x W={spec.windows} = {spec.row_groups} "
                     f"device groups but the batch has {batch} rows; the batch must be a multiple of "
                     f"{spec.row_groups} (cond and uncond rows, times the windows run at once)")
  return spec.ulysses, spec.ring, spec.row_groups


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


# [B, L, h, H] laid out as [B, h, L, H]: whole (L, H) slabs, what the exchange sends and what
# `producers.rmsnorm_rope` writes, so the packing copies slabs (no relayout of its own).
_HEADS_MAJOR_4D, _ROW_MAJOR_5D = Layout((0, 2, 1, 3)), Layout((0, 1, 2, 3, 4))


def _heads_to_sequence(parts: list[jax.Array], U: int, L_pad: int) -> jax.Array:
  """ONE all-to-all over `ulysses` for several [B, L, h_i, H] local arrays, returning them heads-major:
  [B, sum_i h_i / U, U * L_pad, H], rank j holding head group j of every array (the arrays' groups
  in order) and token block j (L_pad rows, the last L_pad - L zero) from source rank j.

  The exchanged array is [U, B, sum_i h_i / U, L_pad, H], the destination (received: the source)
  rank outermost: an all-to-all over its leading axis needs no relayout, and the (tokens, H)
  tiling stays minor on both sides. Splitting any inner axis made XLA:TPU lay both buffers out
  with H major (14B 720p, v6e:2x4, U=8: 15.8 Mcycles a block to relayout the received buffer and
  9.4 to pack, against 1.2 each at HBM bandwidth). What arrives is reordered source-major ->
  heads-major by one copy of whole (L_pad, H) slabs. No flattening reshape either: XLA:TPU lowers
  it to relayout code that grows with the token count (36 MiB of code at 8,192 tokens, U=2).
  """
  B, L, _, H = parts[0].shape
  parts = [with_layout_constraint(p, _HEADS_MAJOR_4D) for p in parts]
  packed = jnp.concatenate(  # [U, B, sum h_i / U, L_pad, H]: transpose, padding and packing in one copy
      [pad_axis(p.reshape(B, L, U, p.shape[2] // U, H).transpose(2, 0, 3, 1, 4), 3, L_pad) for p in parts],
      axis=2)
  packed = with_layout_constraint(packed, _ROW_MAJOR_5D)
  recv = jax.lax.all_to_all(packed, ULYSSES_AXIS, 0, 0, tiled=True)  # [U (source), B, sum h_i / U, L_pad, H]
  recv = with_layout_constraint(recv, _ROW_MAJOR_5D)
  return recv.transpose(1, 2, 0, 3, 4).reshape(B, recv.shape[2], U * L_pad, H)


def _padded_source_lengths(Tl: int, Sl: int, U: int, block_sizes: BlockSizes, backend: str) -> tuple[int, int]:
  """The smallest (Lq >= Tl, Lk >= Sl) whose gathered lengths U * L are whole numbers of the blocks
  `BlockLayout.make` picks for them (so no pad copy follows the exchange); Lq == Lk when Tl == Sl
  (one exchange). Static; a few hundred steps at most."""
  def smallest(L, *sides):  # block_q depends on T only and block_kv on S only, so test both on U * L
    while True:
      layout = BlockLayout.make(U * L, U * L, block_sizes, backend)
      if all((layout.T_pad if side == "q" else layout.S_pad) == U * L for side in sides):
        return L
      L += 1

  if Tl == Sl:
    L = smallest(Tl, "q", "kv")
    return L, L
  return smallest(Tl, "q"), smallest(Sl, "kv")


def _sequence_to_heads(out_BhTH: jax.Array, U: int, L: int) -> jax.Array:
  """The inverse exchange for the output: heads-major [B, h, U * L_pad, H] -> [B, L, U * h, H] (my
  tokens, all heads); exchanged over the leading axis as `_heads_to_sequence`."""
  B, h, T, H = out_BhTH.shape
  send = out_BhTH.reshape(B, h, U, T // U, H).transpose(2, 0, 1, 3, 4)  # [U (destination), B, h, L_pad, H]
  back = jax.lax.all_to_all(send, ULYSSES_AXIS, 0, 0, tiled=True)  # [U (head group), B, h, L_pad, H]
  return back[:, :, :, :L].transpose(1, 3, 0, 2, 4).reshape(B, L, U * h, H)


def usp_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    kv_valid_len: jax.Array | None = None,
    implementation: str = "auto",
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    q_prescaled: bool = False,
    backend: str = "auto",
    exchange: str = "bf16",
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
    backend: "auto" | "xla" | "pallas", as in `local_attention`: the per-device block update of each
      ring step (with "auto" one kernel call that branches on the mesh-uniform verdict); the
      schedule and its collectives are the same for every backend.
    exchange: "bf16" (the arrays as given) or "fp8": with U > 1 and T == S, Q, V and the output
      cross the Ulysses all-to-alls in e4m3 with local per-head scales and K in bf16, still one
      all-to-all each way (`attention.fp8_exchange`: its error bounds); the fixed-m statistics
      are widened by e4m3's rounding so the gate stays exact for the values that arrive.

  Returns:
    [B, T, N, H] in q's dtype, sharded `P(None, ("ring", "ulysses"))` when T is a multiple of
    U * R. T and S need not be: they are padded (padded keys masked) and the padded rows dropped,
    which leaves an uneven length that XLA lays out as it chooses (callers that keep tokens
    sharded, like the Wan transformer, pad once themselves and pass `kv_valid_len`).

  Raises:
    ValueError: bad shapes/dtypes, unknown implementation, heads that do not split over U (naming
      the workable (U, R)), a batch that is no multiple of C * W (row groups), before any compute.
  """
  B, T, N, H = validate_qkv(q, k, v, kv_valid_len=kv_valid_len)
  K = k.shape[2]
  U, R, _ = _mesh_parts(mesh, B)
  check_heads(N, K, U, R)
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown {implementation=}; expected one of {IMPLEMENTATIONS}")
  if exchange not in fp8x.EXCHANGES:
    raise ValueError(f"unknown {exchange=}; expected one of {fp8x.EXCHANGES}")
  device = mesh.devices.flat[0]
  platform = device.platform
  backend = resolve_backend(backend, platform)
  block_sizes = bw.check_block_sizes(block_sizes, backend, platform, device.device_kind)
  scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
  return _usp(q, k, v, kv_valid_len, mesh=mesh, implementation=implementation, scale=scale,
              block_sizes=block_sizes, q_prescaled=bool(q_prescaled), backend=backend, exchange=exchange)


@functools.partial(jax.jit, static_argnames=("mesh", "implementation", "scale", "block_sizes", "q_prescaled",
                                             "backend", "exchange"))
def _usp(q, k, v, kv_valid_len, *, mesh, implementation, scale, block_sizes, q_prescaled, backend, exchange):
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  U, R, G = _mesh_parts(mesh, B)
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
      _usp_body, U=U, R=R, row_axes=batch_axis(mesh) if G > 1 else None, num_heads=N,
      implementation=implementation, scale=scale,
      block_sizes=block_sizes, q_prescaled=q_prescaled, masked=(kv_valid_len is not None or S_pad != S),
      backend=backend, fp8=exchange == "fp8" and U > 1 and T == S)
  seq, rows = sequence_spec(mesh), P(batch_axis(mesh))
  out = jax.shard_map(body, mesh=mesh, in_specs=(seq, seq, seq, rows), out_specs=seq,
                      check_vma=False)(q, k, v, limit)
  return out[:, :T]


def _usp_body(q, k, v, limit, *, U, R, row_axes, num_heads, implementation, scale, block_sizes, q_prescaled,
              masked, backend, fp8=False):
  """Per-device program. q [B, Tl, N, H], k/v [B, Sl, Kp, H] local (B: this device group's rows when
  the batch is split over cfg and/or windows); limit [B] global valid keys. row_axes: the batch
  axes (`batch_axis`) when they split the rows (C * W > 1), else None.

  It stays one piece: its numbered stages (reductions, all-to-all, ring loop, all-to-all back) are
  one linear schedule over the same local shapes and collectives, and read best top to bottom.
  """
  B, Tl, N, H = q.shape
  Sl, Kp = k.shape[1], k.shape[2]
  axes = SEQUENCE_AXES
  r = jax.lax.axis_index(RING_AXIS) if R > 1 else 0
  u = jax.lax.axis_index(ULYSSES_AXIS) if U > 1 else 0
  chunk = r * U + u
  qs, logit_scale = bw.query_scaling(q, scale, q_prescaled)
  if fp8:  # K crosses in bf16: the statistics below see the values that arrive
    k = k.astype(jnp.bfloat16).astype(k.dtype)

  # 2. Pre-all-to-all reductions (tiny; XLA overlaps them with the exchange).
  if implementation != "lse":
    kv_pos_local = chunk * Sl + jnp.arange(Sl)
    valid = kv_pos_local[None, :] < limit[:, None]
    count = limit.astype(jnp.float32)
    k_sum = fm.key_sum(k, valid)
    if U * R > 1:
      # Gathered and added in mesh order on every device, not `psum`: an all-reduce's order is
      # its implementation's (XLA's in-process one and gloo's across processes differ), and one
      # ulp of the mean moves m and every exp2 after it; this way 2 processes equal 1 bit for bit.
      k_sum = jnp.sum(jax.lax.all_gather(k_sum, axes), axis=0)
    k_mean = k_sum / jnp.maximum(count, 1.0)[:, None, None]
    kc_max, v_max = fm.key_maxima(k, v, k_mean, valid)
    q_norm = fm.query_norm_max(qs) * logit_scale  # [B, N] of q * scale * log2 e
    if fp8:  # bounds for the e4m3 q and v that arrive: 2^-4 relative, + subnormals (< 2^-14 here)
      q_norm, v_max = q_norm * (1 + 2.0 ** -4 + 2.0 ** -14), v_max * (1 + 2.0 ** -4 + 2.0 ** -14)
    packed = jnp.concatenate([q_norm, kc_max, v_max], axis=1)
    if U * R > 1:
      # pmax has no JVP rule; these statistics only pick the shift m and the gate, and the
      # output o / l does not depend on m, so the exact gradient through them is zero.
      packed = jax.lax.pmax(jax.lax.stop_gradient(packed), axes)
    q_norm, kc_max, v_max = packed[:, :N], packed[:, N:N + Kp], packed[:, N + Kp:]
    gate = fm.fixed_m_gate(q_norm, kc_max, v_max, count)
    if row_axes is not None:  # each row group's statistics are its own; the path is chosen for the whole mesh
      gate = fm.GateResult(jax.lax.pmin(gate.eligible.astype(jnp.int32), row_axes) > 0, gate.v_ok, gate.c_max)

  # 3. One packed all-to-all over ulysses: heads split, the ring group's tokens gathered, heads-major.
  # Each source's token block is padded from Tl (Sl) to Lq (Lk) rows so that the gathered length
  # is a multiple of the blocks: the received buffer is the kernels' input as it is (no pad copy).
  # Padded rows carry PAD_POSITION: masked as keys through kv_limit, dropped as queries.
  hq, hk = N // U, Kp // U
  G = hq // hk
  # XLA (CPU) pads the gathered buffers at their end instead (a cheap copy there, and no q rows
  # beyond the next block multiple).
  Lq, Lk = _padded_source_lengths(Tl, Sl, U, block_sizes, backend) if backend == "pallas" else (Tl, Sl)
  layout = BlockLayout.make(U * Lq, U * Lk, block_sizes, backend)
  if fp8:  # Tl == Sl, U > 1: the same exchange with Q, V in e4m3 and K in bf16
    qg, kvbuf = fp8x.heads_to_sequence(qs, k, v, U, Lq)
  elif U > 1 and Tl == Sl:
    recv = _heads_to_sequence([qs, k, v], U, Lq)  # [B, hq + 2 hk, U * Lq, H]
    qg, kvbuf = Heads(recv, 0, hq), Heads(recv, hq, 2 * hk)  # read in place (Pallas), sliced (XLA)
  elif U > 1:  # q and k/v differ in length (not self-attention): one exchange each
    qg = _heads_to_sequence([qs], U, Lq)
    kvbuf = _heads_to_sequence([k, v], U, Lk)
  else:
    qg = pad_axis(qs.transpose(0, 2, 1, 3), 2, Lq)
    kvbuf = pad_axis(jnp.concatenate([k, v], axis=2).transpose(0, 2, 1, 3), 2, Lk)
  if backend == "pallas" and isinstance(qg, Heads):  # already block multiples: no padding
    q_BKGTH, q_array = qg, heads.take(qg).reshape(B, hk, G, U * Lq, H)
  else:
    q_BKGTH = q_array = layout.pad_q(heads.take(qg).reshape(B, hk, G, U * Lq, H))  # no-op for Pallas
  if backend != "pallas" or R > 1:  # the ring passes the packed K/V on as its own array
    kvbuf = layout.pad_kv(heads.take(kvbuf))  # [B, 2 hk, S_pad, H]

  def positions(src_chunk, L, real, size):  # global positions of the gathered slots, padded to size
    i = jnp.arange(L)
    pos = (src_chunk * U + jnp.arange(U)[:, None]) * real + i[None, :]
    pos = jnp.where(i[None, :] < real, pos, PAD_POSITION).reshape(U * L).astype(jnp.int32)
    return pad_axis(pos, 0, size, value=PAD_POSITION)

  def kv_positions(src):  # of the ring shard that came from ring rank src
    return positions(src, Lk, Sl, layout.S_pad)

  q_pos = positions(r, Lq, Tl, layout.T_pad)
  kv_limit = limit if (masked or Lk != Sl) else None

  start, fixed = Start(), gate.eligible if implementation == "auto" else None
  if implementation != "lse":
    start = Start(fm.OffsetInputs(*(jax.lax.dynamic_slice_in_dim(x, u * hk, hk, axis=1)
                                       for x in (k_mean, kc_max, gate.c_max))))

  def block(carry, kv, src, last):  # kv: the packed [B, 2 hk, U * Lk, H], read in place
    # "auto": the gate's verdict is mesh-uniform, so is the branch (a lax.cond per ring step).
    # The last step returns the finished output in q's dtype.
    return bw.attend(carry, q_BKGTH, kv, None, mode=implementation, layout=layout, q_pos=q_pos,
                     kv_pos=kv_positions(src), kv_limit=kv_limit, logit_scale=logit_scale,
                     fixed=fixed, finish_to=q.dtype if last else None)

  # 4. Ring: send the buffer on before computing with it; the last step sends nothing.
  # The barrier ties each received buffer to the step's carry: the next send cannot start before
  # this step's compute, so at most two K/V buffers are live (without it XLA may hoist all R - 1
  # permutes ahead of the compute: measured 109 vs 62 MiB of temp on v6e:2x4 at 32,760 tokens).
  # Without a ring the kernel builds the empty carry itself (`Start`: no zeros or offsets in HBM).
  # With one, the first step reads a materialised carry: in the 14B 720p step (v6e:2x4, U=4,R=2) a
  # `Start` there made XLA keep 0.54 GiB more temporaries per device (3.62 vs 3.08 GiB).
  perm = [(j, (j + 1) % R) for j in range(R)]
  carry = start if R == 1 else start.materialise(q_array, logit_scale, fixed)
  for step in range(R):
    nxt = jax.lax.ppermute(kvbuf, RING_AXIS, perm) if step < R - 1 else None
    carry = block(carry, kvbuf, (r - step) % R, last=step == R - 1)
    if nxt is not None:
      nxt, carry = jax.lax.optimization_barrier((nxt, carry))
    kvbuf = nxt

  out = carry[:, :, :, :U * Lq]  # the finished [B, hk, G, U * Lq, H] in q's dtype
  if implementation == "fixed_m":
    out = jnp.where(gate.eligible, out, jnp.nan)
  out = out.reshape(B, hq, U * Lq, H)

  # 5. All-to-all back: my token chunk, all heads; the padded rows dropped.
  if U > 1:
    return (fp8x.sequence_to_heads if fp8 else _sequence_to_heads)(out, U, Tl)  # [B, Tl, N, H]
  return out[:, :, :Tl].transpose(0, 2, 1, 3)


def cross_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    kv_valid_len: jax.Array | None = None,
    implementation: str = "auto",
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    backend: str = "auto",
    q_prescaled: bool = False,
) -> jax.Array:
  """Attention of sequence-sharded queries to replicated keys (text cross-attention): no exchange.

  Args:
    q: [B, T, N, H], sharded (or to be sharded) `P(None, ("ring", "ulysses"))`.
    k, v: [B, L, K, H] text keys/values, replicated on every device.
    mesh, kv_valid_len, implementation, scale, block_sizes, backend, q_prescaled: as in
      `usp_attention`.

  Returns:
    [B, T, N, H] in q's dtype, sharded like q. T is padded to a multiple of U * R if needed.
  """
  B, T, N, H = validate_qkv(q, k, v, kv_valid_len=kv_valid_len)
  U, R, _ = _mesh_parts(mesh, B)
  T_pad = round_up(T, U * R)
  device = mesh.devices.flat[0]
  platform = device.platform
  backend = resolve_backend(backend, platform)
  local = functools.partial(bw.local_attention, implementation=implementation, scale=scale, q_prescaled=q_prescaled,
                            block_sizes=bw.check_block_sizes(block_sizes, backend, platform, device.device_kind),
                            backend=backend)
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
