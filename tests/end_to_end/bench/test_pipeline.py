"""The benchmark command: its compile report options (end_to_end/bench/pipeline.py `run_aot`) and the step rate it reports."""

import types

import jax
import pytest

from end_to_end.bench import pipeline as bench_pipeline


def test_compile_effort_on_a_jax_without_the_global_setting_names_the_fix(monkeypatch):
  """JAX 0.11 removed `jax_exec_time_optimization_effort`: --compile-effort then stops with the
  version and the fix before the topology is built, where `jax.config.update` raised an
  AttributeError naming neither. Control: on a JAX that has it, the value is set."""
  args = bench_pipeline.build_parser().parse_args(["--aot", "v6e:2x4", "--compile-effort", "-0.5"])
  monkeypatch.setattr(jax, "config", types.SimpleNamespace())
  with pytest.raises(SystemExit, match=r"JAX .* has no jax_exec_time_optimization_effort.*--compile-effort out"):
    bench_pipeline.run_aot(args)
  updates = []
  monkeypatch.setattr(jax, "config", types.SimpleNamespace(jax_exec_time_optimization_effort=0.0,
                                                          update=lambda *kv: updates.append(kv)))
  bench_pipeline._set_compile_effort(-0.5)
  assert updates == [("jax_exec_time_optimization_effort", -0.5)]


def test_step_rate_and_mfu_per_device(monkeypatch):
  """The 1.3B 480p step measured on a v5e (3.95 s, 565.8 TFLOP by `estimate.step_flops`): 143 TFLOP/s,
  73 % of the chip's 197; on a 4-device mesh the rate is per device; off the known chips no MFU."""
  from end_to_end.bench import presets, timed_runs
  from pipelines.parallel import planner

  flops = timed_runs.flops_of(presets.PRESETS["wan2.1-1.3b"])["step_flops"]
  assert flops == pytest.approx(565.8e12, rel=1e-3)
  monkeypatch.setattr(planner, "chip_of", lambda kind: planner.CHIPS["v5e"])
  rate = timed_runs.step_rate(flops, 3.95, None)
  assert rate["step_tflops_per_s"] == pytest.approx(143.2, rel=1e-3) and rate["step_mfu"] == pytest.approx(0.727, abs=1e-3)
  assert timed_runs.step_rate(flops, 3.95, "U=2,R=2")["step_tflops_per_s"] == pytest.approx(143.2 / 4, rel=1e-3)
  monkeypatch.setattr(planner, "chip_of", lambda kind: None)
  assert timed_runs.step_rate(flops, 3.95, None)["step_mfu"] is None and timed_runs.step_rate(flops, None, None) == {}


def test_decode_rate_one_device_bf16_only(monkeypatch):
  """The 480p decode measured on a v5e with a bf16 VAE (7.39 s, 262.8 TFLOP by `vae.decode_flops`):
  35.6 TFLOP/s, 18 % of the chip's peak; a float32 VAE gets a rate but no MFU; on a mesh no decode
  rate (the decode's split is not the step's); the run line names both stages."""
  from end_to_end.bench import presets, timed_runs
  from pipelines.parallel import planner

  ours = timed_runs.flops_of(presets.PRESETS["wan2.1-1.3b"])
  assert ours["decode_flops"] == pytest.approx(262.8e12, rel=1e-3)
  monkeypatch.setattr(planner, "chip_of", lambda kind: planner.CHIPS["v5e"])
  stages = dict(denoise_step_median=3.95, decode=7.39, total=210.0, memory_plan="plan: resident", peak_device_gib=9.0)
  bf16 = timed_runs.stage_rates(ours, stages, None, "bfloat16")
  assert bf16["decode_tflops_per_s"] == pytest.approx(35.56, rel=1e-3) and bf16["decode_mfu"] == pytest.approx(0.180, abs=1e-3)
  assert timed_runs.stage_rates(ours, stages, None, "float32")["decode_mfu"] is None
  assert "decode_tflops_per_s" not in timed_runs.stage_rates(ours, stages, "U=2,R=2", "bfloat16")
  line = timed_runs.run_line(0, {**stages, **bf16}, ours)
  assert "step: 566.0 TFLOP" in line and "decode: 262.8 TFLOP (vae.decode_flops; the stage's seconds, compiles and host copy included), 35.6 TFLOP/s" in line


@pytest.mark.parametrize("kind,chip", [("TPU v5 lite", "v5e"), ("TPU v6 lite", "v6e"), ("NVIDIA H100 80GB HBM3", "h100"),
                                       ("cpu", None)])
def test_chip_of_device_kinds(kind, chip):
  from pipelines.parallel import planner
  assert planner.chip_of(kind) == (planner.CHIPS[chip] if chip else None)


def test_host_random_umt5_has_the_encoder_s_tree_and_stds(monkeypatch):
  """`presets.host_random_umt5`: numpy leaves with `init_umt5_params`' paths, shapes and dtypes (bf16,
  `wo` fp32), each leaf's std that of transformers' init within sampling error (the tile repeated
  to a leaf's size is 2**10 draws here), and the encoder runs on them."""
  import dataclasses

  import jax.numpy as jnp
  import numpy as np

  from end_to_end.bench import presets
  from pipelines.wan.encoders import UMT5Config, init_umt5_params
  from pipelines.wan.encoders.umt5 import encode_text

  monkeypatch.setattr(presets, "TILE", 2 ** 10)
  config = dataclasses.replace(UMT5Config(), num_layers=3, vocab_size=3000)
  ours = presets.host_random_umt5(config, 0, jnp.bfloat16)
  ref = init_umt5_params(config, 0, dtype=jnp.bfloat16)
  paths = lambda tree: [(jax.tree_util.keystr(p), x.shape, x.dtype) for p, x in jax.tree_util.tree_leaves_with_path(tree)]
  assert paths(ours) == paths(ref)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(ref)):
    assert isinstance(a, np.ndarray), path
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.std(a) == pytest.approx(np.std(b), rel=0.1, abs=1e-6), jax.tree_util.keystr(path)
  ids = jnp.arange(12, dtype=jnp.int32)[None]
  out = encode_text(ours, ids, jnp.ones_like(ids), config=config)
  assert np.isfinite(np.asarray(out, np.float32)).all() and float(jnp.std(out.astype(jnp.float32))) > 0


def test_vae_dtype_reaches_our_pipeline_s_vae():
  """`--vae-dtype`: the random-init pipeline's VAE in that dtype (float32 by default, as every pipeline)."""
  import jax.numpy as jnp

  from end_to_end.bench import pipeline as bench, presets

  assert bench.build_parser().parse_args([]).vae_dtype == "float32"
  assert bench.build_parser().parse_args(["--vae-dtype", "bfloat16"]).vae_dtype == "bfloat16"
  tiny = presets.PRESETS["tiny"]
  assert jnp.dtype(presets.init_ours(tiny, vae_dtype="bfloat16").vae.dtype) == jnp.bfloat16
  assert jnp.dtype(presets.init_ours(tiny).vae.dtype) == jnp.float32
