"""LoRA key layouts -> one normalized layout in diffusers' module names.

Layouts read (each as diffusers' `WanLoraLoaderMixin.lora_state_dict` tells them apart: any
`diffusion_model.` key -> original Wan / ComfyUI; any `lora_unet_` key -> kohya / musubi-tuner;
otherwise diffusers / peft):

- diffusers / peft: `transformer.blocks.0.attn1.to_q.lora_A.weight`, `.lora_B.weight`,
  `.lora_B.bias` (kept as they are; the alphas are in the file's adapter metadata).
- original Wan / ComfyUI / lightx2v: `diffusion_model.blocks.0.self_attn.q.lora_down.weight`
  (or `lora_A`), `.lora_up.weight` (or `lora_B`), `.alpha`; full deltas `X.diff` (a weight, or
  a parameter such as `blocks.0.modulation`), `X.diff_b` (a bias), `blocks.N.diff_m` (the block's
  modulation, diffusers' `blocks.N.scale_shift_table`).
- kohya / musubi-tuner: `lora_unet_blocks_0_self_attn_q.lora_down.weight`, `.lora_up.weight`,
  `.alpha` (the Wan module name with `.` written `_`).
VACE models' `vace_blocks.N.` hold a block's modules plus Wan's `before_proj` / `after_proj`
(diffusers' `proj_in` / `proj_out`); diffusers converts none of these for the Wan and kohya layouts,
we do.

The normalized layout (`transformer.` + diffusers names):
  `{module}.lora_A.weight` [r, I], `{module}.lora_B.weight` [O, r], `{module}.lora_B.bias` [O],
  `{module}.alpha` (scalar; scaling alpha / r), and `{parameter}.diff` (a full delta in diffusers'
  (torch) layout of the parameter `{parameter}`, e.g. `blocks.0.attn1.to_q.weight.diff`,
  `blocks.0.scale_shift_table.diff` [1, 6, D]).

Module names as diffusers' `_convert_non_diffusers_wan_lora_to_diffusers` and
`_convert_musubi_wan_lora_to_diffusers` (diffusers/loaders/lora_conversion_utils.py) map them.
Unlike diffusers, which drops every `.diff` full delta except `head.head.diff` (norm deltas,
block-linear deltas, `diff_m`: "not handled yet"), every full delta is kept and later added to its
parameter, as ComfyUI does (`comfy/lora.py`: `diff` / `diff_b` patches add to the weight / bias);
and `alpha` is honoured on every module (diffusers reads it only inside the blocks).
Arrays are numpy float32 on the host.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from pipelines.wan.transformer.original_names import wan_module

TRANSFORMER_PREFIX = "transformer."
WAN_PREFIX = "diffusion_model."
MUSUBI_PREFIX = "lora_unet_"
# Keys of text-encoder LoRAs (diffusers, ComfyUI, kohya): refused, the UMT5 encoder is not adapted.
TEXT_ENCODER_PREFIXES = ("text_encoder.", "text_encoder_2.", "text_encoders.", "lora_te_", "lora_te1_",
                         "lora_te2_")

_PARAMETERS = ("scale_shift_table",)  # diffusers parameters that are not a module's .weight
_WAN_KEY = re.compile(r"(?P<module>.+)\.(?P<part>lora_down\.weight|lora_A\.weight|lora_up\.weight|"
                      r"lora_B\.weight|alpha|diff|diff_b)$")
_PARTS = {"lora_down.weight": "lora_A.weight", "lora_A.weight": "lora_A.weight",
          "lora_up.weight": "lora_B.weight", "lora_B.weight": "lora_B.weight", "alpha": "alpha"}
# Wan name pieces holding "_" (longest first), for reading kohya / musubi names back.
_UNDERSCORED = ("vace_patch_embedding", "time_projection", "text_embedding", "time_embedding", "patch_embedding", "norm_k_img",
                "vace_blocks", "before_proj", "after_proj", "self_attn", "cross_attn", "img_emb", "norm_q", "norm_k", "k_img", "v_img")


def layout(state: Mapping[str, np.ndarray]) -> str:
  """"wan", "musubi" or "diffusers": the key layout, decided as diffusers decides it."""
  if any(k.startswith(WAN_PREFIX) for k in state):
    return "wan"
  if any(k.startswith(MUSUBI_PREFIX) for k in state):
    return "musubi"
  return "diffusers"


def musubi_to_wan(name: str) -> str:
  """A kohya / musubi-tuner module name (`blocks_0_self_attn_q`) as the original Wan name
  (`blocks.0.self_attn.q`): every `_` is a `.` except inside Wan's own underscored pieces."""
  for i, piece in enumerate(_UNDERSCORED):
    name = re.sub(rf"(?<![A-Za-z]){piece}(?![A-Za-z])", f"\0{i}\0", name)
  name = name.replace("_", ".")
  return re.sub(r"\0(\d+)\0", lambda m: _UNDERSCORED[int(m[1])], name)


def _target(module: str, part: str) -> str:
  """The diffusers parameter a full delta `part` ("diff" or "diff_b") of `module` goes to."""
  if part == "diff_b":
    return f"{module}.bias"
  return module if module.endswith(_PARAMETERS) else f"{module}.weight"


def normalize(state: Mapping[str, np.ndarray]
              ) -> tuple[dict[str, np.ndarray], list[str], dict[str, str]]:
  """Any layout's keys in the normalized layout (module docstring).

  Args:
    state: key -> float32 array, in one of the layouts above.

  Returns:
    (the normalized state; the keys left over: names with no diffusers module, unknown parts
    (LoHa, LoKr, DoRA's `dora_scale`, ...), which the caller refuses, naming them; normalized key
    -> the file's key, for messages). diffusers / peft keys pass unchanged (the caller checks them).
  """
  kind = layout(state)
  if kind == "diffusers":
    return dict(state), [], {}
  out: dict[str, np.ndarray] = {}
  left: list[str] = []
  origin: dict[str, str] = {}
  for key, value in state.items():
    if kind == "wan":
      name = key.removeprefix(WAN_PREFIX)
    else:
      module, dot, rest = key.removeprefix(MUSUBI_PREFIX).partition(".")
      name = musubi_to_wan(module) + dot + rest
    if not key.startswith((WAN_PREFIX, MUSUBI_PREFIX)):
      left.append(key)
      continue
    ours = _normalized_key(name)
    if ours is None:
      left.append(key)
    else:
      out[TRANSFORMER_PREFIX + ours], origin[TRANSFORMER_PREFIX + ours] = value, key
  return out, sorted(left), origin


def _normalized_key(name: str) -> str | None:
  """An original Wan key without its prefix (`blocks.0.self_attn.q.lora_down.weight`) in the
  normalized layout without `transformer.`, or None when diffusers' Wan has no such module."""
  modulation = re.fullmatch(r"((?:vace_)?blocks\.\d+)\.diff_m", name)
  if modulation:
    return f"{modulation[1]}.scale_shift_table.diff"
  match = _WAN_KEY.fullmatch(name)
  module = wan_module(match["module"]) if match else None
  if module is None:
    return None
  if match["part"] in ("diff", "diff_b"):
    return f"{_target(module, match['part'])}.diff"
  return f"{module}.{_PARTS[match['part']]}"


def text_encoder_keys(state: Mapping[str, np.ndarray]) -> list[str]:
  """The keys of a text-encoder LoRA (diffusers `text_encoder.`, ComfyUI `text_encoders.`, kohya
  `lora_te_`), sorted."""
  return sorted(k for k in state if k.startswith(TEXT_ENCODER_PREFIXES))
