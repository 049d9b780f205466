"""Loading diffusers `WanTransformer3DModel` folders into `WanTransformer` (safetensors only).

A diffusers `transformer/` folder holds `config.json` and `diffusion_pytorch_model*.safetensors`
(sharded with a `*.safetensors.index.json` for the 14B models). Keys map one to one onto our
parameter tree (`transformer.param_shapes`): Linear weights [O, I] are transposed to [I, O], the
Conv3d patch weight [D, C, pt, ph, pw] to [pt, ph, pw, C, D], the `scale_shift_table`s lose their
leading 1, and the per-block tensors `blocks.{i}.*` are stacked on a leading Z axis.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from pipelines.storage import weights
from pipelines.parallel import distributed
from pipelines.wan.transformer import quantization
from pipelines.wan.transformer.config import keeps_fp32, WanTransformerConfig
from pipelines.wan.transformer.model import WanTransformer, build_transformer
from pipelines.wan.transformer.weight_placement import weight_shardings

# How a diffusers tensor becomes ours.
_LINEAR, _CONV3D, _TABLE, _COPY = "linear", "conv3d", "table", "copy"


def _linear(prefix: str, path: tuple[str, ...], out_dim: int, in_dim: int):
  yield f"{prefix}.weight", (out_dim, in_dim), (*path, "kernel"), _LINEAR
  yield f"{prefix}.bias", (out_dim,), (*path, "bias"), _COPY


LayoutEntry = tuple[str, tuple[int, ...], tuple[str, ...], int | None, str]


def checkpoint_layout(config: WanTransformerConfig) -> Iterator[LayoutEntry]:
  """Yields (diffusers key, diffusers shape, our path, layer index or None, transform)."""
  d = config.dim
  pt, ph, pw = config.patch_size
  top = [
      ("patch_embedding.weight", (d, config.in_channels, pt, ph, pw), ("patch_embedding", "kernel"), _CONV3D),
      ("patch_embedding.bias", (d,), ("patch_embedding", "bias"), _COPY),
      *_linear("condition_embedder.time_embedder.linear_1",
               ("condition_embedder", "time_embedder", "linear_1"), d, config.freq_dim),
      *_linear("condition_embedder.time_embedder.linear_2",
               ("condition_embedder", "time_embedder", "linear_2"), d, d),
      *_linear("condition_embedder.time_proj", ("condition_embedder", "time_proj"), 6 * d, d),
      *_linear("condition_embedder.text_embedder.linear_1",
               ("condition_embedder", "text_embedder", "linear_1"), d, config.text_dim),
      *_linear("condition_embedder.text_embedder.linear_2",
               ("condition_embedder", "text_embedder", "linear_2"), d, d),
      ("scale_shift_table", (1, 2, d), ("scale_shift_table",), _TABLE),
      *_linear("proj_out", ("proj_out",), config.out_channels * config.patch_volume, d),
  ]
  top += list(_image_embedder(config))
  for key, shape, path, kind in top:
    yield key, shape, path, None, kind
  block = list(_block_entries(config))
  for i in range(config.num_layers):
    for key, shape, path, kind in block:
      yield f"blocks.{i}.{key}", shape, ("blocks", *path), i, kind
  if config.has_vace:
    yield from _vace_entries(config, block)


def _block_entries(config: WanTransformerConfig):
  """One block's (key under `blocks.{i}.`, shape, our path under `blocks`, transform)."""
  d, e = config.dim, config.ffn_dim
  block = [("scale_shift_table", (1, 6, d), ("scale_shift_table",), _TABLE)]
  for attn in ("attn1", "attn2"):
    for proj in ("to_q", "to_k", "to_v"):
      block += _linear(f"{attn}.{proj}", (attn, proj), d, d)
    block += _linear(f"{attn}.to_out.0", (attn, "to_out"), d, d)
    block += [(f"{attn}.norm_q.weight", (d,), (attn, "norm_q"), _COPY),
              (f"{attn}.norm_k.weight", (d,), (attn, "norm_k"), _COPY)]
  if config.has_image_branch and not config.image_in_context:
    block += _linear("attn2.add_k_proj", ("attn2", "add_k_proj"), d, d)
    block += _linear("attn2.add_v_proj", ("attn2", "add_v_proj"), d, d)
    block += [("attn2.norm_added_k.weight", (d,), ("attn2", "norm_added_k"), _COPY)]
  if config.cross_attn_norm:
    block += [("norm2.weight", (d,), ("norm2", "weight"), _COPY),
              ("norm2.bias", (d,), ("norm2", "bias"), _COPY)]
  block += _linear("ffn.net.0.proj", ("ffn", "proj_in"), e, d)
  block += _linear("ffn.net.2", ("ffn", "proj_out"), d, e)
  return block


