"""UMT5 text encoder (the Wan prompt encoder) as pure JAX functions over a params pytree.

Numerical reference: transformers `UMT5EncoderModel` (models/umt5/modeling_umt5.py). What makes it
UMT5 rather than T5:
- every layer has its own relative position bias (T5 shares layer 0's), bidirectional buckets:
  half the buckets for keys to the right, within each half `max_exact` exact distances and
  log-spaced buckets up to `relative_attention_max_distance` (Mesh TensorFlow
  `_relative_position_bucket`);
- no 1/sqrt(H) logit scaling (folded into the q init);
- pre-norm T5 RMSNorm (no mean, no bias; variance in fp32), gated-GELU(tanh) FFN, final RMSNorm.

Shape letters (see DESIGN.md section 1): B batch, L text tokens (queries), S text tokens (keys; S == L),
D model width (`d_model`), N heads, H head dim (`d_kv`; N * H need not equal D). Extra letters here:
V vocabulary, G FFN width (`d_ff`), Q relative-position buckets, Y layers.

UMT5Params pytree (layers stacked on a leading Y axis so `encode_text` is one `lax.scan`):
  embedding [V, D]; final_norm [D];
  layers: attn_norm [Y, D], q/k/v [Y, D, N, H], o [Y, N, H, D], rel_bias [Y, Q, N],
          ffn_norm [Y, D], wi_0/wi_1 [Y, D, G], wo [Y, G, D].
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.storage import weights
from pipelines.parallel import distributed

UMT5Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class UMT5Config:
  """Encoder hyper-parameters, named as in a transformers UMT5 `config.json`."""
  vocab_size: int = 384
  d_model: int = 32
  d_kv: int = 8
  d_ff: int = 64
  num_layers: int = 2
  num_heads: int = 4
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  layer_norm_epsilon: float = 1e-6
  feed_forward_proj: str = "gated-gelu"

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads"):
      if getattr(self, name) <= 0:
        raise ValueError(f"UMT5Config.{name} must be positive, got {getattr(self, name)=}")
    nb = self.relative_attention_num_buckets
    if nb < 4 or nb % 2:
      raise ValueError(f"relative_attention_num_buckets must be even and >= 4 (bidirectional: half per "
                       f"direction, half of those exact), got {nb=}")
    max_exact = nb // 4
    if self.relative_attention_max_distance <= max_exact:
      raise ValueError(f"{self.relative_attention_max_distance=} must exceed the exact range {max_exact=} "
                       "(num_buckets // 4) or the log buckets are empty")
    if self.feed_forward_proj != "gated-gelu":
      raise ValueError(f"{self.feed_forward_proj=} is not supported; UMT5 (Wan) uses 'gated-gelu' "
                       "(transformers maps it to tanh-approximate gelu_new)")

  @classmethod
  def from_dict(cls, config: Mapping[str, Any]) -> "UMT5Config":
    """Reads a transformers UMT5 `config.json` dict (unknown keys are ignored).

    Raises:
      ValueError: a decoder config (`is_decoder`), a model type other than umt5/t5, or values that
        fail `__post_init__`.
    """
    model_type = config.get("model_type", "umt5")
    if model_type not in ("umt5", "t5"):
      raise ValueError(f"expected a UMT5 config, got {model_type=}")
    if config.get("is_decoder", False):
      raise ValueError("config has is_decoder=True; the text encoder needs the encoder stack config")
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in config.items() if k in fields})


# Wan 2.1 / 2.2 text encoder (google/umt5-xxl encoder). The tiny preset goes with `default_tokenizer()`
# (ByT5: 256 bytes + 3 specials + 125 sentinels = 384 ids).
UMT5_PRESETS: dict[str, UMT5Config] = {
    "tiny": UMT5Config(),
    "umt5-xxl": UMT5Config(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                           num_heads=64),
}


def relative_position_buckets(length_q: int, length_k: int, num_buckets: int,
                              max_distance: int) -> np.ndarray:
  """Bidirectional T5 relative-position buckets, computed on host.

  Mirrors transformers `UMT5Attention._relative_position_bucket` (encoder branch) including its
  float32 log and truncation, so bucket edges agree with the reference bit for bit.

  Returns:
    int32 [L, S]: bucket of (key position - query position).
  """
  rel = np.arange(length_k, dtype=np.int64)[None, :] - np.arange(length_q, dtype=np.int64)[:, None]
  half = num_buckets // 2
  buckets = (rel > 0).astype(np.int64) * half
  rel = np.abs(rel)
  max_exact = half // 2
  is_small = rel < max_exact
  with np.errstate(divide="ignore"):  # log(0) for rel == 0 lands in the is_small branch
    ratio = np.log((rel.astype(np.float32) / np.float32(max_exact)).astype(np.float32))
  ratio = (ratio / np.float32(math.log(max_distance / max_exact))).astype(np.float32)
  ratio = (ratio * np.float32(half - max_exact)).astype(np.float32)
  large = max_exact + np.where(is_small, 0, ratio).astype(np.int64)
  large = np.minimum(large, half - 1)
  return (buckets + np.where(is_small, rel, large)).astype(np.int32)


def rms_norm(x_BLD: jax.Array, weight_D: jax.Array, eps: float) -> jax.Array:
  """T5 RMSNorm: variance in fp32, no mean subtraction, no bias (transformers `UMT5LayerNorm`).

  The normalised value is cast to the weight dtype when the weight is half precision, so the output
  dtype is the weight's (bf16 weights) or fp32 (fp32 weights), as in the reference.
  """
  var = jnp.mean(jnp.square(x_BLD.astype(jnp.float32)), axis=-1, keepdims=True)
  y = x_BLD.astype(jnp.float32) * jax.lax.rsqrt(var + eps)
  if weight_D.dtype in (jnp.bfloat16, jnp.float16):
    y = y.astype(weight_D.dtype)
  return weight_D * y


def _layer(x_BLD: jax.Array, lp: UMT5Params, bias_BNLS: jax.Array, cfg: UMT5Config) -> jax.Array:
  """One encoder block: pre-norm self-attention with this layer's position bias, then gated FFN."""
  dtype = lp["q"].dtype
  h = rms_norm(x_BLD, lp["attn_norm"], cfg.layer_norm_epsilon).astype(dtype)
  q = jnp.einsum("BLD,DNH->BLNH", h, lp["q"])
  k = jnp.einsum("BSD,DNH->BSNH", h, lp["k"])
  v = jnp.einsum("BSD,DNH->BSNH", h, lp["v"])
  # No 1/sqrt(H) scale: UMT5 folds it into the q initialisation (modeling_umt5.py, `self.scaling = 1.0`).
  logits = jnp.einsum("BLNH,BSNH->BNLS", q, k, preferred_element_type=jnp.float32)
  probs = jax.nn.softmax(logits + bias_BNLS, axis=-1).astype(dtype)
  att = jnp.einsum("BNLS,BSNH->BLNH", probs, v)
  x_BLD = x_BLD + jnp.einsum("BLNH,NHD->BLD", att, lp["o"]).astype(jnp.float32)

  h = rms_norm(x_BLD, lp["ffn_norm"], cfg.layer_norm_epsilon).astype(dtype)
  gate = jax.nn.gelu(jnp.einsum("BLD,DG->BLG", h, lp["wi_0"]), approximate=True)  # gelu_new == tanh
  up = jnp.einsum("BLD,DG->BLG", h, lp["wi_1"])
  wo = lp["wo"]  # transformers keeps `wo` in fp32 (`_keep_in_fp32_modules`) and casts its input to it
  out = jnp.einsum("BLG,GD->BLD", (gate * up).astype(wo.dtype), wo)
  return x_BLD + out.astype(jnp.float32)


