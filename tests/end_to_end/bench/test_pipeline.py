"""The benchmark command's compile report options (end_to_end/bench/pipeline.py `run_aot`)."""

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
