"""Tests for pipelines/pipeline/run/precision.py: which matmul precision each stage of a call runs under.

On the CPU "highest" is what fp32 matmuls do already, so these tests read the setting where the
stages run (stage hooks, the VAE's decode, the compiled programs' HLO) and check that the CPU's
video is unchanged; tests/tpu/test_pipeline.py measures what it changes on a TPU.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from pipelines import WanPipeline
from pipelines.pipeline.run import decoding, precision
from pipelines.pipeline.run.call_options import CallOptions
from pipelines.pipeline.checked.request import GenerationRequest
from pipelines.wan import vae as wan_vae

CALL = dict(height=32, width=32, num_frames=5, num_inference_steps=1, max_sequence_length=16, seed=0,
            progress=False)
PROMPT = "a red square"


@pytest.fixture(scope="module")
def pipes():
  return {dtype: WanPipeline.tiny(dtype, random=True) for dtype in ("float32", "bfloat16")}


def _setting() -> str | None:
  return jax.config.jax_default_matmul_precision


def test_float32_asks_for_highest_and_nothing_else_does():
  assert _setting() is None  # control: the suite sets no default
  for dtype in ("float32", np.float32, jax.numpy.float32):
    with precision.matmul_precision(dtype):
      assert _setting() == "highest"
    assert _setting() is None
  for dtype in ("bfloat16", jax.numpy.bfloat16, "float16"):
    with precision.matmul_precision(dtype):
      assert _setting() is None
  with jax.default_matmul_precision("bfloat16"):  # a caller's own choice wins
    with precision.matmul_precision("float32"):
      assert _setting() == "bfloat16"
  with pytest.raises(TypeError):
    precision.matmul_precision("not-a-dtype")


def _stage_settings(pipe: WanPipeline, monkeypatch: pytest.MonkeyPatch) -> dict[str, str | None]:
  """The matmul precision in effect as each stage of one call starts, and inside the VAE decode."""
  seen: dict[str, str | None] = {}
  decode = wan_vae.decode

  def recording_decode(*args, **kwargs):
    seen["vae_decode"] = _setting()
    return decode(*args, **kwargs)

  monkeypatch.setattr(wan_vae, "decode", recording_decode)
  call = {k: v for k, v in CALL.items() if k != "progress"}
  request = GenerationRequest.build(pipe.facts, PROMPT, **call)
  pipe.generate(request, CallOptions(progress=False, on_stage=lambda name: seen.setdefault(name, _setting())))
  # The decoder's compile-ahead thread compiles programs lowered in the call's thread (and context:
  # test_the_compiled_programs_carry_the_precision); the thread's own setting is not the call's.
  seen.pop("decode_compile_ahead", None)
  return seen


def test_a_float32_call_runs_every_stage_at_highest(pipes, monkeypatch):
  seen = _stage_settings(pipes["float32"], monkeypatch)
  assert {"text_encode", "compile", "denoise", "vae_decode"} <= set(seen)
  assert set(seen.values()) == {"highest"}, seen


def test_a_bfloat16_call_changes_nothing_but_its_float32_vae(pipes, monkeypatch):
  """The bf16 pipeline's transformer and text encoder stages run at the platform default; its
  VAE is float32 (the tiny models'), so the decode runs at "highest"."""
  seen = _stage_settings(pipes["bfloat16"], monkeypatch)
  assert pipes["bfloat16"].vae.dtype == jax.numpy.float32
  assert seen.pop("vae_decode") == "highest"
  assert {"text_encode", "compile", "denoise"} <= set(seen)
  assert set(seen.values()) == {None}, seen
  assert _setting() is None  # nothing left behind


def _dot_precisions(pipe: WanPipeline) -> list[str]:
  """The operand precision of every dot in the pipeline's compiled step programs ("" when default)."""
  text = "\n".join(program.as_text() for program in pipe.compiled_steps.programs())
  dots = [line for line in text.splitlines() if re.search(r"= \S+ dot\(", line)]
  return [m.group(1) if (m := re.search(r"operand_precision=\{(\w+)", line)) else "" for line in dots]


def test_the_compiled_programs_carry_the_precision(pipes):
  """What reaches XLA: every dot of the fp32 step says "highest", none of the bf16 step's; every
  convolution and dot of the (fp32) VAE decoder lowered ahead says HIGHEST."""
  for pipe in pipes.values():
    pipe(PROMPT, **CALL, output_type="latent")
  fp32, bf16 = _dot_precisions(pipes["float32"]), _dot_precisions(pipes["bfloat16"])
  assert fp32 and bf16  # control: the regex finds the dots
  assert set(fp32) == {"highest"} and set(bf16) == {""}, (set(fp32), set(bf16))
  for program in decoding.lower_decoder(pipes["bfloat16"].weights, (1, 16, 2, 4, 4)).values():
    ops = [line for line in program.as_text().splitlines()
           if re.search(r"stablehlo\.(convolution|dot_general)", line)]
    assert ops and all("HIGHEST" in line for line in ops)


def test_the_cpu_video_is_what_it_was(pipes):
  """On the CPU "highest" is what fp32 already computes: the fp32 video equals, bit for bit, the
  same call inside the caller's `jax.default_matmul_precision("default")` (which the pipeline
  keeps: the program before this change) -- a different compiled program (control)."""
  pipe = pipes["float32"]
  ours = pipe(PROMPT, **CALL)
  traces = pipe.compiled_steps.traces
  with jax.default_matmul_precision("default"):
    before = pipe(PROMPT, **CALL)
  assert pipe.compiled_steps.traces == traces + 1
  np.testing.assert_array_equal(ours, before)
