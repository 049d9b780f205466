"""Configuration of the Wan video transformer (diffusers' `WanTransformer3DModel` config.json).

Field names and meanings follow diffusers so that `WanTransformerConfig.from_dict(config_json)`
reads a diffusers `transformer/config.json` unchanged: the text-to-video and image-to-video
variants (Wan 2.1 T2V 1.3B / 14B, Wan 2.1 I2V 14B and FLF2V 14B with their CLIP image branch, Wan 2.2
T2V / I2V A14B experts) and Wan 2.2 TI2V-5B (whose first-frame conditioning needs no transformer
field; `wan.conditioning.ti2v`).

Also the parameter tree a config implies (`param_shapes`, `param_counts`) and which parameters
stay fp32 (`keeps_fp32`): pure functions of the config, no JAX.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

# diffusers `WanTransformer3DModel._keep_in_fp32_modules` that own parameters ("rope", "norm1",
# "norm3" own none in the blocks; "norm1" / "norm2" also name the image embedder's LayerNorms); a
# parameter whose path holds one of these names is kept fp32.
KEEP_IN_FP32 = ("time_embedder", "scale_shift_table", "norm1", "norm2")


def keeps_fp32(path: tuple[str, ...]) -> bool:
  """Whether the parameter at `path` (our module path) stays fp32 whatever the model dtype."""
  return any(name in path for name in KEEP_IN_FP32)


# diffusers config.json keys that carry no model information.
_IGNORED_KEYS = ("_class_name", "_diffusers_version", "_name_or_path")


@dataclasses.dataclass(frozen=True)
class WanTransformerConfig:
  """Shape and numerics of a Wan transformer; defaults are Wan 2.1 T2V 1.3B.

  Attributes:
    patch_size: (pt, ph, pw) Conv3d patch = stride over (F, Hl, Wl).
    num_attention_heads: N.
    attention_head_dim: H (even; RoPE splits it into t/h/w parts as diffusers does).
    in_channels: C of the input latents.
    out_channels: C of the predicted noise.
    text_dim: width of the text encoder states (4096 for UMT5-XXL).
    freq_dim: width of the sinusoidal timestep embedding.
    ffn_dim: hidden width of the feed-forward network.
    num_layers: number of transformer blocks.
    cross_attn_norm: affine LayerNorm before cross-attention (True for every released Wan).
    qk_norm: only "rms_norm_across_heads" (RMSNorm over the full D for q and k).
    eps: epsilon of every LayerNorm / RMSNorm.
    rope_max_seq_len: largest position per grid axis that diffusers' RoPE table covers.
    image_dim: width of the CLIP image states (1280 for Wan 2.1 I2V / FLF2V), None without the
      image branch (T2V, Wan 2.2 I2V A14B).
    added_kv_proj_dim: input width of the cross-attention's image keys / values (`add_k_proj`,
      `add_v_proj`); D for Wan 2.1 I2V / FLF2V. None with `image_dim` set (diffusers' own
      image-to-video test model): the embedded image tokens join the text context and go through
      `to_k` / `to_v` with it (`image_in_context`).
    pos_embed_seq_len: image tokens of the image embedder's learned positions (FLF2V: 2 x 257 for
      the first and last frame), None otherwise.
    vace_layers: the blocks after which a VACE hint is added (diffusers' `WanVACETransformer3DModel`:
      one VACE block per entry, the first at block 0), None for a transformer without VACE.
    vace_in_channels: channels of the VACE context (`vace_patch_embedding`'s input): the inactive
      and reactive video latents and the spatial mask, 2 C + (VAE spatial factor)^2 (96 for Wan 2.1).
  """

  patch_size: tuple[int, int, int] = (1, 2, 2)
  num_attention_heads: int = 12
  attention_head_dim: int = 128
  in_channels: int = 16
  out_channels: int = 16
  text_dim: int = 4096
  freq_dim: int = 256
  ffn_dim: int = 8960
  num_layers: int = 30
  cross_attn_norm: bool = True
  qk_norm: str = "rms_norm_across_heads"
  eps: float = 1e-6
  rope_max_seq_len: int = 1024
  image_dim: int | None = None
  added_kv_proj_dim: int | None = None
  pos_embed_seq_len: int | None = None
  vace_layers: tuple[int, ...] | None = None
  vace_in_channels: int = 96

  def __post_init__(self):
    object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
    if len(self.patch_size) != 3 or min(self.patch_size) < 1:
      raise ValueError(f"{self.patch_size=} must be three positive ints (pt, ph, pw)")
    for name in ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels",
                 "text_dim", "freq_dim", "ffn_dim", "num_layers", "rope_max_seq_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    if self.attention_head_dim % 2:
      raise ValueError(f"{self.attention_head_dim=} must be even (RoPE rotates pairs of channels)")
    if self.freq_dim % 2:
      raise ValueError(f"{self.freq_dim=} must be even (half sine, half cosine)")
    if self.qk_norm != "rms_norm_across_heads":
      raise ValueError(
          f"{self.qk_norm=} is not supported; every released Wan uses 'rms_norm_across_heads' "
          "(diffusers applies that RMSNorm whatever this field says)")
    if not self.eps > 0:
      raise ValueError(f"{self.eps=} must be > 0")
    self._check_image_fields()
    self._check_vace_fields()

  def _check_vace_fields(self) -> None:
    if self.vace_layers is None:
      return
    layers = self.vace_layers
    if not isinstance(layers, (list, tuple)) or not layers or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in layers):
      raise ValueError(f"vace_layers={layers!r} must be a non-empty list of block indices (or None: no VACE)")
    object.__setattr__(self, "vace_layers", tuple(layers))
    if list(self.vace_layers) != sorted(set(self.vace_layers)) or self.vace_layers[0] != 0 or (
        self.vace_layers[-1] >= self.num_layers):
      raise ValueError(f"vace_layers={list(layers)} must be increasing block indices from 0 to at most "
                       f"num_layers - 1 = {self.num_layers - 1} (diffusers: the first VACE block feeds block 0)")
    if not isinstance(self.vace_in_channels, int) or self.vace_in_channels < 1:
      raise ValueError(f"vace_in_channels={self.vace_in_channels!r} must be a positive int")
    if self.image_dim is not None:
      raise ValueError("a VACE transformer with an image branch (image_dim) is not supported: no released VACE "
                       "model has one and diffusers' WanVACEPipeline passes no image states")

  @property
  def has_vace(self) -> bool:
    """The transformer has VACE blocks (`vace_layers`): it takes a VACE context every forward."""
    return self.vace_layers is not None

  def _check_image_fields(self) -> None:
    for name in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}={value!r} must be None or a positive int")
    if self.added_kv_proj_dim is not None and self.image_dim is None:
      raise ValueError(f"{self.added_kv_proj_dim=} needs image_dim (the image embedder feeds the "
                       "cross-attention's image keys / values)")
    if self.added_kv_proj_dim not in (None, self.dim):
      raise ValueError(f"{self.added_kv_proj_dim=} must equal D={self.dim} (it projects the image embedder's "
                       "D-wide output)")
    if self.pos_embed_seq_len is not None and self.image_dim is None:
      raise ValueError(f"{self.pos_embed_seq_len=} needs image_dim (the image embedder's positions)")

  @property
  def has_image_branch(self) -> bool:
    """The transformer takes CLIP image states (`encoder_hidden_states_image`): Wan 2.1 I2V / FLF2V."""
    return self.image_dim is not None

  @property
  def image_in_context(self) -> bool:
    """The embedded image tokens join the text context ([image; text], one set of K/V by `to_k` /
    `to_v`) instead of their own `add_k_proj` / `add_v_proj` keys: `image_dim` without
    `added_kv_proj_dim`, as diffusers' `WanTransformer3DModel` runs it."""
    return self.image_dim is not None and self.added_kv_proj_dim is None

  @property
  def dim(self) -> int:
    """D = N * H, the model width."""
    return self.num_attention_heads * self.attention_head_dim

  @property
  def patch_volume(self) -> int:
    """pt * ph * pw."""
    return math.prod(self.patch_size)

  @classmethod
  def from_dict(cls, config: Mapping[str, Any]) -> WanTransformerConfig:
    """Reads a diffusers `WanTransformer3DModel` config.json dict.

    Raises:
      ValueError: a key is unknown or a value invalid.
    """
    config = dict(config)
    for key in _IGNORED_KEYS:
      config.pop(key, None)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(config) - fields)
    if unknown:
      raise ValueError(f"unknown Wan transformer config keys {unknown}; known: {sorted(fields)}")
    if config.get("out_channels") is None and "in_channels" in config:
      config["out_channels"] = config["in_channels"]  # diffusers: out_channels or in_channels
    if "patch_size" in config:
      config["patch_size"] = tuple(config["patch_size"])
    if config.get("vace_layers") is not None:
      config["vace_layers"] = tuple(config["vace_layers"])
    return cls(**config)

  def to_dict(self) -> dict[str, Any]:
    """The diffusers config.json fields (round-trips through `from_dict`)."""
    out = dataclasses.asdict(self)
    out["patch_size"] = list(self.patch_size)
    if self.vace_layers is None:  # a plain WanTransformer3DModel config: no VACE keys
      del out["vace_layers"], out["vace_in_channels"]
    else:
      out["vace_layers"] = list(self.vace_layers)
    return out


