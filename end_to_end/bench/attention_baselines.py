"""The attention implementations `bench.attention` times ours against, as jitted fns of (q, k, v)
[B, T, N, H] -> [B, T, N, H] with softmax scale H^-1/2.

- XLA's dense `jax.nn.dot_product_attention` (when its fp32 logits fit a limit); on a GPU also cuDNN.
- On a TPU, jax's Pallas kernels: flash attention (`jax_tpu_flash`, its default 128 blocks) and
  splash attention (`splash_{block_q}x{block_kv}x{block_kv_compute}`: the kernel maxdiffusion runs for
  Wan) at each block shape of a small grid, as maxdiffusion's tile-size grid search does.
  Any length T: a Pallas baseline pads the sequence to a multiple of its blocks and masks the padded
  keys with segment ids (real tokens id 1, padded ones id 0: a padded query attends only to padded
  keys, so no row is empty), then drops the padded rows. With `interpret`, splash runs in Pallas'
  interpret mode (exact, slow: for tests on a CPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

# (block_q, block_kv, block_kv_compute) for splash: around the shape measured best on a v5e at
# 32,768 x 12 x 128 bf16 (4096 x 2048 x 256 with a 64 MiB scoped VMEM limit), and smaller ones that
# compile at the default limit.
SPLASH_GRID = ((4096, 2048, 256), (4096, 2048, 512), (2048, 2048, 256), (2048, 1024, 512),
               (1024, 1024, 512), (1024, 512, 512), (512, 1024, 1024))
FLASH_BLOCK = 128  # jax's Pallas TPU flash attention's default block


def parse_grid(text: str) -> tuple[tuple[int, int, int], ...]:
  """"default" -> `SPLASH_GRID`; "none" -> (); else comma-separated QxKVxC, e.g. "4096x2048x256".

  Raises: ValueError: a shape that is not three positive integers with C dividing KV.
  """
  if text == "default":
    return SPLASH_GRID
  if text == "none":
    return ()
  shapes = []
  for part in text.split(","):
    try:
      bq, bkv, bkc = (int(x) for x in part.lower().split("x"))
    except ValueError:
      raise ValueError(f"--splash-grid entry {part!r} is not QxKVxC (e.g. 4096x2048x256)") from None
    if min(bq, bkv, bkc) <= 0 or bkv % bkc:
      raise ValueError(f"--splash-grid entry {part!r}: blocks must be positive and C must divide KV")
    shapes.append((bq, bkv, bkc))
  return tuple(shapes)


def padded_length(length: int, block: int) -> int:
  """`length` rounded up to a multiple of `block`."""
  return math.ceil(length / block) * block


def segment_ids(length: int, padded: int) -> jax.Array:
  """int32 [padded]: 1 for the `length` real tokens, 0 for the padding."""
  return jnp.asarray(np.arange(padded) < length, jnp.int32)


def _heads_first(x: jax.Array, padded: int) -> jax.Array:
  """[B, T, N, H] -> [B, N, padded, H], zero rows appended."""
  x = x.transpose(0, 2, 1, 3)
  return jnp.pad(x, ((0, 0), (0, 0), (0, padded - x.shape[2]), (0, 0)))


def splash(shape: tuple[int, int, int, int], blocks: tuple[int, int, int], *, interpret: bool = False) -> Callable:
  """Splash attention (no mask beyond the padding) at `blocks` = (block_q, block_kv, block_kv_compute),
  the batch folded into its heads (one kernel over B x N heads: a `vmap` over the batch ran out of
  scoped VMEM at batch 2 on a v5e, where the folded call runs)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

  batch, length, heads, head_dim = shape
  bq, bkv, bkc = blocks
  padded = padded_length(length, math.lcm(bq, bkv))

  def fn(q, k, v):  # the kernel is built when traced: blocks it refuses fail the first call, as a compile would
    kernel = sk.make_splash_mha(mask=sm.MultiHeadMask([sm.FullMask((padded, padded))] * (batch * heads)),
                                head_shards=1, q_seq_shards=1, interpret=interpret,
                                block_sizes=sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkc))
    ids = segment_ids(length, padded)
    seg = sk.SegmentIds(ids, ids) if padded != length else None
    q, k, v = (_heads_first(x, padded).reshape(batch * heads, padded, head_dim) for x in (q, k, v))
    out = kernel(q * jnp.asarray(head_dim ** -0.5, q.dtype), k, v, segment_ids=seg)
    return out[:, :length].reshape(batch, heads, length, head_dim).transpose(0, 2, 1, 3)
  return jax.jit(fn)


def tpu_flash(shape: tuple[int, int, int, int]) -> Callable:
  """jax's Pallas TPU flash attention at its default blocks."""
  from jax.experimental.pallas.ops.tpu import flash_attention as fa

  batch, length, _, head_dim = shape
  padded = padded_length(length, FLASH_BLOCK)
  ids = jnp.broadcast_to(segment_ids(length, padded), (batch, padded))
  seg = fa.SegmentIds(ids, ids) if padded != length else None

  def fn(q, k, v):
    out = fa.flash_attention(*(_heads_first(x, padded) for x in (q, k, v)), segment_ids=seg,
                             sm_scale=head_dim ** -0.5)
    return out[:, :, :length].transpose(0, 2, 1, 3)
  return jax.jit(fn)


KINDS = ("dense", "cudnn", "flash", "splash")  # the baselines by kind, as `--baselines` names them


def parse_kinds(text: str) -> tuple[str, ...]:
  """'all' or comma-separated `KINDS` (e.g. "splash": leave jax's slow 128-block flash out of a
  chip's timed call). Raises ValueError naming an unknown kind."""
  if text.strip().lower() == "all":
    return KINDS
  kinds = tuple(part.strip().lower() for part in text.split(",") if part.strip())
  unknown = [kind for kind in kinds if kind not in KINDS]
  if unknown or not kinds:
    raise ValueError(f"--baselines {text!r}: give 'all' or some of {', '.join(KINDS)}, comma-separated")
  return kinds


def baselines(platform: str, dtype, shape: tuple[int, int, int, int], dense_limit_gb: float, *,
              splash_grid: tuple[tuple[int, int, int], ...] = SPLASH_GRID, interpret: bool = False,
              kinds: tuple[str, ...] = KINDS) -> dict:
  """name -> jitted fn of the implementations of `kinds` to compare with on `platform` (module
  docstring); the Pallas TPU ones on a TPU, or splash in interpret mode anywhere with `interpret`.

  Raises: SystemExit: none fits (no dense within the limit and no fused attention of `kinds` on
  `platform`).
  """
  B, T, N, H = shape
  fns = {}
  if "dense" in kinds and B * N * T * T * 4 <= dense_limit_gb * 1e9:
    fns["xla_dense"] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"))
  if "cudnn" in kinds and platform == "gpu" and dtype != jnp.float32:
    fns["cudnn"] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
  if "flash" in kinds and platform == "tpu":
    fns["jax_tpu_flash"] = tpu_flash(shape)
  if "splash" in kinds and (platform == "tpu" or interpret):
    for blocks in splash_grid:
      fns["splash_" + "x".join(map(str, blocks))] = splash(shape, blocks, interpret=interpret)
  if not fns:
    raise SystemExit(f"no baseline fits: dense logits of {B * N * T * T * 4 / 1e9:.1f} GB against "
                     f"--dense-limit-gb {dense_limit_gb}, and no fused attention of --baselines {','.join(kinds)} "
                     f"on {platform} here")
  return fns