def encode_text(params: UMT5Params, input_ids: jax.Array, attention_mask: jax.Array, *,
           config: UMT5Config) -> jax.Array:
  """Encodes token ids into text embeddings (transformers `UMT5EncoderModel(...).last_hidden_state`).

  Jit with `config` static: `jax.jit(encode_text, static_argnames="config")`.

  Args:
    params: pytree from `load_umt5` / `init_umt5_params`.
    input_ids: int [B, L] token ids in [0, V).
    attention_mask: [B, L], nonzero for real tokens, 0 for padding. Padded keys are excluded;
      padded query rows are still computed (as in the reference) and should be ignored or zeroed
      by the caller (WanPipeline zeroes rows past each prompt's length).
    config: the model config (static).

  Returns:
    [B, L, D] in the final-norm weight dtype (the params dtype). The residual stream is carried in
    fp32 (in bf16 transformers promotes it to fp32 at the first fp32 `wo`; here it is fp32 from
    the start), attention logits and softmax are fp32.

  Raises:
    ValueError: `input_ids` and `attention_mask` shapes differ or are not rank 2.
  """
  x_BLD, bias_B1LS = _embed(params["embedding"], input_ids, attention_mask)

  def body(x, lp):
    return _layer_with_bias(x, lp, bias_B1LS, config), None

  x_BLD, _ = jax.lax.scan(body, x_BLD, params["layers"])
  return rms_norm(x_BLD, params["final_norm"], config.layer_norm_epsilon)


