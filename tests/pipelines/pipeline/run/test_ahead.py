"""The VAE decoder's programs compiled ahead, in a background thread from the text encoding on
(`CallOptions.decode_compile_ahead`, `ahead.CompileAhead`): the decode then compiles nothing
(the programs compiled ahead are the ones it calls: one device, a VAE committed to a device, split
along height), the video is the same bit for bit, a failure ahead of time falls back to compiling
at the decode, a failing run does not wait for the thread, which ends on its own, and the compile
cache counts each thread's programs for its own stage."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import numpy as np
import pytest

from tests.harness import REPO_ROOT, child_env

from pipelines import WanPipeline
from pipelines.commands import compile_cache
from pipelines.pipeline.run.call_options import CallOptions
from pipelines.pipeline.run.ahead import CompileAhead
from pipelines.pipeline.run.loop import StepHook
from pipelines.pipeline.checked.request import GenerationRequest

CHUNK_PROGRAMS = ("jit(<lambda>)", "jit(decode_chunk)", "jit(_first_chunk_rows)", "jit(_later_chunk_rows)")


class _Compiles(logging.Handler):
  """(thread name, program) of each XLA compile JAX logs (`jax_log_compiles`)."""

  def __init__(self):
    super().__init__()
    self.seen: list[tuple[str, str]] = []

  def emit(self, record):
    message = record.getMessage()
    if "Finished XLA compilation of " in message:
      program = message.split("Finished XLA compilation of ")[1].split(" in ")[0]
      self.seen.append((threading.current_thread().name, program))


@pytest.fixture
def compiles():
  import jax

  handler = _Compiles()
  logger = logging.getLogger("jax")
  logger.addHandler(handler)
  before = jax.config.jax_log_compiles
  jax.config.update("jax_log_compiles", True)  # global: the context manager's is the calling thread's
  try:
    yield handler
  finally:
    jax.config.update("jax_log_compiles", before)
    logger.removeHandler(handler)


def _generate(pipe, mesh, ahead: bool, effort: float):
  request = GenerationRequest.build(pipe.facts, "a red square", height=48, width=16, num_frames=9,
                                    num_inference_steps=2, seed=3, max_sequence_length=16, mesh=mesh)
  # Each call's own effort: new chunk programs, so nothing another test compiled is reused.
  return pipe.generate(request, CallOptions(progress=False, decode_compile_ahead=ahead, decode_compile_effort=effort))


@pytest.mark.parametrize("mesh, effort, committed", [(None, -0.125, False), (None, -0.3125, True),
                                                     ("U=2", -0.1875, False)])
def test_the_decode_runs_the_programs_compiled_ahead(mesh, effort, committed, compiles):
  import jax

  pipe = WanPipeline.tiny(random=True)
  if committed:  # weights pinned to a device: jit returns the cache committed there too
    pipe.weights.vae = jax.device_put(pipe.weights.vae, jax.devices()[1])
  ahead = _generate(pipe, mesh, True, effort)
  chunk = [(thread, p) for thread, p in compiles.seen if p in CHUNK_PROGRAMS]
  assert len(chunk) == 2 and {thread for thread, _ in chunk} == {"decoder-compile"}, compiles.seen
  assert ahead.timings["decode_compile_ahead"] > 0
  compiles.seen.clear()
  at_decode = _generate(pipe, mesh, False, effort + 0.0625)  # positive control: compiled by the decode
  chunk = [(thread, p) for thread, p in compiles.seen if p in CHUNK_PROGRAMS]
  assert len(chunk) == 2 and {thread for thread, _ in chunk} == {"MainThread"}, compiles.seen
  assert at_decode.timings["decode_compile_ahead"] == 0.0
  assert ahead.frames.std() > 0.01
  np.testing.assert_allclose(ahead.frames, at_decode.frames, rtol=0, atol=1e-5)  # another effort: rounding


def test_the_memory_plan_analyses_the_programs_compiled_ahead(monkeypatch, compiles):
  """Planned as on an accelerator (a device budget): the plan's decode analysis compiles the
  decoder's two programs once, from the lowering the compile-ahead then finds compiled, instead of
  lowering and compiling programs of its own (`vae.decode_memory`); without compile-ahead it still
  does (positive control). Both analyses give the same bytes."""
  from pipelines.pipeline.run import decoding, memory_plan
  from pipelines.wan import vae as wan_vae

  own = []
  real = wan_vae.decode_memory
  monkeypatch.setattr(wan_vae, "decode_memory", lambda *a, **k: own.append(a[1:]) or real(*a, **k))
  monkeypatch.setattr(memory_plan, "device_budget", lambda device=None: 64 * 2 ** 30)
  pipe = WanPipeline.tiny(random=True)
  ahead = _generate(pipe, None, True, -0.4375)
  chunk = [(thread, p) for thread, p in compiles.seen if p in CHUNK_PROGRAMS]
  assert own == [] and len(chunk) == 2 and {thread for thread, _ in chunk} == {"MainThread"}, compiles.seen
  at_decode = _generate(pipe, None, False, -0.4375)
  assert own == [(1, 6, 2)]  # B, Hl, Wl of 48 x 16
  np.testing.assert_array_equal(ahead.frames, at_decode.frames)
  shape = (1, 16, 3, 6, 2)
  lowered = decoding.lower_decoder(pipe.weights, shape)
  assert decoding.decode_work_bytes(pipe.weights, shape, None, lowered) == decoding.decode_work_bytes(
      pipe.weights, shape, None) > 0


@pytest.mark.parametrize("committed", [False, True])
def test_a_vae_off_the_device_for_the_loop_comes_back_as_lowered(monkeypatch, committed, compiles):
  """A plan that takes the VAE off the device for the loop (`MemoryPlan.vae_at_denoise`) brings it
  back as it was placed (uncommitted, or committed to its device), so the decode calls the programs
  compiled ahead instead of compiling a pair for the returned VAE (it did: 4 compiles, measured);
  the video is the one of a run that kept the VAE on the device."""
  import dataclasses

  import jax

  from pipelines.pipeline.run import runner

  pipe = WanPipeline.tiny(random=True)
  if committed:
    pipe.weights.vae = jax.device_put(pipe.weights.vae, jax.devices()[1])
  kept = _generate(pipe, None, False, -0.53125)
  real, drops = runner.plan_memory, []
  monkeypatch.setattr(runner, "plan_memory", lambda *a, **k: dataclasses.replace(real(*a, **k), vae_at_denoise=False))
  monkeypatch.setattr(type(pipe.weights), "drop_vae", lambda self, f=type(pipe.weights).drop_vae: drops.append(1) or f(self))
  compiles.seen.clear()
  dropped = _generate(pipe, None, True, -0.5625)
  chunk = [(thread, p) for thread, p in compiles.seen if p in CHUNK_PROGRAMS]
  assert drops == [1] and len(chunk) == 2 and {thread for thread, _ in chunk} == {"decoder-compile"}, compiles.seen
  leaf = jax.tree.leaves(pipe.weights.vae)[0]
  assert leaf.committed == committed and leaf.devices() == {jax.devices()[1 if committed else 0]}
  np.testing.assert_allclose(dropped.frames, kept.frames, rtol=0, atol=1e-5)  # another effort: rounding


def test_programs_lowered_for_another_platform_are_not_analysed(monkeypatch):
  """Where the VAE is not on the planned device's platform (its weights moved to the host by an
  earlier call), the compile-ahead's programs are not that device's: the plan analyses its own."""
  from pipelines.pipeline.run import memory_plan
  from pipelines.wan import vae as wan_vae

  own = []
  real = wan_vae.decode_memory
  monkeypatch.setattr(wan_vae, "decode_memory", lambda *a, **k: own.append(a[1:]) or real(*a, **k))
  monkeypatch.setattr(wan_vae, "platform_of", lambda tree: "elsewhere")
  monkeypatch.setattr(memory_plan, "device_budget", lambda device=None: 64 * 2 ** 30)
  _generate(WanPipeline.tiny(random=True), None, True, -0.4375)
  assert own == [(1, 6, 2)]


def test_the_same_video_bit_for_bit(compiles):
  import jax

  pipe = WanPipeline.tiny(random=True)
  ahead = _generate(pipe, None, True, -0.25)
  jax.clear_caches()  # so that the second run compiles its own programs
  compiles.seen.clear()
  at_decode = _generate(pipe, None, False, -0.25)
  assert {thread for thread, p in compiles.seen if p in CHUNK_PROGRAMS} == {"MainThread"}, compiles.seen
  np.testing.assert_array_equal(ahead.frames, at_decode.frames)


def test_a_failure_ahead_is_kept_and_warned():
  def work():
    raise ZeroDivisionError("no programs")

  job = CompileAhead(work, name="test-compile")
  with pytest.warns(RuntimeWarning, match="test-compile.*ZeroDivisionError: no programs"):
    job.join()
  assert job.error is None  # warned once


def test_a_failing_run_does_not_wait_for_the_thread():
  pipe = WanPipeline.tiny(random=True)

  class Boom(StepHook):
    def after_step(self, state):
      raise RuntimeError("step hook failed")

  request = GenerationRequest.build(pipe.facts, "a red square", height=32, width=32, num_frames=5,
                                    num_inference_steps=2, seed=0, max_sequence_length=16)
  with pytest.raises(RuntimeError, match="step hook failed"):  # raised without waiting for the thread
    pipe.generate(request, CallOptions(progress=False, hooks=(Boom(),), decode_compile_effort=-0.375))
  for thread in [t for t in threading.enumerate() if t.name == "decoder-compile"]:
    thread.join(timeout=120)  # it ends on its own
    assert not thread.is_alive()


_FAILING_RUN = """
import threading
from pipelines import WanPipeline
from pipelines.pipeline.run.call_options import CallOptions
from pipelines.pipeline.checked.request import GenerationRequest
pipe = WanPipeline.tiny(random=True)
def on_stage(name):
  if name == "text_encode":
    print("alive:", [t.name for t in threading.enumerate() if t.name == "decoder-compile"], flush=True)
    raise RuntimeError("failed at " + name)
