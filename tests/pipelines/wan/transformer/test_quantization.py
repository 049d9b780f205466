"""Tests for pipelines/wan/transformer/quantization.py: int8 / fp8 weights, w8a8, sharded and quantized, LoRA order.

References: numpy float64 twins of the quantized matmul (the same q and s; w8a8 quantizes the rows
in numpy as the module docstring says) and the error bounds of round-to-nearest: int8
|w - q s| <= s / 2, e4m3 |w - q s| <= 2^-4 |w| (normal range) or 2^-10 s (subnormals). Pipelines
are the random tiny model (`WanPipeline.tiny(random=True)`).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

from pipelines import WanPipeline
from pipelines.parallel import planner
from pipelines.parallel.plan import ParallelPlan
from pipelines.pipeline.checked.model_facts import token_facts
from pipelines.wan.transformer import forward, param_counts, PRESETS, quantization
from pipelines.wan.transformer.layers import Dense

EPS32 = 2.0 ** -24  # fp32 unit roundoff
CALL = dict(height=32, width=32, num_frames=5, num_inference_steps=2, seed=3, max_sequence_length=16)


def _kernel(seed: int = 0, shape=(2, 64, 48)) -> np.ndarray:
  """[Z, I, O] weights whose output channels span six orders of magnitude (and one all-zero
  channel), so both e4m3's normal and subnormal ranges and the zero-scale guard are reached."""
  rng = np.random.default_rng(seed)
  w = rng.standard_normal(shape).astype(np.float32)
  w *= np.logspace(-3, 3, shape[-1], dtype=np.float32)
  w[..., 5] = 0.0
  w[0, 3, :] *= 1e-4  # tiny entries beside large ones in a channel: e4m3 subnormals
  return w


def test_kernel_error_bounds():
  w = _kernel()
  for mode in ("int8", "fp8"):
    q = quantization.quantize_kernel(jnp.asarray(w), mode)
    assert q.qvalue.dtype == quantization.QTYPES[mode] and q.qvalue.shape == w.shape
    assert q.scale.dtype == jnp.float32 and q.scale.shape == (2, 1, 48)
    s = np.asarray(q.scale, np.float64)
    err = np.abs(w - np.asarray(quantization.dequantize(q), np.float64))
    slack = 4 * EPS32 * (np.abs(w) + s)  # fp32 division and product roundings
    if mode == "int8":
      values = np.asarray(q.qvalue, np.int32)
      # +-127.5 rounds to +-128: -128 is int8, +128 saturates to 127 (never wraps to -128).
      assert np.all(values * np.sign(w) >= 0) and values.max() == 127 and values.min() == -128
      bound = s / 2
    else:
      bound = np.maximum(2.0 ** -4 * np.abs(w), 2.0 ** -10 * s)
    assert np.all(err <= bound + slack), f"{mode}: worst {np.max(err / (bound + slack)):.3f} of the bound"
    # Positive control: the bound is nearly reached (it is the rounding's, not a loose one).
    assert np.max(err / bound, where=bound > 0, initial=0.0) > 0.9
    assert np.all(err[..., 5] == 0)


def _dense_reference(x: np.ndarray, q: qwix.QArray, bias: np.ndarray, int8_activations: bool) -> np.ndarray:
  """float64 numpy twin of `quantization.dense` for one layer (q [I, O], scale [1, O])."""
  qv, s = np.asarray(q.qvalue, np.float64), np.asarray(q.scale, np.float64)
  if not int8_activations:
    return x.astype(np.float64) @ (qv * s) + bias
  x32 = x.astype(np.float32)
  # XLA turns the division by the constant 127.5 into a product with its fp32 reciprocal; each
  # row's absmax lands on +-127.5, a tie, so the twin rounds its scale the same way.
  sx = np.abs(x32).max(axis=-1, keepdims=True) * np.float32(1 / 127.5)
  qx = np.clip(np.round(x32 / sx), -128, 127)  # fp32 division; +127.5 saturates
  return (qx @ qv) * sx * s + bias