def encode_text_layerwise(params: UMT5Params, input_ids: jax.Array, attention_mask: jax.Array, *,
                          config: UMT5Config) -> jax.Array:
  """`encode_text` (same arguments, result and errors; bit-identical) for weights on the host CPU
  (numpy or the CPU backend's arrays), run as one compiled program per layer given only that
  layer's weights (a view of the stack, no copy).

  XLA:CPU has no bf16 matmul and converts bf16 weights to fp32; inside `encode_text`'s loop it
  converts the whole stack of layers before the loop, twice the weights' bytes at once (+22.8 GB
  for UMT5-XXL's 11.4 GB, by XLA:CPU's memory analysis). Here one layer is converted at a time.
  """
  x_BLD, bias_B1LS = _embed_jit(params["embedding"], input_ids, attention_mask)
  for i in range(config.num_layers):
    layer = _layer_jit(x_BLD, jax.tree.map(lambda w: np.asarray(w)[i], params["layers"]), bias_B1LS, config=config)
    x_BLD = jax.block_until_ready(layer)  # one layer's converted weights alive at a time
  return _final_norm_jit(x_BLD, params["final_norm"], eps=config.layer_norm_epsilon)


def _embed(embedding_VD: jax.Array, input_ids: jax.Array, attention_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(the fp32 token embeddings [B, L, D], the additive key mask [B, 1, 1, L]); ValueError on bad shapes."""
  if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
    raise ValueError(f"input_ids and attention_mask must both be [B, L]; got {input_ids.shape=} "
                     f"{attention_mask.shape=}")
  # Additive key mask with the dtype minimum (as transformers' eager path): a row with every key
  # masked averages uniformly instead of producing NaN.
  key_bias_B11S = jnp.where(attention_mask[:, None, None, :] != 0, 0.0,
                            jnp.finfo(jnp.float32).min).astype(jnp.float32)
  return embedding_VD[input_ids].astype(jnp.float32), key_bias_B11S


def _layer_with_bias(x_BLD: jax.Array, lp: UMT5Params, key_bias_B11S: jax.Array, config: UMT5Config) -> jax.Array:
  """`_layer` with this layer's relative position bias added to the key mask."""
  length = x_BLD.shape[1]
  buckets_LS = relative_position_buckets(length, length, config.relative_attention_num_buckets,
                                         config.relative_attention_max_distance)
  pos_NLS = jnp.transpose(lp["rel_bias"][buckets_LS], (2, 0, 1)).astype(jnp.float32)
  return _layer(x_BLD, lp, pos_NLS[None] + key_bias_B11S, config)


_embed_jit = jax.jit(_embed)
_layer_jit = jax.jit(_layer_with_bias, static_argnames="config")
_final_norm_jit = jax.jit(rms_norm, static_argnames="eps")


# --- checkpoint layout -------------------------------------------------------------------------------

def block_keys(i: int) -> dict[str, str]:
  a = f"encoder.block.{i}.layer.0."
  f = f"encoder.block.{i}.layer.1."
  return {
      "attn_norm": a + "layer_norm.weight", "q": a + "SelfAttention.q.weight",
      "k": a + "SelfAttention.k.weight", "v": a + "SelfAttention.v.weight",
      "o": a + "SelfAttention.o.weight", "rel_bias": a + "SelfAttention.relative_attention_bias.weight",
      "ffn_norm": f + "layer_norm.weight", "wi_0": f + "DenseReluDense.wi_0.weight",
      "wi_1": f + "DenseReluDense.wi_1.weight", "wo": f + "DenseReluDense.wo.weight",
  }


def checkpoint_shapes(config: UMT5Config) -> dict[str, tuple[int, ...]]:
  """Checkpoint key -> torch-layout shape, as `UMT5EncoderModel.save_pretrained` writes them.

  The tied input embedding is saved once, as `shared.weight` (`encoder.embed_tokens.weight` is its
  tied alias and is accepted by `load_umt5` in its place or next to it).
  """
  c = config
  inner = c.num_heads * c.d_kv
  shapes = {"shared.weight": (c.vocab_size, c.d_model), "encoder.final_layer_norm.weight": (c.d_model,)}
  per_layer = {"attn_norm": (c.d_model,), "q": (inner, c.d_model), "k": (inner, c.d_model),
               "v": (inner, c.d_model), "o": (c.d_model, inner),
               "rel_bias": (c.relative_attention_num_buckets, c.num_heads), "ffn_norm": (c.d_model,),
               "wi_0": (c.d_ff, c.d_model), "wi_1": (c.d_ff, c.d_model), "wo": (c.d_model, c.d_ff)}
  for i in range(c.num_layers):
    for name, key in block_keys(i).items():
      shapes[key] = per_layer[name]
  return shapes


# Wan's own T5 encoder (Wan-Video `wan/modules/t5.py`, `models_t5_umt5-xxl-enc-bf16.pth`): block i's
# module names for each of `block_keys`' (the relative bias per block: umT5's `shared_pos=False`;
# `ffn.gate.0` is transformers' gelu-gated `wi_0`, `ffn.fc1` its `wi_1`, `ffn.fc2` its `wo`).
_OFFICIAL_BLOCK = {"attn_norm": "norm1", "q": "attn.q", "k": "attn.k", "v": "attn.v", "o": "attn.o",
                   "rel_bias": "pos_embedding.embedding", "ffn_norm": "norm2", "wi_0": "ffn.gate.0",
                   "wi_1": "ffn.fc1", "wo": "ffn.fc2"}


def official_keys(num_layers: int) -> dict[str, str]:
  """transformers key (`checkpoint_shapes`) -> the key in Wan's own T5 checkpoint of `num_layers` blocks."""
  out = {"shared.weight": "token_embedding.weight", "encoder.final_layer_norm.weight": "norm.weight"}
  for i in range(num_layers):
    out.update({key: f"blocks.{i}.{_OFFICIAL_BLOCK[name]}.weight" for name, key in block_keys(i).items()})
  return out


def params_from_state_dict(state: Mapping[str, np.ndarray], config: UMT5Config, *,
                           dtype: Any = jnp.float32, keep_wo_in_fp32: bool = True,
                           shardings: Callable[[Any], Any] | None = None,
                           progress: bool | None = None, scales: Mapping[str, np.ndarray] | None = None
                           ) -> UMT5Params:
  """Converts a checked torch-layout state dict into the params pytree (see module docstring).

  Args:
    state: key -> host array (e.g. a memory-mapped view) with the shapes of `checkpoint_shapes(config)`.
    dtype: dtype of every weight except `wo`.
    keep_wo_in_fp32: keep the FFN output projections in fp32 as transformers does
      (`_keep_in_fp32_modules = ["wo"]`); set False to halve their memory in bf16.
    shardings: maps the params' shape tree (`jax.ShapeDtypeStruct` leaves) to their shardings;
      None: the default device, uncommitted. Each device's part is converted and placed straight from `state`
      (`distributed.put_host_leaves`).
    progress: a progress bar (None: for large encoders only).
    scales: key -> the scale of a scaled-fp8 weight, float32 broadcast to the weight's shape
      (`wan.pretrained.layouts.row_scales`), laid out here as the weight is.
  """
  c = config
  scales = scales or {}
  n, h = c.num_heads, c.d_kv

  def conv(name: str, w: np.ndarray) -> np.ndarray:  # views: no copy
    if name in ("q", "k", "v"):  # torch Linear [N*H, D] -> [D, N, H]
      return w.T.reshape(c.d_model, n, h)
    if name == "o":  # [D, N*H] -> [N, H, D]
      return w.T.reshape(n, h, c.d_model)
    if name in ("wi_0", "wi_1", "wo"):
      return w.T
    return w

  layers = {}
  for name in block_keys(0):
    layer_dtype = jnp.float32 if (name == "wo" and keep_wo_in_fp32) else dtype
    keys = [block_keys(i)[name] for i in range(c.num_layers)]
    scaled = [conv(name, scales[k]) if k in scales else None for k in keys]  # laid out as the weights
    layers[name] = weights.HostLeaf.stack([conv(name, np.asarray(state[k])) for k in keys], layer_dtype,
                                          None if all(s is None for s in scaled) else scaled)
  leaves = {
      "embedding": weights.HostLeaf.of(np.asarray(state["shared.weight"]), dtype, scales.get("shared.weight")),
      "final_norm": weights.HostLeaf.of(np.asarray(state["encoder.final_layer_norm.weight"]), dtype),
      "layers": layers,
  }
  is_leaf = lambda x: isinstance(x, weights.HostLeaf)  # noqa: E731
  shapes = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), leaves, is_leaf=is_leaf)
  return distributed.put_host_leaves(leaves, None if shardings is None else shardings(shapes),
                                     progress=progress, desc="loading the text encoder")


