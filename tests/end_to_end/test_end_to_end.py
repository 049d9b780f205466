"""Tests for end_to_end/ (issue 8): the quality check, the runtime benchmark, the AOT step compile.

The quality and benchmark CLIs run in-process (`main(argv)`, exit status returned) on the tiny model
at the smallest sizes that still exercise padding on a 2x2 mesh (latents [1, 16, 3, 6, 10]: 45
tokens) and a 2-step UniPC trajectory with CFG.

About the bf16 thresholds on the tiny model: its random-weight video is low-contrast noise (pixel
std ~0.10), so SSIM reacts strongly to bf16 rounding: measured mean SSIM of bf16 vs fp32 over seeds
0-2 ranges 0.966-0.996 at guidance 5 and 0.987-0.996 at guidance 3 (2x2 mesh, 2 steps). The test
runs guidance 3, seed 0: 1 - mean SSIM = 0.0125 under three ISA settings, so its bar is 0.94 (4.8x).
A different seed scores mean PSNR ~37 dB on this model (above the 35 dB bf16 bar!) but mean SSIM
~0.86: on the tiny model, SSIM is what tells videos apart. The fp32 bar is FP32_VIDEO_PSNR_DB
(tests/numerics.py).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from attention.mesh import MeshSpec
from end_to_end.aot import step as aot_step
from end_to_end.bench import pipeline as bench_pipeline
from end_to_end.quality import check as quality_check
from end_to_end.quality.video_metrics import PSNR_CAP_DB, compare_videos, psnr_per_frame, ssim_per_frame
from tests.numerics import FP32_VIDEO_PSNR_DB, assert_close_scaled, check_psnr, within

BF16_MIN_SSIM = 0.94  # see the module doc
QUALITY_ARGS = ["--model", "tiny-random", "--height", "48", "--width", "80", "--frames", "9", "--steps", "2", "--guidance", "3.0",
                "--max-sequence-length", "32", "--mesh", "U=2,R=2", "--seed", "0"]


# --- video metrics -------------------------------------------------------------------------------

def test_metrics_identical_and_known_noise():
  rng = np.random.default_rng(0)
  video = rng.random((2, 3, 16, 16, 3)).astype(np.float32)
  same = compare_videos(video, video)
  assert same["psnr_per_frame"] == [PSNR_CAP_DB] * 6 and same["ssim_min"] == pytest.approx(1.0)
  noisy = np.clip(video + 0.01 * rng.standard_normal(video.shape), 0, 1)
  mse = np.mean((noisy - video) ** 2, axis=(2, 3, 4)).reshape(-1)
  # float64 on both sides, the same mean of 768 squares perhaps summed in another order: ~sqrt(768)
  # float64 eps = 6e-15 relative; 1e-12 of the PSNR's scale.
  assert_close_scaled(psnr_per_frame(video, noisy), 10 * np.log10(1 / mse), rel=1e-12, name="psnr")
  assert np.all(ssim_per_frame(video, noisy) < 1)


def test_metrics_reject_mismatched_shapes():
  with pytest.raises(ValueError, match="differ in shape"):
    psnr_per_frame(np.zeros((1, 2, 16, 16, 3)), np.zeros((1, 3, 16, 16, 3)))
  with pytest.raises(ValueError, match="smaller than SSIM's 7x7 window"):
    ssim_per_frame(np.zeros((2, 4, 4, 3)), np.zeros((2, 4, 4, 3)))


# --- quality -------------------------------------------------------------------------------------

def test_quality_default_mesh_on_one_chip():
  """`python -m end_to_end.quality.check` with its defaults on a host with one TPU device: the
  default mesh (U=2,R=2) falls back to one that fits, with a note; a given mesh too large is
  refused naming one that fits; on CPU the simulated-devices advice stays; a mesh that fits is kept."""
  def planned(*argv):
    args = quality_check.build_parser().parse_args(list(argv))
    return args, quality_check.plan(args)

  args, p = planned()
  assert p["devices"] == 4 and quality_check.fit_devices(p, args, 4, "tpu") == (p, None)
  fitted, note = quality_check.fit_devices(p, args, 1, "tpu")
  assert [str(c["spec"]) for c in fitted["candidates"]] == ["U=1,R=1"] and fitted["devices"] == 1
  assert note == ("the default mesh U=2,R=2 needs 4 devices but there are 1 (1 visible tpu device): checking on "
                  "mesh U=1,R=1 instead (--mesh chooses another)")
  assert quality_check.fit_devices(p, args, 2, "tpu")[0]["candidates"][0]["mesh"] == "U=1,R=2"
  with pytest.raises(quality_check.UsageError, match="XLA_FLAGS=--xla_force_host_platform_device_count=4"):
    quality_check.fit_devices(p, args, 1, "cpu")
  args, p = planned("--mesh", "U=4,R=1")
  with pytest.raises(quality_check.UsageError, match=r"the largest --mesh needs 4 devices but there are 1 \(1 "
                                                     r"visible tpu device\); .* e.g. --mesh U=1,R=1"):
    quality_check.fit_devices(p, args, 1, "tpu")


def test_quality_thresholds_parse():
  assert quality_check.parse_thresholds("35", "--min-psnr") == {"float32": 35.0, "bfloat16": 35.0}
  assert quality_check.parse_thresholds("float32=60,bfloat16=35", "--min-psnr") == {"float32": 60.0, "bfloat16": 35.0}
  with pytest.raises(quality_check.UsageError, match="unknown dtype 'fp8'"):
    quality_check.parse_thresholds("fp8=3", "--min-psnr")


@pytest.mark.parametrize("argv", [["--matrix", "--dtype", "float32"], ["--mesh", "U=2;R=2"],
                                  ["--min-ssim", "high"]])
def test_quality_usage_errors_exit_2(argv, capsys):
  assert quality_check.main(argv) == 2
  assert "error:" in capsys.readouterr().err


def test_quality_tiny_2x2_fp32_and_bf16(tmp_path):
  path = tmp_path / "quality.json"
  status = quality_check.main(QUALITY_ARGS + ["--dtype", "float32", "--dtype", "bfloat16",
                                        "--min-psnr", f"float32={FP32_VIDEO_PSNR_DB},bfloat16=35",
                                        "--min-ssim", f"bfloat16={BF16_MIN_SSIM}",
                                        "--json", str(path)])
  report = json.loads(path.read_text())
  rows = {r["dtype"]: r for r in report["candidates"]}
  summary = {d: (r["psnr_mean"], r["ssim_mean"], r["max_abs_latent_diff"]) for d, r in rows.items()}
  assert status == 0 and report["passed"], f"quality check failed: {summary}"
  assert report["reference"] == dict(report["reference"], dtype="float32", mesh=None, attention="lse")
  assert set(rows) == {"float32", "bfloat16"}
  for row in rows.values():
    assert row["mesh"]["spec"] == "U=2,R=2" and row["attention"] == "auto" and row["passed"]
    assert len(row["psnr_per_frame"]) == len(row["ssim_per_frame"]) == 9
    assert row["psnr_min"] <= row["psnr_mean"] and row["ssim_min"] <= row["ssim_mean"]
  check_psnr(rows["float32"]["psnr_mean"], FP32_VIDEO_PSNR_DB, "fp32 mean PSNR")
  # Latents ~N(0, 1) (max ~4) after 2 steps of a transformer within ~1e-5 of its scale
  # (tests/pipelines/wan/transformer/test_model.py): 2 * 4 * 1e-5 ~ 1e-4. Measured 2e-6.
  within(rows["float32"]["max_abs_latent_diff"], 1e-4, "fp32 max |latent diff|")
  # bf16 vs fp32 video: a few bf16 roundings (2^-8) of pixel values ~0.5 survive the decode: RMS
  # <= 1.8e-2 (35 dB). Measured 1.3e-3 (58 dB).
  check_psnr(rows["bfloat16"]["psnr_mean"], 35, "bf16 mean PSNR")
  within(1 - rows["bfloat16"]["ssim_mean"], 1 - BF16_MIN_SSIM, "bf16 1 - mean SSIM")
  assert rows["bfloat16"]["max_abs_latent_diff"] > rows["float32"]["max_abs_latent_diff"]


def test_quality_positive_control_fails(tmp_path, capsys):
  """Another seed's latents must fail the fp32 bar (PSNR) and the bf16 bar (SSIM). With --plots:
  the contact sheet (reference row over candidate row) and the per-frame plot; the same names are
  refused by a second run before any compute."""
  path = tmp_path / "control.json"
  plots = tmp_path / "plots"
  status = quality_check.main(QUALITY_ARGS + ["--dtype", "float32", "--candidate-seed", "1", "--json", str(path),
                                        "--plots", str(plots)])
  report = json.loads(path.read_text())
  (row,) = report["candidates"]
  assert status == 1 and not report["passed"] and not row["passed"]
  assert report["settings"]["candidate_seed"] == 1
  assert row["psnr_mean"] < 60 and any("PSNR" in f for f in row["failures"])
  assert row["ssim_mean"] < BF16_MIN_SSIM, "a different seed must also fail the bf16 SSIM bar"
  import imageio.v3 as iio
  assert sorted(os.listdir(plots)) == ["00_float32_U2R2_auto.png", "per_frame.png"]
  sheet = iio.imread(plots / "00_float32_U2R2_auto.png")
  plot = iio.imread(plots / "per_frame.png")
  assert sheet.ndim == 3 and sheet.shape[0] > 2 * 96 and plot.shape[:2] == (400, 1100)
  assert quality_check.main(QUALITY_ARGS + ["--dtype", "float32", "--plots", str(plots)]) == 2
  assert "already holds 00_float32_U2R2_auto.png, per_frame.png" in capsys.readouterr().err


# --- benchmark -----------------------------------------------------------------------------------

def test_benchmark_tiny_compare_diffusers(tmp_path):
  pytest.importorskip("diffusers")
  path = tmp_path / "bench.json"
  status = bench_pipeline.main(["--preset", "tiny", "--compare", "diffusers", "--steps", "2", "--runs", "1",
                           "--max-sequence-length", "32", "--torch-device", "cpu", "--json", str(path)])
  report = json.loads(path.read_text())
  assert status == 0
  for side in ("ours", "diffusers"):
    assert report[side]["load_s"] > 0
    (run,) = report[side]["runs"]
    for stage in bench_pipeline.ROWS[1:]:
      assert isinstance(run[stage], float) and run[stage] >= 0, (side, stage, run.get(stage))
    assert len(run["step_times"]) == 2 and run["denoise_step_min"] <= run["denoise_step_median"]
    assert run["total"] >= run["denoise"] + run["decode"]
  assert report["ours"]["runs"][0]["compile"] > 0 and report["diffusers"]["runs"][0]["compile"] == 0
  assert set(report["ratios"]) == set(bench_pipeline.ROWS) and report["ratios"]["compile"] is None
  # Same weights, latents and settings: the two pipelines make the same video.
  check_psnr(report["agreement"]["psnr_mean_db"], FP32_VIDEO_PSNR_DB, "ours vs diffusers mean PSNR")


def test_benchmark_cold_steps_compile_once(tmp_path):
  """--cold-steps: run 1 takes 1 step and compiles every program; the warm run's 3 steps compile
  nothing (the solver's tables have one padded length for both counts)."""
  path = tmp_path / "bench.json"
  assert bench_pipeline.main(["--preset", "tiny", "--steps", "3", "--cold-steps", "1", "--runs", "2",
                              "--max-sequence-length", "32", "--json", str(path)]) == 0
  ours = json.loads(path.read_text())["ours"]
  cold, warm = ours["runs"]
  assert (len(cold["step_times"]), len(warm["step_times"])) == (1, 3)
  assert cold["compile"] > 0 and warm["compile"] < 0.05 * cold["compile"]
  # the step's rate: estimate.step_flops of the tiny preset over the warm run's median step (no chip: no MFU)
  assert ours["step_flops"] > 0 and warm["step_mfu"] is None
  assert warm["step_tflops_per_s"] * 1e12 == pytest.approx(ours["step_flops"] / warm["denoise_step_median"])


def test_benchmark_usage_errors_exit_2(capsys):
  assert bench_pipeline.main(["--aot", "v6e:2x4", "--compare", "diffusers"]) == 2
  assert bench_pipeline.main(["--runs", "0"]) == 2
  assert bench_pipeline.main(["--mesh", "X=2"]) == 2
  assert bench_pipeline.main(["--aot", "v6e:2x4", "--aot-models", "7b"]) == 2
  assert bench_pipeline.main(["--cold-steps", "1", "--runs", "1"]) == 2
  assert capsys.readouterr().err.count("error:") == 5


# --- AOT (the same code path on CPU devices: no libtpu needed) -----------------------------------

def test_aot_default_degrees():
  assert aot_step.default_degrees(8, 12) == (4, 2)
  assert aot_step.default_degrees(8, 40) == (8, 1)
  assert aot_step.default_degrees(4, 2) == (2, 2)


def test_aot_compile_denoise_step_on_cpu_mesh():
  report = aot_step.compile_denoise_step(jax.devices()[:4], preset="tiny", height=48, width=80, frames=9,
                                    dtype="bfloat16", text_len=16, flow_shift=3.0,
                                    mesh_spec=MeshSpec(ulysses=2, ring=2))
  assert report["mesh"]["spec"] == "U=2,R=2" and report["tokens"] == 45
  assert report["memory_analysis"]["argument_size_in_bytes"] > 0
  # Held: every argument (jit drops the cross-attention to_k / to_v the step does not read with the
  # text K/V held, but the pipeline keeps them), so at least the weights plus the text K/V.
  assert report["resident_bytes_per_device"] >= report["arguments_bytes_per_device"] > (
      report["weights_bytes_per_device"] + report["text_bytes_per_device"])
  assert report["memory_analysis"]["argument_size_in_bytes"] < report["arguments_bytes_per_device"]
  # Every layer's self-attention (scanned: one body) exchanges over Ulysses and permutes over ring.
  assert report["collectives"]["all-to-all"]["count"] >= 2
  assert report["collectives"]["collective-permute"]["count"] >= 1
  assert "failed" not in aot_step.format_row(report) and "NOT a runtime" in aot_step.format_header("cpu")


def test_aot_image_to_video_and_ti2v_steps_lower():
  """The I2V (36 input channels, CLIP image tokens' K/V held with the text's, or made in the step)
  and TI2V (per-token timesteps, 16x latents) step arguments fit the step: traced and lowered on a
  U=2,R=2 CPU mesh. The held K/V are [Z, 2, L (+ P), N, H] x 2 in the model dtype."""
  import dataclasses

  from pipelines.wan.transformer import PRESETS

  tiny = dataclasses.replace(PRESETS["tiny"], num_layers=1)
  i2v = dataclasses.replace(tiny, in_channels=36, image_dim=24, added_kv_proj_dim=tiny.dim)
  flf2v = dataclasses.replace(i2v, pos_embed_seq_len=2 * 257)
  ti2v = dataclasses.replace(tiny, in_channels=48, out_channels=48)
  kw = dict(frames=9, dtype="bfloat16", text_len=16, flow_shift=3.0, mesh_spec=MeshSpec(ulysses=2, ring=2),
            lower_only=True)
  kv = 2 * 1 * 2 * tiny.dim * 2  # K and V x Z x [cond; uncond] x D x bf16, per token
  for config, image_tokens in ((tiny, 0), (i2v, 257), (flf2v, 514)):
    report = aot_step.compile_denoise_step(jax.devices()[:4], preset=config, height=48, width=80, **kw)
    assert report["tokens"] == 45 and report["text_bytes_per_device"] == kv * (16 + image_tokens)
  every = aot_step.compile_denoise_step(jax.devices()[:4], preset=i2v, height=48, width=80, text_kv_once=False, **kw)
  assert every["text_bytes_per_device"] == 2 * 16 * tiny.text_dim * 2  # the text states
  report = aot_step.compile_denoise_step(jax.devices()[:4], preset=ti2v, height=96, width=160, ti2v=True, **kw)
  assert report["latent_shape"] == [1, 48, 3, 6, 10] and report["tokens"] == 45
