"""bench.decode: the decode alone, each run's compiles counted by JAX's own compile events."""

import json

import pytest


def test_decode_bench_counts_the_first_runs_compiles_and_none_in_the_second(tmp_path, capsys):
  from end_to_end.bench import decode

  out = tmp_path / "decode.json"
  assert decode.main(["--preset", "tiny", "--frames", "5", "--path", "whole", "--runs", "2", "--json", str(out)]) == 0
  result = json.loads(out.read_text())
  first, second = result["runs"]
  assert first["compiles"] >= 1 and first["compile_seconds"] > 0  # positive control: the listener hears compiles
  assert second["compiles"] == 0 and second["compile_seconds"] == 0
  assert first["frames_out"] == second["frames_out"] == 5 and result["latents"] == [1, 16, 2, 6, 10]
  assert "in 0 compiles" in capsys.readouterr().out
  from end_to_end.bench.presets import PRESETS
  from pipelines.wan import vae as wan_vae
  config = PRESETS["tiny"].vae
  assert result["flops"] == wan_vae.decode_flops(config.decode_layers(), 2, 6, 10) > 0
  assert second["tflops_per_s"] * 1e12 * second["seconds"] == pytest.approx(result["flops"])
  assert second["mfu"] is None  # float32 on a CPU: no bf16 peak to compare with


@pytest.mark.parametrize("argv, message", [(["--frames", "6"], "4k + 1"), (["--height", "50"], "multiples of 8"),
                                           (["--runs", "0"], "--runs")])
def test_decode_bench_refuses_bad_sizes_before_building_the_vae(argv, message, capsys):
  from end_to_end.bench import decode

  assert decode.main(["--preset", "tiny", *argv]) == 2
  assert message in capsys.readouterr().err


def test_a_named_precision_is_the_one_the_decode_runs_under(tmp_path, monkeypatch):
  """--precision high: the decode sees JAX's default matmul precision "high" (recorded by a stand-in
  decode); auto: the pipeline's rule, "highest" for a float32 VAE (positive control)."""
  import jax

  from end_to_end.bench import decode

  seen = []
  real = decode.decode_once
  monkeypatch.setattr(decode, "decode_once", lambda *a: seen.append(jax.config.jax_default_matmul_precision) or real(*a))
  for precision in ("high", "auto"):
    out = tmp_path / f"{precision}.json"
    assert decode.main(["--preset", "tiny", "--frames", "1", "--path", "whole", "--runs", "1",
                        "--precision", precision, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["precision"] == precision and result["matmul_precision"] == seen[-1]
  assert seen == ["high", "highest"]
