"""The MLPerf text-to-video benchmark preset (end_to_end/bench/presets.py `mlperf-wan22-t2v`)."""

import pytest

from end_to_end.bench import pipeline as bench_pipeline, presets as bench_presets
from pipelines.wan.transformer import PRESETS as TRANSFORMERS

# Expected values copied from mlcommons/inference text_to_video/wan-2.2-t2v-a14b/inference_config.yaml
# (commit b66003e1), the file its run_mlperf.py reads; the negative prompt as its `.strip()` leaves it.
MLPERF_YAML = dict(height=720, width=1280, num_frames=81, sample_steps=20, seed=42, guidance_scale=4.0,
                   guidance_scale_2=3.0, boundary_ratio=0.875)
MLPERF_NEGATIVE = (
    "vivid colors, overexposed, static, blurry details, subtitles, style,\n"
    "work of art, painting, picture, still, overall grayish, worst quality,\n"
    "low quality, JPEG artifacts, ugly, deformed, extra fingers, poorly drawn hands,\n"
    "poorly drawn face, deformed, disfigured, deformed limbs, fused fingers,\n"
    "static image, cluttered background, three legs, many people in the background,\n"
    "walking backwards")
NAME = "mlperf-wan22-t2v"


def test_preset_has_mlperf_settings():
  p = bench_presets.PRESETS[NAME]
  y = MLPERF_YAML
  assert (p.height, p.width, p.frames, p.steps, p.seed) == (y["height"], y["width"], y["num_frames"],
                                                            y["sample_steps"], y["seed"])
  assert (p.guidance, p.guidance_2) == (y["guidance_scale"], y["guidance_scale_2"])
  assert p.boundary_ratio == y["boundary_ratio"]
  assert p.negative_prompt == MLPERF_NEGATIVE
  # Wan2.2-T2V-A14B-Diffusers as loaded there: two A14B experts in bf16, its UniPC flow shift 3.0
  # (diffusers scripts/convert_wan_to_diffusers.py), WanPipeline's default 512 text tokens.
  assert p.transformer == TRANSFORMERS["wan2.2-t2v-a14b"] and p.dtype == "bfloat16"
  assert (p.flow_shift, p.max_sequence_length) == (3.0, 512)
  assert p.latent_shape == (1, 16, 21, 90, 160)
  assert "MLPerf Inference v6.0" in p.reference


def args_for(*extra):
  return bench_pipeline.build_parser().parse_args(["--preset", NAME, *extra])


def test_cpu_run_is_reduced_and_not_comparable():
  full = bench_pipeline.resolve_preset(args_for(), backend="tpu")
  assert full == bench_presets.PRESETS[NAME]
  assert bench_presets.mlperf_comparability(full, reduced=False, changed=[], runs=2)["comparable"]
  cpu = bench_pipeline.resolve_preset(args_for(), backend="cpu")
  assert cpu.transformer.num_layers == 1 and cpu.text_encoder.num_layers == 1 and cpu.frames == 5
  assert cpu.steps == 20 and cpu.boundary_ratio == 0.875 and cpu.transformer.dim == 5120
  assert "REDUCED for CPU" in cpu.description and "NOT comparable" in cpu.description
  verdict = bench_presets.mlperf_comparability(cpu, reduced=True, changed=bench_pipeline.changed_settings(
      args_for("--steps", "4")), runs=1)
  assert not verdict["comparable"] and len(verdict["reasons"]) == 3 and "--steps" in verdict["reasons"][1]


class Stop(Exception):
  pass


def test_benchmark_announces_the_cpu_reduction(monkeypatch, capsys):
  def stop(*args, **kwargs):  # the header is printed; building 2 x 350M random weights is not needed
    raise Stop
  monkeypatch.setattr(bench_presets, "init_ours", stop)
  with pytest.raises(Stop):
    bench_pipeline.main(["--preset", NAME])
  out = capsys.readouterr().out
  assert "REDUCED for CPU" in out and "5x64x112 instead of 81x720x1280" in out
  assert "comparable to MLPerf Inference v6.0" in out and "NO: reduced for CPU" in out
  assert "guidance 4.0 / 3.0 (two experts, boundary 0.875)" in out
  assert bench_pipeline.main(["--preset", NAME, "--compare", "diffusers"]) == 2
  assert "two experts" in capsys.readouterr().err


def test_every_preset_is_a_command_line_choice():
  # benchmark lists the names without importing bench_presets (no JAX before --aot sets its environment).
  assert set(bench_pipeline.PRESET_NAMES) == set(bench_presets.PRESETS)
