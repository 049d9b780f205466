"""The flag helpers both commands share (pipelines/commands/flags.py): `--lora PATH[:SCALE]` and
`--decode-compile-effort E`, each refusal naming the flag, the value and the fix."""

from __future__ import annotations

import argparse

import pytest

from pipelines.commands.flags import UsageError, add_decode_effort_flag, parse_lora_arg


def test_lora_path_and_scale(tmp_path):
  path = tmp_path / "fox.safetensors"
  path.write_bytes(b"")
  assert parse_lora_arg(str(path)) == (str(path), 1.0)
  assert parse_lora_arg(f"{path}:0.5") == (str(path), 0.5)
  odd = tmp_path / "a:b"  # a ':' in the path stays when no number follows it
  odd.mkdir()
  assert parse_lora_arg(str(odd)) == (str(odd), 1.0)
  with pytest.raises(UsageError, match=r"--lora-2 .*: the scale 'nan' must be a finite number"):
    parse_lora_arg(f"{path}:nan", "--lora-2")
  with pytest.raises(UsageError, match=r"is not a file or folder; pass a LoRA .safetensors"):
    parse_lora_arg(str(tmp_path / "missing.safetensors:0.5"))


def test_decode_effort_flag_takes_the_range_only():
  parser = argparse.ArgumentParser()
  add_decode_effort_flag(parser)
  assert parser.parse_args([]).decode_compile_effort is None
  assert parser.parse_args(["--decode-compile-effort", "-0.25"]).decode_compile_effort == -0.25
  for bad in ("2", "abc", "nan"):
    with pytest.raises(SystemExit):
      parser.parse_args(["--decode-compile-effort", bad])