request = GenerationRequest.build(pipe.facts, "x", height=128, width=128, num_frames=17, num_inference_steps=1,
                                  seed=0, max_sequence_length=16)
pipe.generate(request, CallOptions(progress=False, on_stage=on_stage, decode_compile_ahead=True))
"""


def test_a_process_failing_while_the_thread_compiles_keeps_its_exit_status():
  """A daemon thread inside XLA at the interpreter's shutdown aborts the process (exit 134): the
  compile thread is not one, so the failing process ends with Python's own status 1."""
  root = REPO_ROOT
  proc = subprocess.run([sys.executable, "-c", _FAILING_RUN], cwd=root, env={**child_env(), "PYTHONPATH": root},
                        capture_output=True, text=True, timeout=300)
  assert "alive: ['decoder-compile']" in proc.stdout, (proc.stdout, proc.stderr)  # it was compiling
  assert proc.returncode == 1 and "RuntimeError: failed at text_encode" in proc.stderr, (proc.returncode, proc.stderr)


def test_the_cache_counts_each_threads_stage():
  use = compile_cache.CacheUse(path=None)
  use.mark("denoise")
  event = "/jax/compilation_cache/cache_hits"

  def background(mark: str | None):
    if mark:
      use.mark(mark)
    use._count(event)

  for mark in ("decode_compile_ahead", None):  # a thread that never marked counts for the maker's stage
    thread = threading.Thread(target=background, args=(mark,))
    thread.start()
    thread.join()
  use._count(event)
  assert use.stages == {"decode_compile_ahead": {"lookups": 0, "hits": 1, "misses": 0},
                        "denoise": {"lookups": 0, "hits": 2, "misses": 0}}


def test_lowered_ahead_at_a_real_size():
  """Wan 2.1's VAE at 480x832 (latents 60 x 104: no block or device count divides both): the
  programs compiled ahead are the decode's chunk programs for that size (lowered only: nothing is
  allocated)."""
  import jax.numpy as jnp

  from end_to_end.aot.vae import abstract_vae
  from pipelines.wan import vae as V
  from pipelines.wan.vae import VAE_PRESETS

  vae = abstract_vae(VAE_PRESETS["wan2.1"], jnp.bfloat16)
  lowered = V.lower_decode_programs(vae, batch=1, latent_height=60, latent_width=104, devices=None, split=False)
  first, later = (lowered[name].out_info[0] for name in ("first", "later"))
  assert first.shape == (1, 1, 480, 832, 3) and later.shape == (1, 4, 480, 832, 3)
  assert first.dtype == later.dtype == jnp.bfloat16
