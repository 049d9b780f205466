"""`WanPipeline`'s LoRA methods (diffusers' `WanLoraLoaderMixin` names), over `pipelines.wan.lora`.

The LoRA math (formats, key conversion, fusion into the expert weights) is the model layer's
`pipelines.wan.lora`; this mixin is the pipeline's face of it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from pipelines.wan import lora


class LoraLoaderMixin:
  """`WanPipeline`'s LoRA methods (diffusers' `WanLoraLoaderMixin` names and meanings), fused.

  Unlike diffusers (peft layers computing `base(x) + scaling * B(A(x))` at run time), adapters are
  always merged into the weights: the denoise step is the same compiled program, at no extra cost.
  Changing an adapter, the scale or fused-ness recomputes only the touched parameters, in fp32 from
  the unfused base, with one rounding to the model dtype. The host keeps a copy of every touched
  parameter's base (for a LoRA on every block's attention and FFN, about one transformer's worth).

  The host class provides `_experts` (list of `nnx.State`, one per expert) and
  `transformer_config`.
  """

  @property
  def _lora(self) -> lora.LoraWeights:
    """The adapters (the host class declares `_lora_weights = lora.LoraWeights()`)."""
    return self._lora_weights

  def load_lora_weights(self, pretrained_model_name_or_path_or_dict: str | os.PathLike | Mapping[str, Any],
                        adapter_name: str | None = None, scale: float = 1.0, *,
                        weight_name: str | None = None, load_into_transformer_2: bool = False) -> str:
    """Loads a Wan transformer LoRA and fuses it into the weights.

    As diffusers, the new adapter becomes the only active one of its transformer (the others stay
    loaded: `set_adapters([...], [...])` activates several, weighted).

    Args:
      pretrained_model_name_or_path_or_dict: a `.safetensors` file, a folder holding
        `pytorch_lora_weights.safetensors` or exactly one `.safetensors`, or a state dict. Keys in
        diffusers/peft format (`transformer.blocks.0.attn1.to_q.lora_A.weight`, as diffusers'
        `save_lora_weights` writes, with its `lora_adapter_metadata` alphas), the original Wan /
        ComfyUI format (`diffusion_model.blocks.0.self_attn.q.lora_down.weight`, `lora_up`,
        `alpha`, full deltas `.diff` / `.diff_b` / `blocks.N.diff_m`) or kohya / musubi-tuner's
        (`lora_unet_blocks_0_self_attn_q.lora_down.weight`); see `pipelines.wan.lora`.
      adapter_name: diffusers' adapter name; default "default_{n}" (n = adapters already in that
        transformer).
      scale: this adapter's weight w (diffusers' `set_adapters(name, w)`); the fused weights are
        `base + s * sum_a w_a * scaling_a * B_a @ A_a`, s the global `lora_scale`.
      load_into_transformer_2: load into the low-noise expert `transformer_2` of a two-expert (Wan
        2.2) pipeline instead of `transformer`, as diffusers does.
      weight_name: the file inside the folder (diffusers' argument), for folders holding several.

    Returns:
      The adapter name.

    The adapter is fused at once, unless `unfuse_lora` was called last: then at the next
    `fuse_lora`. Cost: reading the file once (one memory map gives its tensors and its sha256), then
    per adapted parameter one host fp32 pass over it.

    Raises:
      weights.CheckpointError: no such file, a pickle file, several files in the folder, a
        corrupt file.
      ValueError: text-encoder keys; keys matching no layer of this model, shapes that do not
        fit, unpaired lora_A / lora_B (all named in one message); a taken adapter name; a bad scale;
        `load_into_transformer_2` on a one-transformer pipeline. Raised before any weight changes.
    """
    scale = lora.check_scale("scale", scale)
    if not isinstance(load_into_transformer_2, (bool, np.bool_)):
      raise ValueError(f"{load_into_transformer_2=} must be True or False")
    expert = 1 if load_into_transformer_2 else 0
    if expert >= len(self._experts):
      raise ValueError("load_into_transformer_2=True needs a two-expert (Wan 2.2) pipeline; this one has "
                       "only `transformer`")
    if adapter_name is not None and not (isinstance(adapter_name, str) and adapter_name):
      raise ValueError(f"adapter_name={adapter_name!r} must be a non-empty str or None")
    name = adapter_name or self._lora.default_name(expert)
    if (expert, name) in self._lora.adapters:
      raise ValueError(f"adapter_name={name!r} is already loaded into {lora.EXPERT_NAMES[expert]}; pick "
                       "another name, or unload_lora_weights() first")
    source = lora.load_lora(pretrained_model_name_or_path_or_dict, weight_name)  # one read of the file
    layers = lora.parse_lora(source.state, source.metadata, self.transformer_config, where=source.where)
    for adapter in self._lora.adapters.values():
      adapter.active = adapter.active and adapter.expert != expert
    self._lora.add(lora.Adapter(name=name, expert=expert, layers=layers, weight=scale, source=source.where,
                                digest=source.sha256))
    self._experts = self._lora.refuse(self._experts, {expert})
    return name

  def set_adapters(self, adapter_names: str | list[str],
                   adapter_weights: float | dict | list[float | dict | None] | None = None) -> None:
    """Activates exactly `adapter_names` (in every transformer that holds them), with their
    weights, and re-fuses (diffusers' `set_adapters`).

    Args:
      adapter_names: a name or a list of names of loaded adapters.
      adapter_weights: None (1.0 each), one number for all, or a list with one entry per name;
        an entry may be {"transformer": w, "transformer_2": w2} (a weight per expert; an expert
        missing from the dict gets 1.0) or None (1.0).

    Raises:
      ValueError: a name not loaded, a list length that differs from the names', a weight that is
        not a finite number, an unknown component; nothing changes then.
    """
    self._check_fusable()
    names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
    weights = (list(adapter_weights) if isinstance(adapter_weights, (list, tuple))
               else [adapter_weights] * len(names))
    if len(weights) != len(names):
      raise ValueError(f"{len(names)} adapter_names {names} but {len(weights)} adapter_weights {weights}")
    self._check_loaded(names)
    chosen = {}
    for name, weight in zip(names, weights):
      for expert, component in enumerate(lora.EXPERT_NAMES):
        w = weight.get(component, 1.0) if isinstance(weight, Mapping) else weight
        if isinstance(weight, Mapping) and set(weight) - set(lora.EXPERT_NAMES):
          raise ValueError(f"adapter_weights for {name!r}: components {sorted(set(weight) - set(lora.EXPERT_NAMES))} "
                           f"are not LoRA components; use {list(lora.EXPERT_NAMES)}")
        if (expert, name) in self._lora.adapters:
          chosen[(expert, name)] = lora.check_scale(f"adapter_weights[{name!r}]", 1.0 if w is None else w)
    for key, adapter in self._lora.adapters.items():
      adapter.active = key in chosen
      adapter.weight = chosen.get(key, adapter.weight)
    self._experts = self._lora.refuse(self._experts)

  def _check_fusable(self) -> None:
    """Raises the host's refusal before any adapter record changes: its `_experts` getter raises
    ValueError when the weights cannot take a LoRA (quantized weights)."""
    self._experts  # noqa: B018 (the getter's check)

  def _check_loaded(self, names: list[str]) -> None:
    """ValueError naming the names of `names` that no transformer holds."""
    loaded = {name for _, name in self._lora.adapters}
    missing = [n for n in names if n not in loaded]
    if missing:
      raise ValueError(f"adapter_names {missing} are not loaded; loaded: {sorted(loaded)}")

  def get_active_adapters(self) -> list[str]:
    """The active adapters' names, in loading order, each once (diffusers' `get_active_adapters`)."""
    return list(dict.fromkeys(a.name for a in self._lora.adapters.values() if a.active))

  def delete_adapters(self, adapter_names: str | list[str]) -> None:
    """Forgets these adapters (in every transformer) and re-fuses without them (diffusers'
    `delete_adapters`).

    Raises:
      ValueError: a name that is not loaded (nothing changes then).
    """
    self._check_fusable()
    names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
    self._check_loaded(names)
    for key in [k for k in self._lora.adapters if k[1] in names]:
      del self._lora.adapters[key]
    self._experts = self._lora.refuse(self._experts)

  def fuse_lora(self, components: Any = None, lora_scale: float = 1.0, safe_fusing: bool = False,
                adapter_names: list[str] | None = None) -> None:
    """Fuses the active adapters into the weights with global scale `lora_scale` (diffusers'
    `fuse_lora(lora_scale=..., adapter_names=...)`; with `adapter_names`, exactly those become
    active, at their weights). Adapters are fused on load, so this only re-fuses after
    `unfuse_lora`, with another scale or other adapters. `components` (None, or names from
    "transformer", "transformer_2") and `safe_fusing` are accepted for diffusers' signature: every
    expert's adapters are fused (non-finite results are the NaN guard's at run time).

    Raises:
      ValueError: `lora_scale` not a finite number; an adapter name not loaded; `components` not
        None or component names (e.g. a scale passed positionally: use lora_scale=).
    """
    _check_components(components)
    self._check_fusable()
    scale = lora.check_scale("lora_scale", lora_scale)
    if adapter_names is not None:
      names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
      self._check_loaded(names)
      for (_, name), adapter in self._lora.adapters.items():
        adapter.active = name in names
    self._lora.scale = scale
    self._lora.fused = True
    self._experts = self._lora.refuse(self._experts)

  def unfuse_lora(self, components: Any = None) -> None:
    """Restores every expert's base weights bit for bit; the adapters stay loaded (`fuse_lora`
    brings them back). `components` as in `fuse_lora`."""
    _check_components(components)
    self._check_fusable()
    self._lora.fused = False
    self._experts = self._lora.refuse(self._experts)

  def unload_lora_weights(self) -> None:
    """Restores the base weights and forgets every adapter (diffusers' `unload_lora_weights`)."""
    if self._lora.adapters:
      self._check_fusable()
    self._lora.adapters.clear()
    self._experts = self._lora.refuse(self._experts)
    self._lora.fused, self._lora.scale = True, 1.0

  def set_lora_scale(self, scale: float) -> float:
    """Sets the global LoRA scale s and re-fuses when it changed; returns the previous s.

    A call with `attention_kwargs={"scale": s}` (diffusers multiplies its LoRA layers' scaling by
    s for the call) does `previous = pipe.set_lora_scale(previous * s)` before denoising and
    `pipe.set_lora_scale(previous)` after (`hooks.CallLoraScale`). Re-fuses nothing without
    adapters or unfused.

    Raises:
      ValueError: `scale` not a finite number.
    """
    scale = lora.check_scale("scale", scale)
    previous = self._lora.scale
    if scale != previous:
      if self._lora.fused and self._lora.adapters:
        self._check_fusable()
      self._lora.scale = scale
      if self._lora.fused and self._lora.adapters:
        self._experts = self._lora.refuse(self._experts)
    return previous

  @property
  def lora_scale(self) -> float:
    """The global LoRA scale s (1.0 unless `set_lora_scale` / `fuse_lora(lora_scale)` changed it)."""
    return self._lora.scale

  def get_list_adapters(self) -> dict[str, list[str]]:
    """diffusers' `get_list_adapters`: {"transformer": [names], "transformer_2": [names]}, loaded ones."""
    out: dict[str, list[str]] = {}
    for adapter in self._lora.adapters.values():
      out.setdefault(lora.EXPERT_NAMES[adapter.expert], []).append(adapter.name)
    return out

  def lora_info(self) -> dict[str, Any]:
    """JSON-able summary for sidecars: {"scale", "fused", "adapters": `LoraWeights.describe()`}."""
    return {"scale": self._lora.scale, "fused": self._lora.fused, "adapters": self._lora.describe()}


def _check_components(components: Any) -> None:
  """None, a component name or a list of them ("transformer", "transformer_2"); ValueError otherwise."""
  names = [components] if isinstance(components, str) else components
  if names is not None and not (isinstance(names, (list, tuple))
                                and all(n in lora.EXPERT_NAMES for n in names)):
    raise ValueError(f"components={components!r} must be None or names from {list(lora.EXPERT_NAMES)} "
                     "(a LoRA scale goes in lora_scale=)")