@pytest.mark.parametrize("mode", quantization.QUANTIZATION_MODES)
def test_dense_matches_reference(mode):
  rng = np.random.default_rng(1)
  w = rng.standard_normal((64, 48)).astype(np.float32) / 8
  bias = rng.standard_normal(48).astype(np.float32)
  x = rng.standard_normal((2, 7, 64)).astype(np.float32)
  q = quantization.quantize_kernel(jnp.asarray(w), mode)
  w8a8 = mode == "int8-w8a8"
  got = np.asarray(quantization.dense(jnp.asarray(x), q, jnp.asarray(bias), int8_activations=w8a8))
  want = _dense_reference(x, q, bias, w8a8)
  # fp32 sums of I = 64 products (exact int32 sums for w8a8) and a few fp32 roundings.
  magnitude = np.abs(x) @ np.abs(np.asarray(quantization.dequantize(q))) + np.abs(bias)
  assert np.all(np.abs(got - want) <= (64 + 4) * EPS32 * magnitude)
  if w8a8:  # positive control: quantizing the activations changes the result beyond that bound
    assert np.max(np.abs(got - _dense_reference(x, q, bias, False))) > 100 * 68 * EPS32 * magnitude.max()


def _bf16_dense(rng, inputs: int, outputs: int, mode: str | None) -> Dense:
  """A random bf16 `Dense` [inputs, outputs], its kernel quantized by `mode` (None: bf16)."""
  kernel = jnp.asarray(rng.standard_normal((inputs, outputs)) / 8, jnp.bfloat16)
  layer = Dense(kernel, jnp.asarray(rng.standard_normal(outputs), jnp.bfloat16))
  if mode is not None:
    layer.kernel.set_value(quantization.quantize_kernel(kernel, mode))
    layer.int8_activations = mode == "int8-w8a8"
  return layer


@pytest.mark.parametrize("mode", (None, *quantization.QUANTIZATION_MODES))
def test_dense_heads_is_the_dense_split_into_heads(mode):
  """`Dense.heads` (the kernel read as [N, I, H] head kernels, what the block's q/k/v projections
  run) gives `Dense.__call__`'s values bitwise, reshaped to [B, T, N, H], for every weight kind."""
  rng = np.random.default_rng(2)
  layer = _bf16_dense(rng, 64, 48, mode)
  x = jnp.asarray(rng.standard_normal((2, 7, 64)), jnp.bfloat16)
  want = np.asarray(jax.jit(lambda v: layer(v))(x).astype(jnp.float32)).reshape(2, 7, 4, 12)
  got = jax.jit(lambda v: layer.heads(v, 4))(x)
  assert got.shape == (2, 7, 4, 12) and got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)


@pytest.mark.parametrize("mode", (None, *quantization.QUANTIZATION_MODES))
def test_dense_from_heads_is_the_dense_of_the_joined_heads(mode):
  """`Dense.from_heads` (what the block's attention outputs run through `to_out`) gives
  `Dense.__call__`'s values on the heads joined into [B, T, I], bitwise off TPU, for every weight
  kind; and another input changes them (positive control)."""
  rng = np.random.default_rng(3)
  layer = _bf16_dense(rng, 48, 64, mode)
  x = jnp.asarray(rng.standard_normal((2, 7, 4, 12)), jnp.bfloat16)
  want = np.asarray(jax.jit(lambda v: layer(v.reshape(2, 7, 48)))(x).astype(jnp.float32))
  got = jax.jit(layer.from_heads)(x)
  assert got.shape == (2, 7, 64) and got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)
  assert not np.array_equal(np.asarray(jax.jit(layer.from_heads)(-x).astype(jnp.float32)), want)


