"""The original Wan VAE key names (Wan-Video's `Wan2.1_VAE.pth` / `Wan2.2_VAE.pth`, ComfyUI's
`wan_2.1_vae.safetensors` / `wan2.2_vae.safetensors`) of every diffusers `AutoencoderKLWan` key.

Wan's modules, as its `wan/modules/vae.py` (2.1) and `wan/modules/vae2_2.py` (2.2) build them:
- top: `conv1` / `conv2` (diffusers' `quant_conv` / `post_quant_conv`);
- encoder / decoder: `conv1` (`conv_in`), `middle.0 / .1 / .2` (`mid_block.resnets.0`,
  `.attentions.0`, `.resnets.1`), `head.0` (`norm_out`), `head.2` (`conv_out`);
- Wan 2.1: `encoder.downsamples.K` / `decoder.upsamples.K` one flat `nn.Sequential` of residual
  blocks, attention blocks and resamplers (diffusers' encoder keeps the flat index K; its decoder
  groups them as `up_blocks.i.resnets.j` / `.upsamplers.0`); Wan 2.2: `encoder.downsamples.i.downsamples.j`
  / `decoder.upsamples.i.upsamples.j` (diffusers' `resnets.j`, the resampler last: `downsampler` /
  `upsampler`);
- inside a residual block `residual.0` (norm1), `residual.2` (conv1), `residual.3` (norm2),
  `residual.6` (conv2), `shortcut` (conv_shortcut); attention and resampler parameters keep their names.
The layers are walked from the same topology the model runs (`topology`), so the map holds for every
config (diffusers' `convert_wan_vae_to_diffusers` hard-codes the released 2.1 VAE's indices). No JAX.
"""

from __future__ import annotations

import re

from pipelines.wan.vae import topology
from pipelines.wan.vae.config import WanVAEConfig

_RESIDUAL = {"norm1.gamma": "residual.0.gamma", "conv1": "residual.2", "norm2.gamma": "residual.3.gamma",
             "conv2": "residual.6", "conv_shortcut": "shortcut"}
_ENDS = {"conv_in": "conv1", "mid_block.resnets.0": "middle.0", "mid_block.attentions.0": "middle.1",
         "mid_block.resnets.1": "middle.2", "norm_out": "head.0", "conv_out": "head.2"}


def _flat(layers) -> list:
  out = []
  for layer in layers:
    out += _flat(layer.body) if isinstance(layer, topology.ResidualGroup) else [layer]
  return out


def _layer_names(config: WanVAEConfig) -> dict[str, str]:
  """diffusers layer name -> Wan's, for every layer of `config`."""
  names = {"quant_conv": "conv1", "post_quant_conv": "conv2"}
  for side in ("encoder", "decoder"):
    layers = _flat(config.encoder_layers() if side == "encoder" else config.decoder_layers())
    stack = 0
    for layer in layers:
      inner = layer.name.removeprefix(f"{side}.")
      if inner in _ENDS:
        names[layer.name] = f"{side}.{_ENDS[inner]}"
        continue
      grouped = re.fullmatch(r"(?:down|up)_blocks\.(\d+)\.(?:resnets\.(\d+)|downsampler|upsampler)", inner)
      if config.is_residual and grouped:  # Wan 2.2: nested Sequentials, the resampler last
        group = "downsamples" if side == "encoder" else "upsamples"
        index = grouped[2] if grouped[2] is not None else config.num_res_blocks + (side == "decoder")
        names[layer.name] = f"{side}.{group}.{grouped[1]}.{group}.{index}"
      else:  # Wan 2.1: one flat Sequential
        names[layer.name] = f"{side}.{'downsamples' if side == 'encoder' else 'upsamples'}.{stack}"
        stack += 1
  return names


def original_keys(config: WanVAEConfig) -> dict[str, str]:
  """diffusers key -> Wan's key, for every parameter of `config` (`config.param_shapes()`)."""
  layers = _layer_names(config)
  out = {}
  for key in config.param_shapes():
    layer = max((name for name in layers if key.startswith(name + ".")), key=len)
    rest = key[len(layer) + 1:]
    for ours, theirs in _RESIDUAL.items():
      if rest == ours or rest.startswith(ours + "."):
        rest = theirs + rest[len(ours):]
        break
    out[key] = f"{layers[layer]}.{rest}"
  return out


_OUTER = {"conv1": "quant_conv", "conv2": "post_quant_conv", "encoder.conv1": "encoder.conv_in",
          "encoder.head.2": "encoder.conv_out", "decoder.head.2": "decoder.conv_out"}


def encoder_key(key: str) -> str | None:
  """A Wan key of the outer convs or the encoder's down path under diffusers' name, without a config
  (what `pretrained.inference.vae_config` reads to find the config that `original_keys` needs);
  None for the other keys."""
  module, _, leaf = key.rpartition(".")
  if module in _OUTER:
    return f"{_OUTER[module]}.{leaf}"
  nested = re.fullmatch(r"encoder\.downsamples\.(\d+)\.downsamples\.(\d+)\.(.+)", key)  # Wan 2.2
  flat = re.fullmatch(r"encoder\.downsamples\.(\d+)\.(.+)", key)  # Wan 2.1
  if nested:
    block, rest = f"encoder.down_blocks.{nested[1]}.resnets.{nested[2]}", nested[3]
    if not rest.startswith(("residual.", "shortcut.")):
      return f"encoder.down_blocks.{nested[1]}.downsampler.{rest}"
  elif flat:
    block, rest = f"encoder.down_blocks.{flat[1]}", flat[2]
  else:
    return None
  for ours, theirs in _RESIDUAL.items():
    if rest == theirs or rest.startswith(theirs + "."):
      return f"{block}.{ours}{rest[len(theirs):]}"
  return f"{block}.{rest}"
