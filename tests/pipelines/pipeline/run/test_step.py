"""Tests for pipelines/pipeline/run/step.py's text K/V programs, as few-step (distilled) Wan runs them:
CFG-free steps (guidance 1: one transformer pass of B rows), the text's cross-attention K/V computed
once per (prompt, expert) before the loop (`CompiledSteps.text_kv`); and the CFG mesh refused
without guidance (same tiny pipeline). The distilled preset and the schedule flags of `generate`:
tests/pipelines/commands/test_presets.py and tests/pipelines/cli/test_run_plan.py.

Text K/V once (`transformer.text_kv`, `Runner._text`): the same latents, bit for bit, as computing
them inside every step (`CallOptions(text_kv_once=False)`), on one device and on a U=2,R=2 mesh,
with no collective added; computed again when a callback replaces the text states.

Bit-identical, not close: the precompute runs the same XLA ops on the same values as the in-step
computation (text embedder, to_k + RMSNorm, to_v, in a layer scan), and neither program fuses them
with anything that reorders a sum, so equality is the property (measured: equal on every mesh).
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from pipelines import WanPipeline
from pipelines.pipeline.run import step as step_module
from pipelines.pipeline.run.call_options import CallOptions
from pipelines.pipeline.checked.request import GenerationRequest
from pipelines.pipeline.run.step import CompiledSteps

KW = dict(height=32, width=32, num_frames=5, num_inference_steps=3, seed=3, max_sequence_length=16,
          decode=False)
DIM = 128  # the tiny transformer's D = 8 heads x 16
COLLECTIVES = ("all-to-all", "collective-permute", "all-reduce", "all-gather", "reduce-scatter")


@pytest.fixture(scope="module")
def tiny():
  pipe = WanPipeline.tiny(random=True)
  pipe.set_progress_bar_config(disable=True)
  return pipe


def _counting(monkeypatch) -> list:
  calls = []
  original = CompiledSteps.text_kv

  def text_kv(self, *args, **kwargs):
    calls.append(1)
    return original(self, *args, **kwargs)

  monkeypatch.setattr(CompiledSteps, "text_kv", text_kv)
  return calls


def _collectives(hlo: str) -> dict[str, int]:
  return {name: len(re.findall(rf"\b{name}(-start)?\(", hlo)) for name in COLLECTIVES}


def _rows(hlo: str, tokens: int) -> set[int]:
  """The leading (batch) sizes of the [rows, tokens, D] token activations in a compiled program
  (per-device shapes: `tokens` is T / (U R))."""
  return {int(m) for m in re.findall(rf"\[(\d+),{tokens},{DIM}\]", hlo)}


@pytest.mark.parametrize("mesh,guidance", [(None, 1.0), ("U=2,R=2", 4.0)])
def test_text_kv_once_equals_recomputing_every_step(tiny, mesh, guidance, monkeypatch):
  calls = _counting(monkeypatch)
  request = GenerationRequest.build(tiny.facts, "a red square", "blurry", mesh=mesh, guidance_scale=guidance,
                                    **KW)
  once = tiny.generate(request, CallOptions(progress=False))
  assert len(calls) == 1, f"text K/V computed {len(calls)} times for {request.steps} steps"
  every = tiny.generate(request, CallOptions(progress=False, text_kv_once=False))
  assert len(calls) == 1  # the in-step path computes none before the loop
  np.testing.assert_array_equal(once.latents, every.latents)
  assert np.abs(once.latents - request.noise()).max() > 0.1  # the steps ran and moved the latents

  programs = tiny.compiled_steps.programs()
  with_kv, without_kv = programs[-2].as_text(), programs[-1].as_text()
  assert _collectives(with_kv) == _collectives(without_kv)  # no collective added to the step
  # CFG-free steps: with guidance 1 every activation of the step has the B = 1 row of the video, no
  # doubled [cond; uncond] batch; under guidance (the positive control) they have 2 B rows.
  tokens = request.tokens // request.plan.spec.devices if mesh else request.tokens
  assert _rows(with_kv, tokens) == ({1} if guidance == 1 else {2}), _rows(with_kv, tokens)
  if mesh is not None:
    assert _collectives(with_kv)["all-to-all"] > 0  # positive control: the counter sees USP's
    params = tiny.weights.experts[0]
    text = jax.numpy.zeros((2, 16, tiny.transformer_config.text_dim), tiny.dtype)
    kv_program = jax.jit(step_module.text_kv_states, static_argnums=0, static_argnames="plan").lower(
        tiny.compiled_steps.graphdef, params, text,
        plan=request.plan).compile().as_text()
    assert sum(_collectives(kv_program).values()) == 0, _collectives(kv_program)


def test_text_kv_follows_a_callback_that_replaces_the_prompt(tiny, monkeypatch):
  """Positive control of the reuse: a callback that halves the prompt's text states after step 0
  gets new K/V from step 1 on (computed twice), the same latents as recomputing every step, and
  other latents than without the callback."""
  def halve(pipe, k, t, kwargs):
    return {"prompt_embeds": kwargs["prompt_embeds"] * 0.5} if k == 0 else {}

  calls = _counting(monkeypatch)
  request = GenerationRequest.build(tiny.facts, "a red square", guidance_scale=1.0, **KW)  # programs of [None-1.0]
  options = dict(progress=False, callback=halve, callback_tensor_inputs=("prompt_embeds",))
  once = tiny.generate(request, CallOptions(**options))
  assert len(calls) == 2
  every = tiny.generate(request, CallOptions(**options, text_kv_once=False))
  np.testing.assert_array_equal(once.latents, every.latents)
  plain = tiny.generate(request, CallOptions(progress=False))
  assert np.abs(plain.latents - once.latents).max() > 1e-3


def test_cfg_mesh_without_guidance_names_the_mesh_to_use(tiny):
  with pytest.raises(ValueError, match=r"guidance is off \(guidance_scale <= 1\); use U=2,R=1"):
    GenerationRequest.build(tiny.facts, "a red square", guidance_scale=1.0, mesh="CFG=2,U=2,R=1", **KW)
