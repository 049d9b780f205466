"""Sliding-window attention with halo exchange, and the per-layer strategy switch.

For a layer whose query i sees only keys with |i - j| <= w (or i - w <= j <= i, causal), a
sequence shard needs just w neighbouring keys from each side (DESIGN.md section 5). Each device
sends the tail (head) of its K/V to the next (previous) devices with `ppermute`, so a layer moves
O(w) tokens per device instead of all-gathering the whole sequence. A window wider than a shard
takes ceil(w / shard) hops, each one more `ppermute`.

Tokens are sharded over (ring, ulysses) jointly, ring-major: device (r, u) holds chunk r * U + u.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from attention.block_layout import PAD_POSITION, BlockLayout
from attention import blockwise as bw
from attention.carry import Start
from attention.masks import validate_qkv
from attention.mesh import RING_AXIS, SEQUENCE_AXES, ULYSSES_AXIS, batch_axis, mesh_degrees, sequence_spec
from attention.padding import pad_axis, round_up
from attention.settings import BlockSizes, resolve_backend
from attention.usp import usp_attention

Strategy = Literal["usp", "halo", "all_gather"]
STRATEGIES = ("usp", "halo", "all_gather")


def _check_window_inputs(q, k, v, kv_valid_len, window):
  validate_qkv(q, k, v, kv_valid_len=kv_valid_len, window=window)
  if window is None:
    raise ValueError("window attention needs an int window >= 0, got window=None (use usp_attention)")
  if q.shape[1] != k.shape[1]:
    raise ValueError(f"window attention is self-attention: need T == S, got q.shape={q.shape} k.shape={k.shape}")


def halo_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    window: int,
    causal: bool = False,
    kv_valid_len: jax.Array | None = None,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    backend: str = "auto",
) -> jax.Array:
  """Exact sliding-window attention with only the window's K/V exchanged between neighbours.

  Args:
    q: [B, T, N, H]; k, v: [B, T, K, H] (self-attention, N % K == 0).
    mesh: the (ring, ulysses) mesh; the sequence is split over all U * R devices.
    window: w >= 0: query i sees key j when |i - j| <= w (i - w <= j <= i with `causal`). Any w
      works; w wider than a shard costs ceil(w / shard) hops per direction.
    causal, kv_valid_len, scale, block_sizes, backend: as in `local_attention`.

  Returns:
    [B, T, N, H] in q's dtype, sharded over the sequence. Per call: ceil(w / shard) (causal) or
    2 * ceil(w / shard) collective-permutes of at most w tokens each, nothing else. The LSE path
    is used (a window's rows see keys far below any global fixed-m bound).

  Raises:
    ValueError: as `local_attention`, window None, or T != S.
  """
  return _window_call(q, k, v, kv_valid_len, mesh=mesh, window=window, causal=causal, scale=scale,
                      block_sizes=block_sizes, exchange="halo", backend=backend)


def _window_call(q, k, v, kv_valid_len, *, mesh, window, causal, scale, block_sizes, exchange, backend):
  """Checks, defaults, then the jitted program (shared by the halo and all-gather exchanges)."""
  _check_window_inputs(q, k, v, kv_valid_len, window)
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
  device = mesh.devices.flat[0]
  platform = device.platform
  backend = resolve_backend(backend, platform)
  block_sizes = bw.check_block_sizes(block_sizes, backend, platform, device.device_kind)
  return _window_attention(q, k, v, kv_valid_len, mesh=mesh, window=int(window), causal=bool(causal),
                           scale=scale, block_sizes=block_sizes, exchange=exchange, backend=backend)


@functools.partial(jax.jit, static_argnames=("mesh", "window", "causal", "scale", "block_sizes", "exchange",
                                             "backend"))
def _window_attention(q, k, v, kv_valid_len, *, mesh, window, causal, scale, block_sizes, exchange, backend):
  B, T, N, H = q.shape
  U, R = mesh_degrees(mesh)
  T_pad = round_up(T, U * R)
  q, k, v = (pad_axis(x, 1, T_pad) for x in (q, k, v))
  limit = jnp.full((B,), T, jnp.int32) if kv_valid_len is None else jnp.minimum(kv_valid_len, T).astype(jnp.int32)
  body = _halo_body if exchange == "halo" else _gathered_body
  body = functools.partial(body, U=U, R=R, window=window, causal=causal, scale=scale,
                           block_sizes=block_sizes, backend=backend)
  seq, rows = sequence_spec(mesh), P(batch_axis(mesh))
  out = jax.shard_map(body, mesh=mesh, in_specs=(seq, seq, seq, rows), out_specs=seq,
                      check_vma=False)(q, k, v, limit)
  return out[:, :T]


def _halo_body(q, k, v, limit, *, U, R, window, causal, scale, block_sizes, backend):
  B, Tl, N, H = q.shape
  D = U * R
  r = jax.lax.axis_index(RING_AXIS) if R > 1 else 0
  u = jax.lax.axis_index(ULYSSES_AXIS) if U > 1 else 0
  chunk = r * U + u
  kv = jnp.stack([k, v])  # packed [2, B, Tl, K, H]: one permute per hop moves both
  own_pos = chunk * Tl + jnp.arange(Tl)
  pieces, positions = [kv], [own_pos]
  hops = min(-(-window // Tl), D - 1) if window > 0 else 0
  for h in range(1, hops + 1):
    n = min(Tl, window - (h - 1) * Tl)
    # From chunk - h: its last n rows (keys just before mine).
    tail = jax.lax.ppermute(kv[:, :, Tl - n:], SEQUENCE_AXES, [(j, j + h) for j in range(D - h)])
    src = chunk - h
    pos = jnp.where(src >= 0, src * Tl + Tl - n + jnp.arange(n), PAD_POSITION)
    pieces.insert(0, tail)
    positions.insert(0, pos)
    if not causal:  # from chunk + h: its first n rows
      head = jax.lax.ppermute(kv[:, :, :n], SEQUENCE_AXES, [(j + h, j) for j in range(D - h)])
      src = chunk + h
      pieces.append(head)
      positions.append(jnp.where(src < D, src * Tl + jnp.arange(n), PAD_POSITION))
  kv = jnp.concatenate(pieces, axis=2)
  kv_pos = jnp.concatenate(positions).astype(jnp.int32)
  return _attend_positions(q, kv[0], kv[1], own_pos, kv_pos, limit, window=window, causal=causal,
                           scale=scale, block_sizes=block_sizes, backend=backend)


def _attend_positions(q, k, v, q_pos, kv_pos, limit, *, window, causal, scale, block_sizes, backend):
  """LSE attention of q [B, T, N, H] to k/v [B, S, K, H] at explicit global positions."""
  T, S, K = q.shape[1], k.shape[1], k.shape[2]
  layout = BlockLayout.make(T, S, block_sizes, backend)
  q_in, logit_scale = bw.query_scaling(q, scale, False)
  q_BKGTH = layout.queries(q_in, K)
  out = bw.attend(Start(), q_BKGTH, layout.keys(k), layout.keys(v), mode="lse", layout=layout,
                  q_pos=layout.q_positions(q_pos), kv_pos=layout.kv_positions(kv_pos),
                  kv_limit=limit, window=window, causal=causal, logit_scale=logit_scale, finish_to=q.dtype)
  return layout.output(out)


def all_gather_window_attention(q, k, v, *, mesh, window, causal=False, kv_valid_len=None,
                                scale=None, block_sizes=None, backend="auto"):
  """Sliding-window attention that all-gathers K/V over the mesh (the simple, O(T) baseline).

  Same arguments and result as `halo_attention`; one all-gather of the packed K/V per call.
  """
  return _window_call(q, k, v, kv_valid_len, mesh=mesh, window=window, causal=causal, scale=scale,
                      block_sizes=block_sizes, exchange="all_gather", backend=backend)


def _gathered_body(q, k, v, limit, *, U, R, window, causal, scale, block_sizes, backend):
  Tl = q.shape[1]
  r = jax.lax.axis_index(RING_AXIS) if R > 1 else 0
  u = jax.lax.axis_index(ULYSSES_AXIS) if U > 1 else 0
  kv = jnp.stack([k, v])
  if U * R > 1:
    kv = jax.lax.all_gather(kv, SEQUENCE_AXES, axis=2, tiled=True)
  q_pos = (r * U + u) * Tl + jnp.arange(Tl)
  return _attend_positions(q, kv[0], kv[1], q_pos, jnp.arange(kv.shape[2], dtype=jnp.int32), limit,
                           window=window, causal=causal, scale=scale, block_sizes=block_sizes, backend=backend)


def sequence_parallel_attention(
    q, k, v, *, mesh, window: int | None = None, causal: bool = False, kv_valid_len=None,
    strategy: Strategy | None = None, implementation: str = "auto", scale=None, block_sizes=None,
    backend: str = "auto"):
  """Per-layer strategy switch: global layers use USP, sliding-window layers halo or all-gather.

  Args:
    strategy: None picks "usp" for a global layer (window None) and "halo" for a windowed one;
      "usp" needs window None and not causal; "halo" / "all_gather" need a window.
    Other arguments: as in `usp_attention` / `halo_attention`.

  Raises:
    ValueError: an unknown strategy or one that does not fit the layer.
  """
  if strategy is None:
    strategy = "usp" if window is None else "halo"
  match strategy:
    case "usp":
      if window is not None or causal:
        raise ValueError(f"strategy 'usp' is for global (non-windowed, non-causal) layers, got {window=} {causal=}")
      return usp_attention(q, k, v, mesh=mesh, kv_valid_len=kv_valid_len,
                           implementation=implementation, scale=scale, block_sizes=block_sizes,
                           backend=backend)
    case "halo":
      return halo_attention(q, k, v, mesh=mesh, window=window, causal=causal,
                            kv_valid_len=kv_valid_len, scale=scale, block_sizes=block_sizes, backend=backend)
    case "all_gather":
      return all_gather_window_attention(q, k, v, mesh=mesh, window=window, causal=causal,
                                         kv_valid_len=kv_valid_len, scale=scale, block_sizes=block_sizes,
                                         backend=backend)
    case _:
      raise ValueError(f"unknown {strategy=}; expected one of {STRATEGIES}")