PRESETS: dict[str, WanTransformerConfig] = {
    "wan2.1-t2v-1.3b": WanTransformerConfig(),
    "wan2.1-t2v-14b": WanTransformerConfig(num_attention_heads=40, ffn_dim=13824, num_layers=40),
    # Wan 2.2 T2V A14B: two experts with exactly the 14B architecture.
    "wan2.2-t2v-a14b": WanTransformerConfig(num_attention_heads=40, ffn_dim=13824, num_layers=40),
    # Image-to-video (Wan-AI/*-Diffusers transformer/config.json): noise + 4 mask + 16 condition channels.
    "wan2.1-i2v-14b": WanTransformerConfig(num_attention_heads=40, ffn_dim=13824, num_layers=40, in_channels=36,
                                           image_dim=1280, added_kv_proj_dim=5120),
    "wan2.1-flf2v-14b": WanTransformerConfig(num_attention_heads=40, ffn_dim=13824, num_layers=40, in_channels=36,
                                             image_dim=1280, added_kv_proj_dim=5120, pos_embed_seq_len=514),
    "wan2.2-i2v-a14b": WanTransformerConfig(num_attention_heads=40, ffn_dim=13824, num_layers=40, in_channels=36),
    # Wan 2.2 TI2V-5B (Wan2.2 wan/configs/wan_ti2v_5B.py: dim 3072, 24 heads, ffn 14336, 30 layers;
    # 48 latent channels of the Wan 2.2 VAE). One expert, per-token timesteps (`wan.conditioning.ti2v`).
    "wan2.2-ti2v-5b": WanTransformerConfig(num_attention_heads=24, in_channels=48, out_channels=48,
                                           ffn_dim=14336, num_layers=30),
    # VACE (diffusers' WanVACETransformer3DModel; Wan-AI/Wan2.1-VACE-*-diffusers transformer/config.json):
    # the T2V model plus one VACE block every 2 (1.3B) or 5 (14B) blocks over a 96-channel context.
    "wan2.1-vace-1.3b": WanTransformerConfig(vace_layers=tuple(range(0, 30, 2))),
    "wan2.1-vace-14b": WanTransformerConfig(num_attention_heads=40, ffn_dim=13824, num_layers=40,
                                            vace_layers=tuple(range(0, 40, 5))),
    # Wan 2.2 VACE-Fun A14B (alibaba-pai; diffusers #12324): each expert is the 14B with the 14B's VACE
    # layout.
    "wan2.2-vace-fun-a14b": WanTransformerConfig(num_attention_heads=40, ffn_dim=13824, num_layers=40,
                                                 vace_layers=tuple(range(0, 40, 5))),
    # Embedded default for tests and smoke runs: every code path, seconds to compile on CPU.
    "tiny": WanTransformerConfig(num_attention_heads=2, attention_head_dim=16, text_dim=32,
                                 ffn_dim=64, num_layers=2),
}


