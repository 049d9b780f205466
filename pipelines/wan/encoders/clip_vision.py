"""The CLIP vision encoder of Wan 2.1 I2V / FLF2V (transformers' `CLIPVisionModel` /
`CLIPVisionModelWithProjection`, the `image_encoder/` folder), in JAX: its penultimate hidden
states are the image states the transformer's image branch attends to (diffusers
`WanImageToVideoPipeline.encode_image`: `hidden_states[-2]`).

Glossary: B images, J = 1 + (image_size / patch)^2 image tokens (257 for Wan's ViT-H/14 at 224),
W the encoder width (`hidden_size`, 1280), E its MLP width. Runs in float32 on one device (632M
parameters for Wan's encoder; once per call, before the denoising loop).

Math: transformers models/clip/modeling_clip.py (`CLIPVisionEmbeddings`, `CLIPEncoderLayer`):
patch conv (no bias) + class token + learned positions, pre-LayerNorm, then pre-norm layers
(LayerNorm -> multi-head attention with q scaled by head_dim^-0.5 -> residual; LayerNorm -> fc1 ->
activation -> fc2 -> residual). The last layer, the post-LayerNorm and the projection do not feed
`hidden_states[-2]` and are not run.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.storage import weights

# Key prefixes of the vision tower: `CLIPVisionModel(WithProjection)` as saved by transformers 4
# ("vision_model.") and by transformers 5 for `CLIPVisionModel` (none).
_PREFIXES = ("vision_model.", "")
_ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
  """transformers `CLIPVisionConfig` fields the encoder uses (config.json of `image_encoder/`)."""
  hidden_size: int = 1280
  intermediate_size: int = 5120
  num_attention_heads: int = 16
  num_hidden_layers: int = 32
  image_size: int = 224
  patch_size: int = 14
  num_channels: int = 3
  hidden_act: str = "gelu"
  layer_norm_eps: float = 1e-5

  def __post_init__(self):
    if self.hidden_act not in _ACTIVATIONS:
      raise ValueError(f"{self.hidden_act=} is not supported; one of {sorted(_ACTIVATIONS)}")
    if self.hidden_size % self.num_attention_heads or self.image_size % self.patch_size:
      raise ValueError(f"{self.hidden_size=} must split into {self.num_attention_heads=} heads and "
                       f"{self.image_size=} into patches of {self.patch_size=}")
    if self.num_hidden_layers < 2:
      raise ValueError(f"{self.num_hidden_layers=}: the penultimate states need >= 2 layers")

  @classmethod
  def from_dict(cls, config: Mapping[str, Any]) -> CLIPVisionConfig:
    """Reads a `CLIPVisionConfig` dict (a full `CLIPConfig`'s `vision_config` too); ignores the rest."""
    config = config.get("vision_config", config)
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in config.items() if k in names})

  @property
  def tokens(self) -> int:
    """K: the class token and one per patch."""
    return 1 + (self.image_size // self.patch_size) ** 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CLIPVision:
  """The encoder's config (static) and float32 weights (layers stacked on a leading axis, the
  penultimate-state layers only)."""
  params: dict[str, Any]
  config: CLIPVisionConfig = dataclasses.field(metadata=dict(static=True))


def _layer_keys(config: CLIPVisionConfig) -> dict[str, tuple[int, ...]]:
  w, e = config.hidden_size, config.intermediate_size
  keys = {}
  for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
    keys[f"self_attn.{proj}.weight"], keys[f"self_attn.{proj}.bias"] = (w, w), (w,)
  for norm in ("layer_norm1", "layer_norm2"):
    keys[f"{norm}.weight"], keys[f"{norm}.bias"] = (w,), (w,)
  keys["mlp.fc1.weight"], keys["mlp.fc1.bias"] = (e, w), (e,)
  keys["mlp.fc2.weight"], keys["mlp.fc2.bias"] = (w, e), (w,)
  return keys


def load_clip_vision(folder: str) -> CLIPVision:
  """Loads `image_encoder/` (config.json + safetensors of a transformers CLIP vision model).

  Raises:
    weights.CheckpointError: no config / weights, or a weight missing or mis-shaped (naming it).
    ValueError: an unsupported config (activation, sizes).
  """
  config = CLIPVisionConfig.from_dict(weights.read_config(folder))
  state = weights.read_safetensors_folder(folder)
  prefix = next((p for p in _PREFIXES if f"{p}embeddings.class_embedding" in state), _PREFIXES[0])
  w, p, c = config.hidden_size, config.patch_size, config.num_channels
  top = {"embeddings.class_embedding": (w,), "embeddings.patch_embedding.weight": (w, c, p, p),
         "embeddings.position_embedding.weight": (config.tokens, w), "pre_layrnorm.weight": (w,),
         "pre_layrnorm.bias": (w,)}
  layers = range(config.num_hidden_layers - 1)
  expected = {prefix + k: s for k, s in top.items()}
  expected.update({f"{prefix}encoder.layers.{i}.{k}": s for i in layers for k, s in _layer_keys(config).items()})
  bad = [f"{k}: {'missing' if k not in state else tuple(state[k].shape)}, want {s}"
         for k, s in expected.items() if k not in state or tuple(state[k].shape) != s]
  if bad:
    raise weights.CheckpointError(f"{folder!r} does not fit {config}:\n  " + "\n  ".join(bad))
  f32 = lambda key: np.asarray(state[prefix + key], np.float32)  # noqa: E731
  params = {k: jnp.asarray(f32(k)) for k in top}
  for k in _layer_keys(config):
    stacked = np.stack([f32(f"encoder.layers.{i}.{k}") for i in layers])
    params[f"layers.{k}"] = jnp.asarray(stacked.swapaxes(-1, -2) if stacked.ndim == 3 else stacked)  # [in, out]
  return CLIPVision(params=params, config=config)


def _layer_norm(x, weight, bias, eps):
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * weight + bias


def _layer(config: CLIPVisionConfig, x_BJW: jax.Array, p: Mapping[str, jax.Array]) -> jax.Array:
  """One `CLIPEncoderLayer` (weights as [in, out])."""
  b, j, w = x_BJW.shape
  heads, eps = config.num_attention_heads, config.layer_norm_eps
  dense = lambda x, name: x @ p[f"{name}.weight"] + p[f"{name}.bias"]  # noqa: E731
  h = _layer_norm(x_BJW, p["layer_norm1.weight"], p["layer_norm1.bias"], eps)
  q, k, v = (dense(h, f"self_attn.{n}").reshape(b, j, heads, w // heads) for n in ("q_proj", "k_proj", "v_proj"))
  logits = jnp.einsum("bqnh,bknh->bnqk", q * (w // heads) ** -0.5, k)
  o = jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(logits, axis=-1), v).reshape(b, j, w)
  x_BJW = x_BJW + dense(o, "self_attn.out_proj")
  h = _layer_norm(x_BJW, p["layer_norm2.weight"], p["layer_norm2.bias"], eps)
  return x_BJW + dense(_ACTIVATIONS[config.hidden_act](dense(h, "mlp.fc1")), "mlp.fc2")


@jax.jit
def penultimate_states(model: CLIPVision, pixel_values: jax.Array) -> jax.Array:
  """transformers `CLIPVisionModel(pixel_values, output_hidden_states=True).hidden_states[-2]`.

  Args:
    pixel_values: float32 [B, 3, image_size, image_size] as `CLIPImageProcessor` returns them
      (resized, centre-cropped, normalised).

  Returns:
    float32 [B, J, W]: the output of the second-to-last encoder layer.
  """
  config, p = model.config, model.params
  x = pixel_values.astype(jnp.float32)
  patches = jax.lax.conv_general_dilated(x, p["embeddings.patch_embedding.weight"],
                                         (config.patch_size,) * 2, "VALID",
                                         dimension_numbers=("NCHW", "OIHW", "NHWC"),
                                         precision=jax.lax.Precision.HIGHEST)
  b = x.shape[0]
  patches = patches.reshape(b, -1, config.hidden_size)
  cls = jnp.broadcast_to(p["embeddings.class_embedding"], (b, 1, config.hidden_size))
  h = jnp.concatenate([cls, patches], axis=1) + p["embeddings.position_embedding.weight"][None]
  h = _layer_norm(h, p["pre_layrnorm.weight"], p["pre_layrnorm.bias"], config.layer_norm_eps)
  layers = {k[len("layers."):]: v for k, v in p.items() if k.startswith("layers.")}
  h, _ = jax.lax.scan(lambda h, lp: (_layer(config, h, lp), None), h, layers)
  return h


def has_image_encoder(folder: str) -> bool:
  """Whether a pipeline folder holds `image_encoder/` with a config (Wan 2.1 I2V / FLF2V)."""
  return os.path.isfile(os.path.join(folder, "image_encoder", "config.json"))