def load_umt5(folder: str, *, dtype: Any = jnp.float32, keep_wo_in_fp32: bool = True,
              shardings: Callable[[Any], Any] | None = None,
              progress: bool | None = None) -> tuple[UMT5Config, UMT5Params]:
  """Loads a transformers `UMT5EncoderModel` folder (a pipeline's `text_encoder/`).

  Args:
    folder: the text encoder folder itself (config.json + safetensors, sharded index supported).
    dtype: weight dtype (bf16 for real checkpoints); `wo` stays fp32 unless `keep_wo_in_fp32=False`.
    shardings, progress: see `params_from_state_dict` (the files are memory-mapped and each
      device's part is placed straight from them).

  Returns:
    (config, params).

  Raises:
    weights.CheckpointError: missing folder/config, pickle-only weights, missing, unexpected or
      mis-shaped keys (all listed in one message), tied embedding copies that disagree.
    ValueError: an unsupported config (see `UMT5Config`).
  """
  config = UMT5Config.from_dict(weights.read_config(folder))
  return umt5_from_state(config, weights.read_safetensors_folder(folder), os.fspath(folder), dtype=dtype,
                         keep_wo_in_fp32=keep_wo_in_fp32, shardings=shardings, progress=progress)


def umt5_from_state(config: UMT5Config, state: Mapping[str, Any], where: str, *, dtype: Any = jnp.float32,
                    keep_wo_in_fp32: bool = True, shardings: Callable[[Any], Any] | None = None,
                    progress: bool | None = None, scales: Mapping[str, np.ndarray] | None = None
                    ) -> tuple[UMT5Config, UMT5Params]:
  """`load_umt5` from tensors named as transformers names them (a folder's, or a single file's
  renamed by `wan.pretrained.layouts`), still memory-mapped. `scales`: key -> a scaled-fp8 weight's
  scale broadcast to it (`params_from_state_dict`); such a weight (and any fp8 one) is upcast,
  q * scale in float32 rounded once to `dtype`: the encoder runs once per prompt, so its weights are
  not kept in fp8.

  Raises:
    weights.CheckpointError: missing, unexpected or mis-shaped keys (all listed in one message),
      tied embedding copies that disagree.
  """
  state = dict(state)
  alias = "encoder.embed_tokens.weight"
  if alias in state:
    if "shared.weight" not in state:
      state["shared.weight"] = state.pop(alias)
      if alias in (scales or {}):
        scales = {**scales, "shared.weight": scales[alias]}
    else:
      tied = state.pop(alias)
      if tied.shape != state["shared.weight"].shape or not np.array_equal(tied, state["shared.weight"]):
        raise weights.CheckpointError(
            f"{where}: {alias} and shared.weight are both present but differ; UMT5 ties them")
  weights.check_state_dict(state, checkpoint_shapes(config), where=where)
  return config, params_from_state_dict(state, config, dtype=dtype, keep_wo_in_fp32=keep_wo_in_fp32,
                                        shardings=shardings, progress=progress, scales=scales)