def param_shapes(config: WanTransformerConfig) -> dict[str, Any]:
  """Our parameter tree (nested dicts of shape tuples), `WanTransformer`'s layout."""
  d, z, e = config.dim, config.num_layers, config.ffn_dim
  pt, ph, pw = config.patch_size

  def dense(i, o, layers=()):
    return {"kernel": (*layers, i, o), "bias": (*layers, o)}

  def block(layers: int) -> dict[str, Any]:
    attn = {**{n: dense(d, d, (layers,)) for n in ("to_q", "to_k", "to_v", "to_out")},
            "norm_q": (layers, d), "norm_k": (layers, d)}
    out = {"attn1": attn, "attn2": dict(attn),
           "ffn": {"proj_in": dense(d, e, (layers,)), "proj_out": dense(e, d, (layers,))},
           "scale_shift_table": (layers, 6, d)}
    if config.cross_attn_norm:
      out["norm2"] = {"weight": (layers, d), "bias": (layers, d)}
    return out

  blocks = block(z)
  embedder = {
      "time_embedder": {"linear_1": dense(config.freq_dim, d), "linear_2": dense(d, d)},
      "time_proj": dense(d, 6 * d),
      "text_embedder": {"linear_1": dense(config.text_dim, d), "linear_2": dense(d, d)},
  }
  top = {}
  if config.has_vace:  # one VACE block per vace layer (diffusers' `WanVACETransformerBlock`)
    v = len(config.vace_layers)
    top = {"vace_patch_embedding": {"kernel": (pt, ph, pw, config.vace_in_channels, d), "bias": (d,)},
           "vace_proj_in": dense(d, d), "vace_blocks": {**block(v), "proj_out": dense(d, d, (v,))}}
  if config.has_image_branch:
    i = config.image_dim
    embedder["image_embedder"] = {"norm1": {"weight": (i,), "bias": (i,)}, "proj_in": dense(i, i),
                                  "proj_out": dense(i, d), "norm2": {"weight": (d,), "bias": (d,)}}
    if config.pos_embed_seq_len is not None:
      embedder["image_embedder"]["pos_embed"] = (config.pos_embed_seq_len, i)
    if not config.image_in_context:
      blocks["attn2"].update(add_k_proj=dense(d, d, (z,)), add_v_proj=dense(d, d, (z,)), norm_added_k=(z, d))
  return {
      "patch_embedding": {"kernel": (pt, ph, pw, config.in_channels, d), "bias": (d,)},
      "condition_embedder": embedder,
      "blocks": blocks,
      "scale_shift_table": (2, d),
      "proj_out": dense(d, config.out_channels * config.patch_volume),
      **top,
  }


def param_counts(config: WanTransformerConfig) -> tuple[int, int]:
  """(block parameters, other parameters) of a transformer of `config` (`param_shapes`): what the
  mesh planner (`pipelines.parallel.planner.candidates`) sizes the weights from."""
  shapes = param_shapes(config)

  def count(tree) -> int:
    if isinstance(tree, Mapping):
      return sum(count(v) for v in tree.values())
    return math.prod(tree)

  blocks = count(shapes["blocks"]) + count(shapes.get("vace_blocks", {}))
  return blocks, count(shapes) - blocks
