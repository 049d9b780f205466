"""The original Wan key names (Wan-Video/Wan2.1, ComfyUI, lightx2v) of the transformer, next to
diffusers' (`WanTransformer3DModel`, what `loading.checkpoint_layout` reads).

One owner for the map: LoRA files (`wan.lora.convert`), single files and the official folder layout
(`wan.pretrained`) all read original names through it. The tensors themselves have the same
layout in both namings (the Wan modules and diffusers' are the same torch modules, renamed);
`blocks.N.modulation` is diffusers' `blocks.N.scale_shift_table` ([1, 6, D] in both).

Module names as diffusers' `convert_wan_transformer_to_diffusers` (diffusers/loaders/
single_file_utils.py) and `_convert_non_diffusers_wan_lora_to_diffusers` map them. No JAX.
"""

from __future__ import annotations

import re

# original Wan module (inside blocks.N.) -> diffusers module
BLOCK_MODULES = {
    **{f"self_attn.{o}": f"attn1.{c}" for o, c in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"),
                                                    ("o", "to_out.0"), ("norm_q", "norm_q"), ("norm_k", "norm_k"))},
    **{f"cross_attn.{o}": f"attn2.{c}" for o, c in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"),
                                                     ("o", "to_out.0"), ("norm_q", "norm_q"), ("norm_k", "norm_k"),
                                                     ("k_img", "add_k_proj"), ("v_img", "add_v_proj"),
                                                     ("norm_k_img", "norm_added_k"))},
    "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2",
    # Wan's norm3 is the (affine) cross-attention norm, diffusers' norm2; Wan's norm1 / norm2 have no
    # parameters (diffusers' norm1 / norm3).
    "norm1": "norm1", "norm3": "norm2", "norm2": "norm3",
    "modulation": "scale_shift_table",
}
# VACE blocks (Wan's `vace_blocks.N.`, diffusers' `vace_blocks.N.`) hold a block's modules plus these
# (diffusers' scripts/convert_wan_to_diffusers.py: before_proj -> proj_in, after_proj -> proj_out).
VACE_MODULES = {**BLOCK_MODULES, "before_proj": "proj_in", "after_proj": "proj_out"}
TOP_MODULES = {
    "head.head": "proj_out", "head.modulation": "scale_shift_table", "head.norm": "norm_out",
    "patch_embedding": "patch_embedding", "vace_patch_embedding": "vace_patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "img_emb.proj.0": "condition_embedder.image_embedder.norm1",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
    "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
    "img_emb.emb_pos": "condition_embedder.image_embedder.pos_embed",  # FLF2V's image positions
}
# Parameters that are not a module's `.weight` / `.bias` (the key is the name itself).
PARAMETERS = ("modulation", "emb_pos")
_STACKED = re.compile(r"(blocks|vace_blocks)\.(\d+)\.(.+)")


def wan_module(name: str) -> str | None:
  """An original Wan module name (`blocks.3.self_attn.q`, `head.head`, `vace_blocks.0.before_proj`)
  as diffusers' (`blocks.3.attn1.to_q`, `proj_out`, `vace_blocks.0.proj_in`); None for a name
  diffusers' Wan has no module for."""
  match = _STACKED.fullmatch(name)
  if match:
    inner = (VACE_MODULES if match[1] == "vace_blocks" else BLOCK_MODULES).get(match[3])
    return None if inner is None else f"{match[1]}.{match[2]}.{inner}"
  return TOP_MODULES.get(name)


def diffusers_key(key: str) -> str | None:
  """An original Wan parameter key (`blocks.0.self_attn.q.weight`, `blocks.0.modulation`) as
  diffusers' (`blocks.0.attn1.to_q.weight`, `blocks.0.scale_shift_table`); None for no such key."""
  if key.endswith(PARAMETERS):
    return wan_module(key)
  module, dot, leaf = key.rpartition(".")
  target = wan_module(module) if dot and leaf in ("weight", "bias") else None
  return None if target is None else f"{target}.{leaf}"


def _inverse(table: dict[str, str]) -> dict[str, str]:
  return {d: o for o, d in table.items()}


def wan_key(key: str) -> str | None:
  """The inverse of `diffusers_key`: a diffusers parameter key in the original Wan naming."""
  match = _STACKED.fullmatch(key)
  table, prefix, rest = ((_inverse(VACE_MODULES if match[1] == "vace_blocks" else BLOCK_MODULES),
                          f"{match[1]}.{match[2]}.", match[3]) if match else (_inverse(TOP_MODULES), "", key))
  if rest in table:  # a parameter (scale_shift_table, pos_embed)
    return prefix + table[rest]
  module, _, leaf = rest.rpartition(".")
  return prefix + table[module] + "." + leaf if module in table else None
