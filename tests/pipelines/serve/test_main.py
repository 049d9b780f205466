"""Tests for pipelines/serve/main.py: the `serve` command refuses bad flags (exit status 2, the
message naming the fix) before any model is loaded or a server started."""

from __future__ import annotations

import pytest

from pipelines.serve.service import Service


@pytest.mark.parametrize("argv,words", [
    (["--warmup", "64x64"], "--warmup '64x64' is malformed"),
    (["--warmup", "33x32x5"], "width=33 must be a positive multiple of 16"),
    (["--mesh", "U=16"], "--mesh U=16"),
    (["--lora", "no-path-given"], "NAME=PATH"),
    (["--lora", "fox=/no/such.safetensors"], "is not a file or folder"),
    (["--max-batch", "0"], "--max-batch 0 must be an int >= 1"),
    (["--api-key", "short"], "at least 8 characters"),
])
def test_serve_command_refuses_bad_flags_before_loading(argv, words, capsys, monkeypatch):
  import uvicorn

  from pipelines.serve.main import main

  def started(*args, **kwargs):
    raise AssertionError(f"serve {argv} started instead of refusing")

  monkeypatch.setattr(Service, "start", started)
  monkeypatch.setattr(uvicorn, "run", started)
  assert main(argv) == 2
  assert words in capsys.readouterr().err
