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

    Args:
      pretrained_model_name_or_path_or_dict: a `.safetensors` file, a folder holding
        `pytorch_lora_weights.safetensors` or exactly one `.safetensors`, or a state dict. Keys in
        diffusers/peft format (`transformer.blocks.0.attn1.to_q.lora_A.weight`, as diffusers'
        `save_lora_weights` writes, with its `lora_adapter_metadata` alphas) or the original Wan
        format (`diffusion_model.blocks.0.self_attn.q.lora_down.weight`, `lora_up`, `alpha`).
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
    `fuse_lora`. Cost: reading the file, then per adapted parameter one host fp32 pass over it.

    Raises:
      weights.CheckpointError: no such file, a pickle file, several files in the folder, a
        corrupt file.
      ValueError: keys matching no Linear layer of this model, shapes that do not fit, unpaired
        lora_A / lora_B (all named in one message); a taken adapter name; a bad scale;
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
    state, metadata, where = lora.read_lora(pretrained_model_name_or_path_or_dict, weight_name)
    layers = lora.parse_lora(state, metadata, self.transformer_config, where=where)
    self._lora.add(lora.Adapter(name=name, expert=expert, layers=layers, weight=scale, source=where))
    self._experts = self._lora.refuse(self._experts, {expert})
    return name

  def fuse_lora(self, lora_scale: float = 1.0) -> None:
    """Fuses the loaded adapters into the weights with global scale `lora_scale` (diffusers'
    `fuse_lora(lora_scale=...)`). Adapters are fused on load, so this only re-fuses after
    `unfuse_lora` or with another scale.

    Raises:
      ValueError: `lora_scale` not a finite number.
    """
    self._lora.scale = lora.check_scale("lora_scale", lora_scale)
    self._lora.fused = True
    self._experts = self._lora.refuse(self._experts)

  def unfuse_lora(self) -> None:
    """Restores every expert's base weights bit for bit; the adapters stay loaded (`fuse_lora`
    brings them back)."""
    self._lora.fused = False
    self._experts = self._lora.refuse(self._experts)

  def unload_lora_weights(self) -> None:
    """Restores the base weights and forgets every adapter (diffusers' `unload_lora_weights`)."""
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