def test_dense_contract_heads_is_the_dense_within_fp32_sums():
  """`Dense.contract_heads` (the TPU's `from_heads`: one contraction over (N, H)) against float64
  x W + b on fp32 weights: the same I = 48 products summed in another order, so within (I + 2)
  fp32 ulps of the sums' magnitude, as `Dense.__call__` itself."""
  rng = np.random.default_rng(4)
  kernel, bias = rng.standard_normal((48, 64)).astype(np.float32), rng.standard_normal(64).astype(np.float32)
  layer = Dense(jnp.asarray(kernel), jnp.asarray(bias))
  x = rng.standard_normal((2, 7, 4, 12)).astype(np.float32)
  got = np.asarray(jax.jit(layer.contract_heads)(jnp.asarray(x)))
  joined = x.reshape(2, 7, 48).astype(np.float64)
  want = joined @ kernel + bias
  magnitude = np.abs(joined) @ np.abs(kernel) + np.abs(bias)
  assert got.shape == (2, 7, 64) and np.all(np.abs(got - want) <= (48 + 2) * EPS32 * magnitude)
  assert np.max(np.abs(np.asarray(jax.jit(layer.contract_heads)(jnp.asarray(-x))) - want)) > 1.0


def test_w8a8_is_an_int8_dot_with_int32_sums():
  q = quantization.quantize_kernel(jnp.ones((64, 48)), "int8-w8a8")
  hlo = jax.jit(lambda x: quantization.dense(x, q, jnp.zeros(48), int8_activations=True)).lower(
      jnp.ones((2, 7, 64))).as_text()
  dots = re.findall(r"dot_general.*", hlo)
  assert len(dots) == 1 and re.search(r"xi8>, tensor<64x48xi8>\) -> tensor<2x7x48xi32>", dots[0]), dots