def abstract_umt5_params(config: UMT5Config, *, dtype: Any = jnp.float32,
                         keep_wo_in_fp32: bool = True) -> UMT5Params:
  """The params pytree as `jax.ShapeDtypeStruct`s (nothing allocated), as `load_umt5` would build it
  with the same `dtype` and `keep_wo_in_fp32`: for ahead-of-time compiles and memory estimates."""
  c = config
  y, d, n, h, g = c.num_layers, c.d_model, c.num_heads, c.d_kv, c.d_ff
  dtype = jnp.dtype(dtype)

  def sds(shape, out_dtype=dtype):
    return jax.ShapeDtypeStruct(shape, out_dtype)

  layers = {"attn_norm": sds((y, d)), "ffn_norm": sds((y, d)), "q": sds((y, d, n, h)), "k": sds((y, d, n, h)),
            "v": sds((y, d, n, h)), "o": sds((y, n, h, d)), "rel_bias": sds((y, c.relative_attention_num_buckets, n)),
            "wi_0": sds((y, d, g)), "wi_1": sds((y, d, g)),
            "wo": sds((y, g, d), jnp.dtype(jnp.float32) if keep_wo_in_fp32 else dtype)}
  return {"embedding": sds((c.vocab_size, d)), "final_norm": sds((d,)), "layers": layers}