def _vace_entries(config: WanTransformerConfig, block: list) -> Iterator[LayoutEntry]:
  """diffusers' `WanVACETransformer3DModel` keys: `vace_patch_embedding`, `vace_blocks.{i}` (a block's
  keys and `proj_out`; block 0 also `proj_in`, our `vace_proj_in`), stacked on a leading V axis."""
  d = config.dim
  pt, ph, pw = config.patch_size
  yield ("vace_patch_embedding.weight", (d, config.vace_in_channels, pt, ph, pw), ("vace_patch_embedding", "kernel"),
         None, _CONV3D)
  yield "vace_patch_embedding.bias", (d,), ("vace_patch_embedding", "bias"), None, _COPY
  for key, shape, path, kind in _linear("vace_blocks.0.proj_in", ("vace_proj_in",), d, d):
    yield key, shape, path, None, kind
  for i in range(len(config.vace_layers)):
    for key, shape, path, kind in [*block, *_linear("proj_out", ("proj_out",), d, d)]:
      yield f"vace_blocks.{i}.{key}", shape, ("vace_blocks", *path), i, kind


def _image_embedder(config: WanTransformerConfig):
  """The image embedder's entries (Wan 2.1 I2V / FLF2V; none without an image branch)."""
  if not config.has_image_branch:
    return
  d, i = config.dim, config.image_dim
  prefix, path = "condition_embedder.image_embedder", ("condition_embedder", "image_embedder")
  for norm, width in (("norm1", i), ("norm2", d)):
    for leaf in ("weight", "bias"):
      yield f"{prefix}.{norm}.{leaf}", (width,), (*path, norm, leaf), _COPY
  yield from _linear(f"{prefix}.ff.net.0.proj", (*path, "proj_in"), i, i)
  yield from _linear(f"{prefix}.ff.net.2", (*path, "proj_out"), d, i)
  if config.pos_embed_seq_len is not None:
    yield f"{prefix}.pos_embed", (1, config.pos_embed_seq_len, i), (*path, "pos_embed"), _TABLE


def to_ours(array: np.ndarray, kind: str) -> np.ndarray:
  match kind:
    case "linear":
      return array.T
    case "conv3d":
      return array.transpose(2, 3, 4, 1, 0)  # [D, C, pt, ph, pw] -> [pt, ph, pw, C, D]
    case "table":
      return array[0]
    case "copy":
      return array
    case _:
      raise ValueError(f"unknown transform {kind=}")


def load_transformer(folder: str, dtype: jnp.dtype = jnp.float32, *, mesh: Mesh | None = None,
                     shard_weights: bool = False, progress: bool | None = None,
                     quantize: str | None = None) -> WanTransformer:
  """Loads a diffusers `WanTransformer3DModel` folder (config.json + safetensors).

  The files are memory-mapped and every parameter goes straight to its devices
  (`distributed.put_host_leaves`): each device's part is read, laid out and cast in one copy, so
  host memory beyond the placed weights is one part at a time.

  Args:
    folder: the `transformer/` folder (single file or sharded with an index).
    dtype: activation / parameter dtype; `KEEP_IN_FP32` parameters stay fp32 as in diffusers.
    mesh: place the weights on this (cfg, ring, ulysses) mesh as `transformer.weight_shardings`
      does (replicated, or the block weights split with `shard_weights`); None: the default device
      (uncommitted: a call on a mesh moves them).
    shard_weights: with `mesh`, split the stacked block weights over all of its devices.
    progress: a progress bar (None: for large folders only).
    quantize: None or a `quantization.QUANTIZATION_MODES` mode: the block Linear kernels are quantized from
      the checkpoint's values (read as fp32, not rounded to `dtype` first), each placed in fp32
      and quantized before the next, after the other weights: the devices hold the quantized
      model plus one stacked fp32 kernel at most.

  Returns:
    The `WanTransformer`.

  Raises:
    weights.CheckpointError: no folder / config, pickle-only weights (refused: unpickling can
      execute code), unreadable files, or keys missing / unexpected / mis-shaped (one error that
      lists them all).
    ValueError: a config this model does not support (e.g. image-to-video fields set).
  """
  config = WanTransformerConfig.from_dict(weights.read_config(folder))
  state = weights.read_safetensors_folder(folder)  # memory-mapped views: nothing read yet
  return load_transformer_state(config, state, folder, dtype, mesh=mesh, shard_weights=shard_weights,
                                progress=progress, quantize=quantize)


