"""The test harness's XLA_FLAGS, shared by conftest.py and the tests that start child processes."""

from __future__ import annotations

import os
import re

DEVICE_FLAG = "xla_force_host_platform_device_count"


def child_env(**extra: str) -> dict[str, str]:
  """os.environ for a child process that picks its own device count (generate simulates the
  mesh's devices): XLA_FLAGS without the harness's --xla_force_host_platform_device_count, every
  other flag kept (e.g. --xla_cpu_max_isa, so the child rounds as this process does); JAX_PLATFORMS
  cpu; then `extra`."""
  env = dict(os.environ)
  flags = re.sub(rf"\s*--{DEVICE_FLAG}=\S*", "", env.pop("XLA_FLAGS", "")).strip()
  if flags:
    env["XLA_FLAGS"] = flags
  return {**env, "JAX_PLATFORMS": "cpu", **extra}


def step_compiles(monkeypatch) -> list:
  """Records every denoise-step program compiled while the test runs, by any pipeline (the
  `CompiledSteps` of pipelines built inside `generate` too); returns the list it appends to."""
  from pipelines.pipeline.step import CompiledSteps

  compiled = []
  original = CompiledSteps.get

  def get(self, *args, **kwargs):
    before = self.traces
    program = original(self, *args, **kwargs)
    if self.traces != before:
      compiled.append(program)
    return program

  monkeypatch.setattr(CompiledSteps, "get", get)
  return compiled