def init_umt5_params(config: UMT5Config, seed: int = 0, *, dtype: Any = jnp.float32,
                     keep_wo_in_fp32: bool = True) -> UMT5Params:
  """Random params with transformers' UMT5 init (Mesh TensorFlow stds), e.g. for the tiny preset.

  Stds: embedding 1; q (D*H)^-1/2; k, v, rel_bias D^-1/2; o (N*H)^-1/2; wi D^-1/2; wo G^-1/2;
  norms 1 (`UMT5PreTrainedModel._init_weights`). Drawn on host with numpy's PCG64 from `seed`
  (eager jax.random costs seconds of compiles per shape on CPU; this is for small test models).
  """
  c = config
  y, d, n, h, g = c.num_layers, c.d_model, c.num_heads, c.d_kv, c.d_ff
  rng = np.random.default_rng(seed)

  def normal(shape, std, out_dtype=dtype):
    return jnp.asarray((std * rng.standard_normal(shape)).astype(np.float32), dtype=out_dtype)

  layers = {
      "attn_norm": jnp.ones((y, d), dtype), "ffn_norm": jnp.ones((y, d), dtype),
      "q": normal((y, d, n, h), (d * h) ** -0.5), "k": normal((y, d, n, h), d ** -0.5),
      "v": normal((y, d, n, h), d ** -0.5), "o": normal((y, n, h, d), (n * h) ** -0.5),
      "rel_bias": normal((y, c.relative_attention_num_buckets, n), d ** -0.5),
      "wi_0": normal((y, d, g), d ** -0.5), "wi_1": normal((y, d, g), d ** -0.5),
      "wo": normal((y, g, d), g ** -0.5, jnp.float32 if keep_wo_in_fp32 else dtype),
  }
  return {"embedding": normal((c.vocab_size, d), 1.0), "final_norm": jnp.ones((d,), dtype),
          "layers": layers}
