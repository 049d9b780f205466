"""The VAE decoder's XLA optimization effort as a generation sets it (`CallOptions.decode_compile_effort`,
default: `vae.decode_compile_effort` of the platform, -0.5 on TPU for a ~4x faster compile): the
option reaches the decoder's programs, leaves the video as it is, is recorded with the video, and a
bad value fails at once."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines import WanPipeline
from pipelines.pipeline.run.call_options import CallOptions
from pipelines.pipeline.checked.request import GenerationRequest
from pipelines.wan.vae import effort as vae_effort, model as V


@pytest.mark.parametrize("bad", [2, -1.5, True, "low", float("nan"), float("inf")])
def test_a_bad_effort_fails_when_the_options_are_made(bad):
  with pytest.raises(ValueError, match=r"compile_effort=.* must be a number in \[-1, 1\]"):
    CallOptions(decode_compile_effort=bad)


def test_an_explicit_effort_is_applied_and_none_is_the_platforms():
  assert vae_effort.check_compile_effort(np.float32(-0.5), "cpu") == -0.5  # any real number
  assert vae_effort.check_compile_effort(None, "tpu") == vae_effort.TPU_DECODE_COMPILE_EFFORT
  assert vae_effort.check_compile_effort(None, "cpu") is None  # JAX's own setting there
  # an explicit 0 compiles with the option set (JAX's global setting does not apply), None without
  assert V._chunk_programs(0.0) is not V._chunk_programs(None)
  assert V._chunk_programs(-0.0) is V._chunk_programs(0.0)
  with pytest.raises(ValueError, match="on_stage=5 must be None or a callable"):
    CallOptions(on_stage=5)


def test_the_recorded_effort_on_a_jax_without_the_global_setting(monkeypatch):
  """JAX 0.11 has no `jax_exec_time_optimization_effort`: a video's settings then record XLA's
  default 0 (on an H200 with JAX 0.11.2 every generation failed at its end reading it)."""
  import types

  import jax
  assert vae_effort.effective_compile_effort(-0.25, "cpu") == -0.25
  monkeypatch.setattr(jax, "config", types.SimpleNamespace())
  assert vae_effort.effective_compile_effort(None, "cpu") == 0.0
  monkeypatch.setattr(jax, "config", types.SimpleNamespace(jax_exec_time_optimization_effort=0.5))
  assert vae_effort.effective_compile_effort(None, "cpu") == 0.5


def test_the_effort_reaches_the_decoder_and_keeps_the_video():
  pipe = WanPipeline.tiny(random=True)
  request = GenerationRequest.build(pipe.facts, "a red square", height=32, width=32, num_frames=5,
                                    num_inference_steps=2, seed=0, max_sequence_length=16)
  default = pipe.generate(request, CallOptions(progress=False))
  later = V._chunk_programs(-0.25).later
  before = later._cache_size()
  low = pipe.generate(request, CallOptions(progress=False, decode_compile_effort=-0.25))
  assert later._cache_size() == before + 1  # the -0.25 programs decoded this video
  assert default.frames.std() > 0.01  # a video, not a constant
  assert low.settings["decode_compile_effort"] == -0.25 and default.settings["decode_compile_effort"] == 0.0
  # fp32 decode, values in [0, 1]: another XLA effort may only fuse differently (rounding).
  np.testing.assert_allclose(low.frames, default.frames, rtol=0, atol=1e-5)


def test_generate_and_serve_flags(capsys):
  from pipelines.cli.flags import build_parser
  from pipelines.serve import options

  assert build_parser().parse_args(["--decode-compile-effort", "0"]).decode_compile_effort == 0.0
  assert build_parser().parse_args([]).decode_compile_effort is None
  assert options.parse(["--decode-compile-effort", "-0.5"]).decode_compile_effort == -0.5
  for bad in ("3", "nan", "abc"):
    with pytest.raises(SystemExit):
      build_parser().parse_args(["--decode-compile-effort", bad])
    assert f"--decode-compile-effort: must be a number in [-1, 1], got '{bad}'" in capsys.readouterr().err
  with pytest.raises(options.UsageError, match="--decode-compile-effort: compile_effort=5"):
    options.ServeConfig(decode_compile_effort=5)
