"""UMT5 encoder parity with transformers' UMT5EncoderModel, loader errors, tokenizer helpers."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from pipelines.storage.weights import CheckpointError
from pipelines.wan.encoders import tokenizer, umt5
from tests.numerics import EPS_F32, assert_close_scaled

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2

TINY_HF = dict(vocab_size=100, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
               relative_attention_num_buckets=32, relative_attention_max_distance=128,
               dropout_rate=0.0)
ENCODE = jax.jit(umt5.encode_text, static_argnames="config")


def fp32_rel(length: int) -> float:
  """fp32 error of the encoder output, in units of its scale (max |y|): per layer about 2 chains
  of sums (attention over `length` keys, the FFN over d_ff), rounding errors growing like
  sqrt(K) for K = max(length, d_ff): 2 * layers * sqrt(K) eps. Measured <= 0.2 of it under three
  ISA settings."""
  return 2 * TINY_HF["num_layers"] * np.sqrt(max(length, TINY_HF["d_ff"])) * EPS_F32


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """A random transformers UMT5EncoderModel saved with save_pretrained (safetensors)."""
  torch.manual_seed(0)
  model = transformers.UMT5EncoderModel(transformers.UMT5Config(**TINY_HF)).eval()
  with torch.no_grad():  # non-trivial norm weights, so a wrong norm layout would show
    for name, p in model.named_parameters():
      if "layer_norm" in name:
        p.copy_(1 + 0.2 * torch.randn_like(p))
  folder = tmp_path_factory.mktemp("text_encoder")
  model.save_pretrained(folder, safe_serialization=True)
  return model, str(folder)


@pytest.fixture(scope="module")
def byte_tokenizer():
  return tokenizer.default_tokenizer()  # ~1 s to build; shared


def batch(length, seed=0):
  """ids [3, L] and a mask with full, half-padded and single-token rows."""
  ids = np.random.RandomState(seed).randint(2, TINY_HF["vocab_size"], (3, length))
  mask = np.ones((3, length), np.int64)
  mask[1, length // 2:] = 0
  mask[2, 1:] = 0
  return ids, mask


def run_reference(model, ids, mask):
  with torch.no_grad():
    return model(torch.tensor(ids), torch.tensor(mask)).last_hidden_state.numpy()


@pytest.mark.parametrize("length", [9, 160])  # 160 > max_distance: exercises the clamped log buckets
def test_encode_matches_transformers(reference, length):
  model, folder = reference
  config, params = umt5.load_umt5(folder)
  ids, mask = batch(length)
  ref = run_reference(model, ids, mask)
  out = ENCODE(params, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32), config=config)
  assert out.shape == (3, length, TINY_HF["d_model"]) and out.dtype == jnp.float32
  assert_close_scaled(out, ref, rel=fp32_rel(length), name=f"L={length} fp32 vs transformers")


def test_bf16_weights_stay_close_and_keep_wo_fp32(reference):
  model, folder = reference
  config, params = umt5.load_umt5(folder, dtype=jnp.bfloat16)
  assert params["layers"]["q"].dtype == jnp.bfloat16
  assert params["layers"]["wo"].dtype == jnp.float32  # transformers' _keep_in_fp32_modules
  ids, mask = batch(9)
  ref = run_reference(model, ids, mask)
  out = ENCODE(params, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32), config=config)
  assert out.dtype == jnp.bfloat16
  # bf16 weights and activations: ~8 bf16 roundings in series (2 layers x q/k/v/o and FFN), 2^-8
  # relative each: 8 * 2^-8 = 3e-2 of the output's scale; 4e-2 leaves the measured 8e-3 a 5x margin.
  assert_close_scaled(out, ref, rel=4e-2, name="bf16 vs transformers fp32")


@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (32, 40), (64, 256), (16, 20)])
def test_relative_position_buckets_match_transformers(num_buckets, max_distance):
  cfg = transformers.UMT5Config(**{**TINY_HF, "relative_attention_num_buckets": num_buckets,
                                   "relative_attention_max_distance": max_distance})
  attention = transformers.models.umt5.modeling_umt5.UMT5Attention(cfg, has_relative_attention_bias=True)
  length = 600
  rel = torch.arange(length)[None, :] - torch.arange(length)[:, None]
  ref = attention._relative_position_bucket(rel).numpy()
  ours = umt5.relative_position_buckets(length, length, num_buckets, max_distance)
  np.testing.assert_array_equal(ours, ref)


def test_padding_is_respected(byte_tokenizer):
  # Valid rows do not depend on how many padded tokens follow (keys masked, positions relative).
  config = umt5.UMT5_PRESETS["tiny"]
  params = umt5.init_umt5_params(config, 0)
  tok = byte_tokenizer
  ids16, mask16 = tokenizer.tokenize(tok, ["a cat", "a dog runs"], 16)
  ids40, mask40 = tokenizer.tokenize(tok, ["a cat", "a dog runs"], 40)
  out16 = np.asarray(ENCODE(params, ids16, mask16, config=config))
  out40 = np.asarray(ENCODE(params, ids40, mask40, config=config))
  assert out16.shape == (2, 16, config.d_model) and np.all(np.isfinite(out40))
  for b in range(2):
    n = int(mask16[b].sum())
    assert_close_scaled(out16[b, :n], out40[b, :n], rel=fp32_rel(40),
                        name=f"row {b}: 16 vs 40 tokens")
  # ...and the padded rows do differ from a run where those tokens are real.
  assert not np.allclose(out16, np.asarray(ENCODE(params, ids16, np.ones_like(mask16), config=config)))


def test_sharded_checkpoint_and_tied_embedding_alias(reference, tmp_path):
  model, folder = reference
  _, params = umt5.load_umt5(folder)
  sharded = tmp_path / "sharded"
  model.save_pretrained(sharded, safe_serialization=True, max_shard_size="10KB")
  assert any(n.endswith(".safetensors.index.json") for n in os.listdir(sharded))
  _, params_sharded = umt5.load_umt5(str(sharded))
  # Bit-exact here and below: the same stored values, read from other file layouts or key names.
  jax.tree.map(np.testing.assert_array_equal, params, params_sharded)

  aliased = tmp_path / "aliased"  # older exports name the tied embedding encoder.embed_tokens.weight
  aliased.mkdir()
  shutil.copy(os.path.join(folder, "config.json"), aliased)
  state = load_file(os.path.join(folder, "model.safetensors"))
  state["encoder.embed_tokens.weight"] = state.pop("shared.weight")
  save_file(state, str(aliased / "model.safetensors"))
  _, params_aliased = umt5.load_umt5(str(aliased))
  np.testing.assert_array_equal(params_aliased["embedding"], params["embedding"])

  state["shared.weight"] = state["encoder.embed_tokens.weight"] + 1  # both present, disagreeing
  save_file(state, str(aliased / "model.safetensors"))
  with pytest.raises(CheckpointError, match="differ"):
    umt5.load_umt5(str(aliased))


def _copy(folder, dst):
  shutil.copytree(folder, dst)
  return str(dst)


def test_missing_key_raises(reference, tmp_path):
  folder = _copy(reference[1], tmp_path / "te")
  state = load_file(os.path.join(folder, "model.safetensors"))
  del state["encoder.block.1.layer.1.DenseReluDense.wo.weight"]
  save_file(state, os.path.join(folder, "model.safetensors"))
  with pytest.raises(CheckpointError, match=r"missing keys \(1\).*block\.1\.layer\.1\.DenseReluDense\.wo"):
    umt5.load_umt5(folder)


def test_shape_mismatch_raises(reference, tmp_path):
  folder = _copy(reference[1], tmp_path / "te")
  with open(os.path.join(folder, "config.json")) as f:
    cfg = json.load(f)
  cfg["d_ff"] = 64
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(cfg, f)
  with pytest.raises(CheckpointError, match=r"shape mismatches \(6\).*wi_0"):
    umt5.load_umt5(folder)


def test_pickle_only_folder_raises(reference, tmp_path):
  model, folder = reference
  pickled = tmp_path / "te"
  pickled.mkdir()
  shutil.copy(os.path.join(folder, "config.json"), pickled)
  torch.save(model.state_dict(), pickled / "pytorch_model.bin")
  with pytest.raises(CheckpointError, match="pickle"):
    umt5.load_umt5(str(pickled))


def test_config_from_dict_and_validation(reference):
  with open(os.path.join(reference[1], "config.json")) as f:
    cfg = umt5.UMT5Config.from_dict(json.load(f))
  assert (cfg.vocab_size, cfg.d_model, cfg.d_kv, cfg.d_ff, cfg.num_layers, cfg.num_heads) == (
      100, 32, 8, 48, 2, 4)
  with pytest.raises(ValueError, match="feed_forward_proj"):
    umt5.UMT5Config(feed_forward_proj="relu")
  with pytest.raises(ValueError, match="num_buckets"):
    umt5.UMT5Config(relative_attention_num_buckets=31)
  with pytest.raises(ValueError, match="is_decoder"):
    umt5.UMT5Config.from_dict({"is_decoder": True})
  with pytest.raises(ValueError, match="attention_mask"):
    umt5.encode_text(umt5.init_umt5_params(cfg, 0), jnp.zeros((2, 5), jnp.int32),
                jnp.ones((2, 6), jnp.int32), config=cfg)


def test_init_is_seeded_and_has_reference_shapes():
  # Bit-exact: the same seed must give the same parameters (a deterministic RNG).
  cfg = umt5.UMT5_PRESETS["tiny"]
  a = umt5.init_umt5_params(cfg, 1)
  b = umt5.init_umt5_params(cfg, 1)
  c = umt5.init_umt5_params(cfg, 2)
  jax.tree.map(np.testing.assert_array_equal, a, b)
  assert not np.array_equal(a["embedding"], c["embedding"])
  assert a["embedding"].shape == (384, cfg.d_model)
  assert a["layers"]["rel_bias"].shape == (cfg.num_layers, cfg.relative_attention_num_buckets,
                                           cfg.num_heads)


def test_tokenizer_helpers(tmp_path, byte_tokenizer):
  with pytest.raises(tokenizer.TokenizerNotFoundError, match="tokenizer/"):
    tokenizer.load_tokenizer(str(tmp_path))
  default = byte_tokenizer
  assert isinstance(default, transformers.ByT5Tokenizer) and len(default) == umt5.UMT5_PRESETS["tiny"].vocab_size
  default.save_pretrained(tmp_path / "tokenizer")
  loaded = tokenizer.load_tokenizer(str(tmp_path))
  ids, mask = tokenizer.tokenize(loaded, ["hello", "a much longer prompt than that"], 12)
  ids_d, mask_d = tokenizer.tokenize(default, ["hello", "a much longer prompt than that"], 12)
  np.testing.assert_array_equal(ids, ids_d)
  assert ids.dtype == mask.dtype == np.int32 and ids.shape == (2, 12)
  assert mask[0].tolist() == [1] * 6 + [0] * 6  # 5 bytes + EOS, then padding
  assert ids[0, 5] == default.eos_token_id and mask[1].all()  # second prompt truncated to 12
  with pytest.raises(ValueError, match="max_length"):
    tokenizer.tokenize(default, ["x"], 0)


def test_tokenize_warns_when_it_truncates():
  with pytest.warns(UserWarning, match=r"prompt\(s\) \[1\] are longer than max_sequence_length=16"):
    ids, mask = tokenizer.tokenize(tokenizer.default_tokenizer(), ["short", "x" * 40], 16)
  assert ids.shape == (2, 16) and int(mask[1].sum()) == 16


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layerwise_encode_is_the_scanned_one(reference, dtype):
  """`encode_text_layerwise` (the host's encode, one layer's program at a time) gives `encode_text`'s
  result bit for bit, and refuses the same bad shapes."""
  _, folder = reference
  config, params = umt5.load_umt5(folder, dtype=dtype)
  ids, mask = (jnp.asarray(a, jnp.int32) for a in batch(160))
  scanned = np.asarray(ENCODE(params, ids, mask, config=config).astype(jnp.float32))
  layerwise = umt5.encode_text_layerwise(jax.device_get(params), ids, mask, config=config)
  assert layerwise.dtype == dtype
  np.testing.assert_array_equal(np.asarray(layerwise.astype(jnp.float32)), scanned)
  with pytest.raises(ValueError, match="input_ids and attention_mask"):
    umt5.encode_text_layerwise(params, ids, mask[:, :5], config=config)


def test_the_layerwise_programs_convert_one_layer_of_bf16_weights():
  """What the layerwise encode is for: XLA:CPU's scanned encode converts every layer's bf16 weights
  to fp32 before its loop (temporaries above 2x the bf16 stack's bytes: the positive control), while the
  one-layer program's temporaries stay under one layer's fp32 copy plus the activations. Compiled
  only (XLA's memory analysis), at UMT5-XXL's width with 4 layers and a small vocabulary."""
  config = dataclasses.replace(umt5.UMT5_PRESETS["umt5-xxl"], num_layers=4, vocab_size=256)
  params = umt5.abstract_umt5_params(config, dtype=jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((2, 512), jnp.int32)
  # the bf16 stack (`wo` stays fp32, as in transformers: nothing to convert)
  stack = sum(x.size * 2 for x in jax.tree.leaves(params["layers"]) if x.dtype == jnp.bfloat16)
  scanned = ENCODE.lower(params, ids, ids, config=config).compile().memory_analysis().temp_size_in_bytes
  assert scanned > 2 * stack
  one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params["layers"])
  x = jax.ShapeDtypeStruct((2, 512, config.d_model), jnp.float32)
  bias = jax.ShapeDtypeStruct((2, 1, 1, 512), jnp.float32)
  layer = umt5._layer_jit.lower(x, one, bias, config=config).compile().memory_analysis().temp_size_in_bytes
  activations = 4 * 2 * 512 * (2 * config.d_ff + 4 * config.d_model) + 4 * 2 * config.num_heads * 512 * 512
  assert layer < 2 * stack / config.num_layers + activations
