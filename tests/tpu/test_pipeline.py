"""The embedded tiny default (`WanPipeline.tiny()`, the README's "a red square moving right" at its
preset: 64x64 x 17 frames, 8 steps, shift 3, guidance 2, seed 0) on the TPU against the CPU's fp32.

The acceptance bars are 60 dB PSNR for the fp32 video on the TPU against the CPU's (the quality
check's fp32 bar for trained content) and 35 dB for the bf16 video on the TPU against the CPU's fp32
(its bf16 bar). fp32 is held here to the suite's bar for two fp32 runs of the pipeline,
`FP32_VIDEO_PSNR_DB` (80 dB), which the TPU's default precision (one bf16 pass per fp32 matmul)
misses: measured on a v5e (JAX 0.10.2), fp32 at the default precision 65.6 dB, at "highest"
(`precision.matmul_precision`) 116.7 dB; bf16 62.9 dB with its fp32 VAE at the default precision,
64.9 dB at "highest".

The CPU reference runs in a child process with JAX_PLATFORMS=cpu: a pipeline places its weights and
states on `jax.devices()[0]` (the TPU in this process, whatever `jax.default_device` says), so
inside this process its stages could not all be sent to the CPU. The child asserts its backend and
reports its devices.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from pipelines import WanPipeline
from pipelines.commands.presets import PRESETS
from tests.harness import REPO_ROOT, child_env
from tests.numerics import FP32_VIDEO_PSNR_DB, assert_psnr_at_least
from tests.tpu.backends import assert_on

pytestmark = pytest.mark.tpu

PROMPT = "a red square moving right"
_PRESET = PRESETS["tiny"]
CALL = dict(height=_PRESET.height, width=_PRESET.width, num_frames=_PRESET.frames,
            num_inference_steps=_PRESET.steps, flow_shift=_PRESET.shift, guidance_scale=_PRESET.guidance[0], seed=0)
FP32_MIN_DB = FP32_VIDEO_PSNR_DB  # >= the acceptance bar of 60 dB
BF16_MIN_DB = 35.0

_CHILD = """
import json, sys
import jax, numpy as np
from pipelines import WanPipeline
prompt, call, path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
assert jax.default_backend() == "cpu", jax.default_backend()
np.save(path, WanPipeline.tiny("float32")(prompt, **call, progress=False))
print(json.dumps({"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()]}))
"""


@pytest.fixture(scope="module")
def cpu_fp32(tmp_path_factory) -> np.ndarray:
  """The fp32 video [1, 17, 64, 64, 3] of the tiny default computed by a CPU-only child process."""
  path = tmp_path_factory.mktemp("cpu_reference") / "video.npy"
  done = subprocess.run([sys.executable, "-c", _CHILD, PROMPT, json.dumps(CALL), str(path)], cwd=REPO_ROOT,
                        env=child_env(), capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, f"the CPU reference failed:\n{done.stderr[-4000:]}"
  ran = json.loads(done.stdout.strip().splitlines()[-1])
  assert ran["backend"] == "cpu" and all("cpu" in d.lower() for d in ran["devices"]), ran
  return np.load(path)


def _tpu_video(dtype: str) -> np.ndarray:
  pipe = WanPipeline.tiny(dtype)
  result = pipe.run(PROMPT, **CALL, progress=False)
  assert_on(pipe.weights.experts[0], "tpu", f"the {dtype} pipeline's transformer")
  assert result.frames.shape == (1, CALL["num_frames"], CALL["height"], CALL["width"], 3)
  return result.frames


def test_fp32_video_on_the_tpu_is_the_cpus(cpu_fp32):
  assert_psnr_at_least(_tpu_video("float32"), cpu_fp32, FP32_MIN_DB, name="tiny fp32 TPU vs CPU")


def test_bf16_video_on_the_tpu_is_near_the_cpus_fp32(cpu_fp32):
  assert_psnr_at_least(_tpu_video("bfloat16"), cpu_fp32, BF16_MIN_DB, name="tiny bf16 TPU vs CPU fp32")
