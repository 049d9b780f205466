"""LoRA weights for the Wan transformer, fused into the weights (no runtime cost).

Glossary (DESIGN.md section 1): D model width, E ffn width, Z layers; a LoRA layer of rank r on a
Linear with torch weight [O, I] holds lora_A (down) [r, I] and lora_B (up) [O, r].

Formats read (safetensors only, a file or a folder holding one; `format` reads them,
`convert` maps every key layout onto diffusers' module names):
- diffusers / peft, what diffusers' `WanPipeline.save_lora_weights` writes:
  `transformer.blocks.{i}.attn1.to_q.lora_A.weight`, `...lora_B.weight`, optionally
  `...lora_B.bias` (peft `lora_bias`), with the peft `LoraConfig` (r, lora_alpha, rank_pattern,
  alpha_pattern, use_rslora) as JSON under the file's `lora_adapter_metadata` key. Without that
  metadata the scaling is 1 (diffusers' convention: alpha == rank).
- the original Wan / ComfyUI / lightx2v format: `diffusion_model.blocks.{i}.self_attn.q.lora_down.
  weight` / `.lora_up.weight` (or `lora_A` / `lora_B`) / `.alpha` (scaling alpha / r), and full
  deltas: `X.diff` (a weight: linears, norms, head, embeddings, time projection), `X.diff_b` (a
  bias), `blocks.{i}.diff_m` (the block's modulation table).
- kohya / musubi-tuner: `lora_unet_blocks_0_self_attn_q.lora_down.weight` / `.lora_up.weight` /
  `.alpha`.
Text-encoder LoRA keys are refused, named.

Math (peft `LoraLayer.get_delta_weight` / `merge`): a layer's update is
`delta_W = scaling * lora_B @ lora_A` ([O, I]) with `scaling = lora_alpha / r` (or
`lora_alpha / sqrt(r)` with rsLoRA), and `delta_b = scaling * lora_B.bias`; a full delta is added
as it is (ComfyUI's `diff` patch). The active adapters `a`, with weights `w_a` (diffusers'
`set_adapters`) under the global scale `s` (diffusers' `attention_kwargs={"scale": s}`), give

    W = base + s * sum_a w_a * delta_a

computed in fp32 from the unfused base and rounded once to the parameter's dtype. The unfused base
of every touched parameter is kept on the host, so `unfuse` restores it bit for bit in any dtype.
Our kernels are [I, O] (torch's transposed) and the blocks are stacked on a leading Z axis, so the
update of `blocks.{i}.attn1.to_q` goes to `blocks.attn1.to_q.kernel[i]` (the key -> parameter
mapping is `transformer.checkpoint_layout`, shared with the checkpoint loader).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from pipelines.parallel import distributed
from pipelines.wan.lora.convert import TRANSFORMER_PREFIX, normalize, text_encoder_keys
from pipelines.wan.transformer import checkpoint_layout, to_ours, WanTransformerConfig

EXPERT_NAMES = ("transformer", "transformer_2")  # diffusers' component names of experts 0 and 1


@dataclasses.dataclass(frozen=True)
class LoraLayer:
  """One Linear layer's low-rank update, in diffusers' (torch) layout.

  Attributes:
    module: diffusers module name, e.g. "blocks.3.attn1.to_q".
    kernel_path: our parameter path of the kernel, e.g. ("blocks", "attn1", "to_q", "kernel").
    layer: block index i (the slice of the stacked parameter), or None outside the blocks.
    down: lora_A float32 [r, I].
    up: lora_B float32 [O, r].
    bias: lora_B.bias float32 [O] (peft `lora_bias`) or None.
    scaling: peft's lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA).
  """
  module: str
  kernel_path: tuple[str, ...]
  layer: int | None
  down: np.ndarray
  up: np.ndarray
  bias: np.ndarray | None
  scaling: float

  @property
  def bias_path(self) -> tuple[str, ...]:
    return (*self.kernel_path[:-1], "bias")

  def delta_kernel(self) -> np.ndarray:
    """float32 [I, O]: (scaling * lora_B @ lora_A).T, our kernel layout."""
    return (self.up @ self.down).T * np.float32(self.scaling)

  def terms(self):
    """[(our parameter path, block index or None, () -> float32 delta in our layout)]."""
    out = [(self.kernel_path, self.layer, self.delta_kernel)]
    if self.bias is not None:
      out.append((self.bias_path, self.layer, lambda: self.bias * np.float32(self.scaling)))
    return out


@dataclasses.dataclass(frozen=True)
class FullDelta:
  """A full-size delta of one parameter (`.diff` / `.diff_b` / `diff_m` keys), added as it is.

  Attributes:
    key: the diffusers parameter, e.g. "blocks.3.norm2.weight", "blocks.3.scale_shift_table".
    path: our parameter path; layer: block index or None.
    delta: float32, our layout of the parameter's slice (e.g. [6, D] for a block's table).
  """
  key: str
  path: tuple[str, ...]
  layer: int | None
  delta: np.ndarray

  def terms(self):
    """[(our parameter path, block index or None, () -> float32 delta in our layout)]."""
    return [(self.path, self.layer, lambda: self.delta)]


# --- normalized keys -> our layers ---------------------------------------------------------------

def _pattern_key(patterns, module: str) -> str | None:
  """peft `get_pattern_key`: the first pattern p with `module` matching `(.*\\.)?(p)$`."""
  for pattern in patterns:
    if re.match(rf"(.*\.)?({pattern})$", module):
      return pattern
  return None


def _scaling(module: str, rank: int, config: Mapping[str, Any] | None) -> float:
  """peft's scaling of `module` under LoraConfig fields `config` (None: diffusers' alpha == rank).

  Raises:
    ValueError: the config's rank for this module differs from lora_A's.
  """
  if config is None:
    return 1.0
  rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
  key = _pattern_key(rank_pattern, module)
  r = rank_pattern[key] if key is not None else config.get("r", rank)
  key = _pattern_key(alpha_pattern, module)
  alpha = alpha_pattern[key] if key is not None else config.get("lora_alpha", r)
  if int(r) != rank:
    raise ValueError(f"{module}: lora_A has rank {rank} but the adapter metadata says r={r}")
  return float(alpha) / (math.sqrt(r) if config.get("use_rslora") else float(r))


def linear_layers(config: WanTransformerConfig
                  ) -> dict[str, tuple[tuple[int, int], tuple[str, ...], int | None]]:
  """diffusers Linear module name -> ((O, I) torch weight shape, our kernel path, block index).

  From `transformer.checkpoint_layout` (the checkpoint loader's key mapping)."""
  return {key.removesuffix(".weight"): (shape, path, layer)
          for key, shape, path, layer, kind in checkpoint_layout(config) if kind == "linear"}


_LORA_KEY = re.compile(r"(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_B\.bias|alpha)$")


def parse_lora(state: Mapping[str, np.ndarray], metadata: Mapping[str, Any] | None,
               config: WanTransformerConfig, *, where: str = "LoRA") -> list[LoraLayer | FullDelta]:
  """Checks a LoRA against the model and returns its updates. Reads nothing, computes nothing big.

  Args:
    state: keys in any layout of the module docstring -> float32 arrays.
    metadata: diffusers' `lora_adapter_metadata` (`transformer.`-prefixed LoraConfig fields) or None.
    config: the transformer's config.
    where: the LoRA's name for messages.

  Returns:
    One `LoraLayer` per adapted Linear, then one `FullDelta` per full delta (a full delta of zeros
    for a parameter this model lacks, e.g. a non-affine norm, is dropped).

  Raises:
    ValueError: text-encoder keys; one error naming every key that matches no layer or parameter
      of this model (other prefixes, image-to-video or unknown layers, LoHa / LoKr / DoRA parts),
      every shape that does not fit, every lora_A without its lora_B (or the reverse), DoRA
      metadata, an empty LoRA.
  """
  text = text_encoder_keys(state)
  if text:
    raise ValueError(f"LoRA {where!r} adapts the text encoder ({len(text)} keys: {text}); only Wan "
                     "transformer LoRAs are supported: drop those keys (the transformer's still load)")
  state, unknown, origin = normalize(state)
  fields = _config_fields(metadata, where)
  linears = linear_layers(config)
  params = {key: (shape, path, layer, kind) for key, shape, path, layer, kind in checkpoint_layout(config)}
  parts: dict[str, dict[str, np.ndarray]] = {}
  problems, deltas = [], []
  for key, value in state.items():
    name = key.removeprefix(TRANSFORMER_PREFIX)
    match = _LORA_KEY.match(name)
    if key.startswith(TRANSFORMER_PREFIX) and name.endswith(".diff") and name[:-5] in params:
      delta, problem = _full_delta(name[:-5], value, params[name[:-5]], origin.get(key, key))
      deltas += [delta] if delta else []
      problems += [problem] if problem else []
    elif key.startswith(TRANSFORMER_PREFIX) and match and match["module"] in linears:
      parts.setdefault(match["module"], {})[match["part"]] = value
    elif not (name.endswith(".diff") and not np.any(value)):
      unknown.append(origin.get(key, key))
  if unknown:
    problems.insert(0, f"keys that match no layer of this model ({len(unknown)}): {sorted(unknown)}")
  found = []
  for module, p in sorted(parts.items()):
    layer, problem = _lora_layer(module, p, linears[module], fields)
    problems += [problem] if problem else []
    found += [layer] if layer else []
  if problems:
    raise ValueError(f"LoRA {where!r} does not fit this transformer (nothing was changed):\n  "
                     + "\n  ".join(problems))
  if not found and not deltas:
    raise ValueError(f"LoRA {where!r} holds no LoRA layers")
  return found + deltas


def _full_delta(key: str, value: np.ndarray, target: tuple, name: str) -> tuple[FullDelta | None, str | None]:
  """A full delta of diffusers parameter `key` (target: (torch shape, our path, block, transform))."""
  shape, path, layer, kind = target
  if tuple(value.shape) != tuple(shape):
    return None, f"{name} {tuple(value.shape)} (model wants {tuple(shape)} for {key})"
  return FullDelta(key=key, path=path, layer=layer, delta=np.asarray(to_ours(value, kind), np.float32)), None


def _config_fields(metadata: Mapping[str, Any] | None, where: str) -> dict[str, Any] | None:
  """The transformer's LoraConfig fields from diffusers' `lora_adapter_metadata` (prefix dropped),
  or None when there are none.

  Raises:
    ValueError: DoRA metadata (use_dora=True).
  """
  if not metadata:
    return None
  fields = {k.removeprefix(TRANSFORMER_PREFIX): v for k, v in metadata.items()
            if k.startswith(TRANSFORMER_PREFIX)} or None
  if fields and fields.get("use_dora"):
    raise ValueError(f"{where}: DoRA adapters (use_dora=True) are not supported")
  return fields


def _lora_layer(module: str, p: Mapping[str, np.ndarray], target: tuple[tuple[int, int], Any, Any],
                fields: dict[str, Any] | None) -> tuple[LoraLayer | None, str | None]:
  """One adapted Linear from its parts {"lora_A.weight", "lora_B.weight"[, "lora_B.bias",
  "alpha"]}: (the `LoraLayer`, None), or (None, what is wrong: a missing half, shapes that do not
  fit `target` ((O, I) weight shape, kernel path, block index), a bad scaling). An `alpha` sets the
  scaling alpha / r (the Wan and kohya formats); otherwise the metadata's."""
  (out_dim, in_dim), path, layer = target
  down, up, bias = p.get("lora_A.weight"), p.get("lora_B.weight"), p.get("lora_B.bias")
  if down is None or up is None:
    return None, f"{module}: has {sorted(p)} but needs both lora_A.weight and lora_B.weight"
  rank = down.shape[0] if down.ndim == 2 else -1
  want = {"lora_A.weight": (rank, in_dim), "lora_B.weight": (out_dim, rank), "lora_B.bias": (out_dim,),
          "alpha": ()}
  bad = [f"transformer.{module}.{name} {tuple(a.shape)} (model wants {want[name]})"
         for name, a in p.items() if a.size != max(1, math.prod(want[name]))
         or (name != "alpha" and tuple(a.shape) != want[name])]
  if bad or rank < 1:
    return None, "shape mismatches: " + ", ".join(bad or [f"transformer.{module}.lora_A.weight "
                                                          f"{tuple(down.shape)}"])
  try:
    scaling = float(p["alpha"].reshape(-1)[0]) / rank if "alpha" in p else _scaling(module, rank, fields)
  except ValueError as e:
    return None, str(e)
  return LoraLayer(module=module, kernel_path=path, layer=layer, down=down, up=up, bias=bias,
                   scaling=scaling), None


# --- fusing --------------------------------------------------------------------------------------

def _state_path(keypath) -> tuple[str, ...]:
  """An nnx.State pytree key path as our parameter path (dict keys, without `.value`)."""
  return tuple(k.key for k in keypath if isinstance(k, jax.tree_util.DictKey))


@dataclasses.dataclass
class Adapter:
  """A loaded LoRA: its updates, the expert it belongs to, its weight (diffusers' `set_adapters`
  weight), whether it is active, where it came from and the SHA-256 of its bytes."""
  name: str
  expert: int
  layers: list[LoraLayer | FullDelta]
  weight: float
  source: str
  digest: str = ""
  active: bool = True


class LoraWeights:
  """The LoRA adapters of a pipeline's experts and their fusion into the expert weights.

  The pipeline holds one (`WanPipeline._lora`); every method that changes weights returns new
  `nnx.State`s for the experts it touches, leaving every other leaf (and every leaf's sharding) as
  it was, so compiled steps are reused.

  Attributes:
    adapters: (expert, name) -> `Adapter`, in loading order.
    scale: the global multiplier s (diffusers' `attention_kwargs={"scale": s}`), default 1.
    fused: whether the experts' weights currently include the active adapters.
  """

  def __init__(self):
    self.adapters: dict[tuple[int, str], Adapter] = {}
    self.scale = 1.0
    self.fused = True
    self._base: dict[tuple[int, tuple[str, ...]], np.ndarray] = {}  # unfused originals, host

  def add(self, adapter: Adapter) -> None:
    """Registers an adapter (not yet fused: call `refuse`).

    Raises:
      ValueError: an adapter of that name is loaded already.
    """
    if (adapter.expert, adapter.name) in self.adapters:
      raise ValueError(f"adapter_name={adapter.name!r} is already loaded into "
                       f"{EXPERT_NAMES[adapter.expert]}; pick another name, or unload_lora_weights() first")
    self.adapters[(adapter.expert, adapter.name)] = adapter

  def default_name(self, expert: int) -> str:
    """diffusers' default adapter names, per transformer: default_0, default_1, ..."""
    n = 0
    while (expert, f"default_{n}") in self.adapters:
      n += 1
    return f"default_{n}"

  def _deltas(self, expert: int) -> dict[tuple[str, ...], dict[int | None, list]]:
    """path -> block index -> [(factor s * w_a, delta fn)] of the expert's active adapters."""
    deltas: dict[tuple[str, ...], dict[int | None, list]] = {}
    if not self.fused:
      return deltas
    for adapter in self.adapters.values():
      if adapter.expert != expert or not adapter.active:
        continue
      factor = np.float32(self.scale * adapter.weight)
      for item in adapter.layers:
        for path, layer, delta in item.terms():
          deltas.setdefault(path, {}).setdefault(layer, []).append((factor, delta))
    return deltas

  def refuse(self, experts: list, expert_ids: set[int] | None = None) -> list:
    """The experts' states with W = base + s * sum_a w_a * delta_a over the active adapters (the
    base when not fused).

    Args:
      experts: the pipeline's `nnx.State` per expert.
      expert_ids: the experts to recompute (default: all).

    Returns:
      A new list of states; untouched experts are the same objects.
    """
    experts = list(experts)
    for e in sorted(range(len(experts)) if expert_ids is None else expert_ids):
      deltas = self._deltas(e)
      touched = set(deltas) | {path for (ex, path) in self._base if ex == e}

      def update(keypath, leaf, e=e, deltas=deltas, touched=touched):
        path = _state_path(keypath)
        if path not in touched:
          return leaf
        if (e, path) not in self._base:
          self._base[(e, path)] = distributed.to_host(leaf)
        base = self._base[(e, path)]
        if path not in deltas:  # back to the base: the leaf holds it exactly, the copy can go
          new = self._base.pop((e, path))
        else:
          new = base.copy()
          for layer, terms in deltas[path].items():  # one block's slice at a time in fp32
            where = ... if layer is None else layer
            fused = base[where].astype(np.float32)
            for factor, delta in terms:
              fused += factor * delta()
            new[where] = fused.astype(base.dtype)  # the one rounding
        return distributed.put_replicated(new, leaf.sharding)

      experts[e] = jax.tree_util.tree_map_with_path(update, experts[e])
    return experts

  def describe(self) -> list[dict[str, Any]]:
    """For logs, sidecars and the resume identity: [{name, transformer, weight, active, layers,
    source, sha256}], loading order."""
    return [dict(name=a.name, transformer=EXPERT_NAMES[a.expert], weight=a.weight, active=a.active,
                 layers=len(a.layers), source=a.source, sha256=a.digest) for a in self.adapters.values()]


def check_scale(name: str, value: Any) -> float:
  """A finite real number (not a bool) as float; ValueError naming the argument otherwise."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
      or not math.isfinite(value):
    raise ValueError(f"{name}={value!r} must be a finite number (1.0: the LoRA as trained; 0: off)")
  return float(value)