def test_quantize_none_is_todays_path():
  # The Dense of a full-precision kernel computes what it did before quantization existed.
  rng = np.random.default_rng(2)
  kernel, bias = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((64, 48), (48,)))
  x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
  before = (jnp.einsum("...I,IO->...O", x.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
            + bias.astype(jnp.float32)).astype(kernel.dtype)
  assert np.array_equal(np.asarray(Dense(kernel, bias)(x)), np.asarray(before))
  with pytest.raises(ValueError, match="quantize='int4'.*int8"):
    WanPipeline.tiny(random=True, quantize="int4")


def _device_bytes(state) -> int:
  """Bytes one device holds of a placed state (its first device's shards)."""
  device = jax.devices()[0]
  return sum(shard.data.nbytes for leaf in jax.tree.leaves(state) for shard in leaf.addressable_shards
             if shard.device == device)


def test_sharded_quantized_weights():
  """int8 weights sharded over U=2,R=2: the 1-byte values and fp32 scales are what each device
  holds and what the layer scan all-gathers; the forward is the one-device quantized forward."""
  pipe = WanPipeline.tiny(random=True)
  config = pipe.transformer_config
  plan = ParallelPlan.build("U=2,R=2", heads=config.num_attention_heads, shard_weights=True)
  pipe.weights.place(plan)  # as from_pretrained(mesh=..., shard_weights=True) leaves them
  full = pipe.weights.experts[0]
  pipe.quantize("int8")  # re-placed under the same plan
  blocks = pipe.weights.experts[0]["blocks"]
  kernel = blocks["ffn"]["proj_in"]["kernel"].get_value()
  assert kernel.qvalue.dtype == jnp.int8 and kernel.qvalue.sharding.shard_shape(kernel.shape)[2] * 4 == kernel.shape[2]
  # Block weights per device: the quantized kernels' values at 1 byte (fp32 before), the rest as before.
  kernels = sum(np.prod(blocks[a][b]["kernel"].get_value().shape) for a, b in quantization.QUANTIZED_LINEARS)
  scales = sum(blocks[a][b]["kernel"].get_value().scale.size for a, b in quantization.QUANTIZED_LINEARS)
  assert _device_bytes(blocks) == _device_bytes(full["blocks"]) - 3 * kernels // 4 + scales
  assert pipe.facts.quantize == "int8" and pipe.quantization == "int8"

  rng = np.random.default_rng(4)
  latents = jnp.asarray(rng.standard_normal((1, config.in_channels, 2, 8, 8)), jnp.float32)
  text = jnp.asarray(rng.standard_normal((1, 8, config.text_dim)), jnp.float32)
  run = jax.jit(lambda g, s, p: forward(nnx.merge(g, s), latents, jnp.array([600.0]), text, p),
                static_argnums=(0, 2))
  graphdef = pipe.compiled_steps.graphdef
  compiled = run.lower(graphdef, pipe.weights.experts[0], plan).compile()
  sharded = np.asarray(compiled(pipe.weights.experts[0]))
  hlo = compiled.as_text()
  gathered = set(re.findall(r"= (\w+)\[[^\]]*\][^=\n]*all-gather\(", hlo))
  assert {"s8", "f32"} <= gathered, gathered  # values and scales, gathered per layer
  one = jax.device_put(pipe.weights.experts[0], jax.devices()[0])
  single = np.asarray(run(graphdef, one, ParallelPlan.single()))
  assert np.max(np.abs(sharded - single)) <= 1e-5 * np.max(np.abs(single))  # fp32 reduction order only


def test_lora_fused_before_quantize_then_refused():
  from pipelines.wan import lora

  plain = WanPipeline.tiny(random=True, quantize="int8")
  config = plain.transformer_config
  rng = np.random.default_rng(0)
  (out_dim, in_dim), _, _ = lora.linear_layers(config)["blocks.0.attn1.to_q"]
  state = {"transformer.blocks.0.attn1.to_q.lora_A.weight": rng.standard_normal((2, in_dim), np.float32),
           "transformer.blocks.0.attn1.to_q.lora_B.weight": rng.standard_normal((out_dim, 2), np.float32)}
  pipe = WanPipeline.tiny(random=True)
  pipe.load_lora_weights(state, adapter_name="a")
  pipe.quantize("int8")
  q = lambda p: np.asarray(p.weights.experts[0]["blocks"]["attn1"]["to_q"]["kernel"].get_value().qvalue)  # noqa: E731
  assert not np.array_equal(q(pipe)[0], q(plain)[0]) and np.array_equal(q(pipe)[1], q(plain)[1])
  before = pipe.lora_info()
  for call in (lambda: pipe.load_lora_weights(state, adapter_name="b"), pipe.unfuse_lora,
               lambda: plain.load_lora_weights(state), lambda: pipe.fuse_lora(lora_scale=0.5),
               lambda: pipe.set_adapters(["a"], [0.3]), lambda: pipe.delete_adapters("a"),
               pipe.unload_lora_weights, lambda: pipe.set_lora_scale(0.5)):
    with pytest.raises(ValueError, match=r"quantized \(int8\).*quantize=None, load the LoRAs, then call "
                                         r"pipe.quantize\('int8'\)"):
      call()
    assert pipe.lora_info() == before  # refused before any adapter record changed
  assert pipe.get_list_adapters() == {"transformer": ["a"]}
  assert plain.set_lora_scale(0.5) == 1.0  # no adapters: nothing to re-fuse, nothing refused
  with pytest.raises(ValueError, match="quantized already"):
    pipe.quantize("fp8")


def test_planner_counts_quantized_bytes():
  config = PRESETS["wan2.1-t2v-14b"]
  counts = param_counts(config)
  values, scales = quantization.quantized_counts(config)
  assert values / counts[0] > 0.98  # the block Linear kernels are nearly all of the blocks
  kwargs = dict(param_counts=counts, devices=8, frames=81, height=720, width=1280, chip=planner.CHIPS["v5e"],
                token_facts=token_facts(config, spatial_factor=8, temporal_factor=4, text_tokens=512))
  plain = {(str(c.mesh), c.mesh.shard_weights): c for c in planner.candidates(config, **kwargs)}
  quant = {(str(c.mesh), c.mesh.shard_weights): c
           for c in planner.candidates(config, **kwargs, quantized=(values, scales))}
  saved = values * (2 - 1) - 4 * scales  # bf16 -> 1 byte, plus the scales
  for key, c in plain.items():
    q = quant[key]
    if c.mesh.shard_weights:
      assert q.weight_bytes == pytest.approx(c.weight_bytes - saved / 8 - 2 * saved / config.num_layers)
      assert q.collective_bytes["weight_all_gather"] == pytest.approx(
          c.collective_bytes["weight_all_gather"] - saved * 7 / 8)
    else:
      assert q.weight_bytes == pytest.approx(c.weight_bytes - saved)
  with pytest.raises(ValueError, match="quantized="):
    planner.candidates(config, **kwargs, quantized=(counts[0] + 1, 0))


def test_generate_quantize_flag(tmp_path):
  """--quantize reaches the request's model facts, the run record (--resume) and the sidecar's
  settings; the command's pipeline is quantized after its LoRAs and matches the request."""
  from pipelines.cli import generate, records, run_plan

  argv = ["--prompt", "a fox", "--model", "tiny-random", "--size", "32x32", "--frames", "5", "--steps", "1",
          "--quantize", "fp8", "--attention-exchange", "fp8", "--out", str(tmp_path / "a.npy")]
  checked = run_plan.check_plan(run_plan.plan_run(generate.build_parser().parse_args(argv)))
  assert checked.plan.quantize == "fp8" and checked.request.model.quantize == "fp8"
  record = records.request_record(checked.plan, checked.request)
  assert record["quantize"] == "fp8" and record["attention_exchange"] == "fp8"
  assert checked.request.settings()["quantize"] == "fp8"
  pipe = generate._load(checked.plan, checked.request)
  assert pipe.quantization == "fp8" and pipe.facts == checked.request.model


def test_from_pretrained_quantizes_the_checkpoint_values():
  """quantize= at load reads the block kernels as fp32 (not rounded to the model dtype first) and
  places the int8 values and scales where `weight_shardings` puts them."""
  from pipelines.storage import weights
  from pipelines.wan.pretrained import TINY_DEFAULT_FOLDER

  folder = f"{TINY_DEFAULT_FOLDER}/transformer"
  checkpoint = weights.read_safetensors_folder(folder)["blocks.1.ffn.net.0.proj.weight"]  # torch [O, I]
  pipe = WanPipeline.from_pretrained(TINY_DEFAULT_FOLDER, dtype="bfloat16", quantize="int8", mesh="U=2,R=2",
                                     shard_weights=True)
  kernel = pipe.weights.experts[0]["blocks"]["ffn"]["proj_in"]["kernel"].get_value()
  want = quantization.quantize_kernel(jnp.asarray(np.asarray(checkpoint, np.float32).T), "int8")
  assert np.array_equal(np.asarray(kernel.qvalue[1]), np.asarray(want.qvalue))
  assert np.array_equal(np.asarray(kernel.scale[1]), np.asarray(want.scale))
  rounded = quantization.quantize_kernel(jnp.asarray(np.asarray(checkpoint, np.float32).T, jnp.bfloat16), "int8")
  assert not np.array_equal(np.asarray(rounded.qvalue), np.asarray(want.qvalue))  # control: bf16 first differs
  devices = 4
  for leaf in (kernel.qvalue, kernel.scale):
    assert leaf.sharding.shard_shape(leaf.shape)[2] * devices == leaf.shape[2]
  assert pipe.quantization == "int8" and pipe.weights.experts[0]["proj_out"]["kernel"].get_value().dtype == jnp.bfloat16


def test_quality_quantize_candidates():
  from end_to_end.quality import check as quality_check

  args = quality_check.build_parser().parse_args(["--model", "tiny-random", "--quantize", "none", "--quantize", "int8",
                                            "--mesh", "U=1,R=1"])
  found = quality_check.plan(args)["candidates"]
  assert [c["quantize"] for c in found] == [None, "int8"]
  assert [quality_check.sheet_name(i, c) for i, c in enumerate(found)] == ["00_bfloat16_U1R1_auto.png",
                                                                     "01_bfloat16_int8_U1R1_auto.png"]
  args = quality_check.build_parser().parse_args(["--model", "tiny-random", "--attention-exchange", "bf16",
                                            "--attention-exchange", "fp8", "--mesh", "U=2,R=1"])
  found = quality_check.plan(args)["candidates"]
  assert [c["exchange"] for c in found] == ["bf16", "fp8"]
  assert quality_check.sheet_name(1, found[1]) == "01_bfloat16_fp8x_U2R1_auto.png"