def load_transformer_state(config: WanTransformerConfig, state: Mapping[str, Any], where: str,
                           dtype: jnp.dtype = jnp.float32, *, mesh: Mesh | None = None, shard_weights: bool = False,
                           progress: bool | None = None, quantize: str | None = None,
                           scales: Mapping[str, np.ndarray] | None = None) -> WanTransformer:
  """`load_transformer`'s loading from tensors already named as diffusers names them (a folder's,
  or a single file's renamed by `wan.pretrained.layouts`), still memory-mapped.

  Args:
    config, where: the model's config; the source, for messages.
    state: diffusers key -> tensor (`weights.TensorRef` or a numpy view).
    scales: diffusers key -> a scaled-fp8 weight's scale (w = q * scale), float32 broadcast to the
      weight's checkpoint shape (`wan.pretrained.layouts.row_scales`: one value, or one per output
      row), laid out as the weight is. With quantize="fp8" a scaled block kernel is placed as it is,
      1 byte a value, its scales as the per-channel scales [Z, 1, O] (exact: one value per output
      channel; an unscaled layer's are 1); every other scaled tensor is q * scale in float32,
      rounded once to its dtype.
    dtype, mesh, shard_weights, progress, quantize: see `load_transformer`.
  """
  scales = scales or {}
  layout = list(checkpoint_layout(config))
  weights.check_state_dict(state, {key: shape for key, shape, *_ in layout}, where=where)
  params: dict = {}
  stacked: dict[tuple[str, ...], list] = {}
  for key, _, path, layer, kind in layout:
    view = to_ours(np.asarray(state[key]), kind)
    scale = to_ours(scales[key], kind) if key in scales else None  # laid out as its weight
    if layer is None:
      _set(params, path, weights.HostLeaf.of(view, _leaf_dtype(path, dtype), scale))
    else:
      stacked.setdefault(path, [None] * layer_count(config, path[0]))[layer] = (view, scale)
  kernels = {(stack, *p, "kernel") for p in quantization.QUANTIZED_LINEARS
             for stack in quantization.block_stacks(config)} if quantize else set()
  for path, layers in stacked.items():
    views = [v for v, _ in layers]
    layer_scales = None if all(s is None for _, s in layers) else [s for _, s in layers]
    fp8 = quantize == "fp8" and path in kernels and layer_scales is not None
    leaf_dtype = views[0].dtype if fp8 else np.float32 if path in kernels else _leaf_dtype(path, dtype)
    leaf = weights.HostLeaf.stack(views, leaf_dtype, None if fp8 else layer_scales)
    _set(params, path, (leaf, layer_scales) if fp8 else leaf)
  kernels = {path: _pop(params, path) for path in kernels}
  is_leaf = lambda x: isinstance(x, weights.HostLeaf)  # noqa: E731
  shapes = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), params, is_leaf=is_leaf)
  shardings = None if mesh is None else weight_shardings(shapes, mesh, shard_weights)
  arrays = distributed.put_host_leaves(params, shardings, progress=progress, desc=f"loading {where}")
  for path, leaf in kernels.items():
    placed = _prequantized_leaf(*leaf, mesh, shard_weights) if isinstance(leaf, tuple) else (
        _quantized_leaf(leaf, quantize, mesh, shard_weights))
    _set(arrays, path, placed)
  return quantization.quantize_transformer(build_transformer(config, arrays, dtype), quantize)


def _prequantized_leaf(leaf: weights.HostLeaf, layer_scales: list[np.ndarray | None], mesh: Mesh | None,
                       shard_weights: bool):
  """A stacked e4m3 kernel [Z, I, O] placed as a `quantization` QArray: its values as they are, each
  layer's scale ([I, O] broadcast, one value per output channel O; None: 1) as the scales [Z, 1, O]."""
  z, _, o = leaf.shape
  scale = np.stack([np.ones((1, o), np.float32) if s is None else np.asarray(s[:1], np.float32) for s in layer_scales])
  host = {"qvalue": leaf, "scale": weights.HostLeaf.of(scale, np.float32)}
  shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in host.items()}
  where = None if mesh is None else weight_shardings({"blocks": shapes}, mesh, shard_weights)["blocks"]
  placed = distributed.put_host_leaves(host, where, progress=False)
  return quantization.fp8_qarray(placed["qvalue"], placed["scale"])


def _quantized_leaf(leaf: weights.HostLeaf, mode: str, mesh: Mesh | None, shard_weights: bool):
  """A stacked block kernel [Z, I, O] placed in fp32 as `weight_shardings` places it, quantized
  (`quantization.quantize_kernel`) and its QArray placed the same way; the fp32 copy is dropped."""
  def where(tree):
    return None if mesh is None else weight_shardings({"blocks": tree}, mesh, shard_weights)["blocks"]

  full = distributed.put_host_leaves(leaf, where(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)), progress=False)
  quantized = quantization.quantize_kernel_jit(full, mode)
  del full
  placed = where(quantized)
  return quantized if placed is None else distributed.put_sharded(quantized, placed)


def layer_count(config: WanTransformerConfig, stack: str) -> int:
  """The layers of a stack of blocks: Z for "blocks", V for "vace_blocks"."""
  return len(config.vace_layers) if stack == "vace_blocks" else config.num_layers


def _leaf_dtype(path: tuple[str, ...], dtype) -> np.dtype:
  return np.dtype(jnp.float32 if keeps_fp32(path) else dtype)


def _pop(tree: dict, path: tuple[str, ...]):
  for key in path[:-1]:
    tree = tree[key]
  return tree.pop(path[-1])


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value
