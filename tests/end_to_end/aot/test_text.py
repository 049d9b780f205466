"""The text encoder's AOT compile report (end_to_end/aot/text.py) on CPU devices (no libtpu)."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

from attention.mesh import MeshSpec
from end_to_end.aot import text as aot_text
from pipelines.wan.encoders import umt5

# Small, but with weights of >= 2^20 values (embedding 4096 x 256, wi_0 / wi_1 / wo 2 x 256 x 2048),
# which the pipeline's sharded placement (`large_leaf_shardings`) splits; the rest stays replicated.
CONFIG = umt5.UMT5Config(vocab_size=4096, d_model=256, d_kv=32, d_ff=2048, num_layers=2, num_heads=8)
B, L = 2, 16


def expected_weight_bytes(c: umt5.UMT5Config, itemsize: int) -> int:
  """Bytes of the encoder's weights counted from the architecture (wo in fp32, as loaded)."""
  per_layer = 2 * c.d_model + 4 * c.d_model * c.num_heads * c.d_kv + c.relative_attention_num_buckets * c.num_heads
  per_layer += 2 * c.d_model * c.d_ff
  return (c.vocab_size * c.d_model + c.d_model + c.num_layers * per_layer) * itemsize + \
      c.num_layers * c.d_ff * c.d_model * 4


def test_abstract_params_are_the_loaded_tree():
  for keep in (True, False):
    real = umt5.init_umt5_params(umt5.UMT5_PRESETS["tiny"], dtype=jnp.bfloat16, keep_wo_in_fp32=keep)
    abstract = umt5.abstract_umt5_params(umt5.UMT5_PRESETS["tiny"], dtype=jnp.bfloat16, keep_wo_in_fp32=keep)
    assert jax.tree.structure(real) == jax.tree.structure(abstract)
    assert jax.tree.leaves(jax.tree.map(lambda a, b: a.shape == b.shape and a.dtype == b.dtype, real, abstract)) \
        == [True] * len(jax.tree.leaves(real))


def test_text_encoder_one_device_and_sharded():
  one = aot_text.compile_text_encoder(jax.devices()[:1], preset=CONFIG, batch=B, text_len=L)
  assert one["stage"] == "text" and one["placement"] == "one device" and one["mesh"]["devices"] == 1
  weights = expected_weight_bytes(CONFIG, 2)
  assert one["weights_bytes_per_device"] == weights
  # The program's arguments are the weights plus the int32 ids and mask.
  assert one["memory_analysis"]["argument_size_in_bytes"] == weights + 2 * B * L * 4
  assert all(v["count"] == 0 for v in one["collectives"].values())
  assert one["cost_analysis"]["flops"] > 0 and one["compile_s"] > 0 and one["wo_dtype"] == "float32"
  half_wo = aot_text.compile_text_encoder(jax.devices()[:1], preset=CONFIG, batch=B, text_len=L, keep_wo_in_fp32=False)
  assert weights - half_wo["weights_bytes_per_device"] == CONFIG.num_layers * CONFIG.d_ff * CONFIG.d_model * 2

  spec = MeshSpec(ulysses=4, shard_weights=True)
  split = aot_text.compile_text_encoder(jax.devices()[:4], preset=CONFIG, batch=B, text_len=L, mesh_spec=spec)
  assert split["placement"] == "sharded" and split["mesh"]["devices"] == 4
  # embedding, wi_0, wi_1 and wo (all but ~8% of the bytes) split 4 ways.
  assert split["weights_bytes_per_device"] < 0.35 * weights
  assert split["memory_analysis"]["argument_size_in_bytes"] < 0.35 * weights + 2 * B * L * 4
  # GSPMD partitions the matmuls: their partial sums (or the gathered activations) cross devices.
  assert split["collectives"]["all-reduce"]["count"] + split["collectives"]["all-gather"]["count"] > 0
  assert "sharded U=4,R=1" in aot_text.format_row(split)


def test_text_encoder_bad_arguments_raise_before_compiling():
  with pytest.raises(ValueError, match="not a UMT5 preset"):
    aot_text.compile_text_encoder(jax.devices()[:1], preset="umt5-xl")
  with pytest.raises(ValueError, match="needs 4 devices"):
    aot_text.compile_text_encoder(jax.devices()[:2], preset="tiny", mesh_spec=MeshSpec(ulysses=4, shard_weights=True))
  with pytest.raises(ValueError, match="float16"):
    aot_text.compile_text_encoder(jax.devices()[:1], preset="tiny", dtype="float16")


def test_cli_usage_error_and_missing_libtpu(capsys, monkeypatch):
  with pytest.raises(SystemExit) as stop:
    aot_text.main(["--topology", "v6e:2x4", "--shard-weights"])  # --mesh missing
  assert stop.value.code == 2 and "--mesh" in capsys.readouterr().err
  if importlib.util.find_spec("libtpu") is not None:
    pytest.skip("libtpu present: it would compile")
  from end_to_end.aot import step as aot_step
  for key in aot_step.OFFLINE_ENV:  # restored after the test (the command sets them for libtpu)
    monkeypatch.setenv(key, os.environ.get(key, aot_step.OFFLINE_ENV[key]))
  assert aot_text.main(["--topology", "v6e:2x4"]) == 3
  assert "libtpu" in capsys.readouterr().err
