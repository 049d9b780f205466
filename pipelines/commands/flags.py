"""What both commands' command lines share (`generate`, pipelines/cli; `serve`, pipelines/serve):
`UsageError`, the parser of a LoRA's PATH[:SCALE] (`parse_lora_arg`) and --decode-compile-effort
(`add_decode_effort_flag`). Imports no JAX.
"""

from __future__ import annotations

import argparse
import math
import os


class UsageError(ValueError):
  """A command-line argument that cannot work; the message says what to do instead."""


def add_decode_effort_flag(p: argparse.ArgumentParser) -> None:
  """--decode-compile-effort E: `CallOptions.decode_compile_effort` (checked by `vae.check_compile_effort`)."""
  def effort(text: str) -> float:
    from pipelines.wan.vae import check_compile_effort

    try:
      return check_compile_effort(float(text), "tpu")
    except ValueError:
      raise argparse.ArgumentTypeError(f"must be a number in [-1, 1], got {text!r}") from None

  p.add_argument("--decode-compile-effort", type=effort, default=None, metavar="E",
                 help="XLA's optimization effort in [-1, 1] for the VAE decoder's programs (default: -0.5 on "
                      "TPU, a ~4x faster compile for a decode ~9-19%% slower by libtpu's estimate; JAX's own "
                      "setting elsewhere); 0 suits a long-lived server")


def parse_lora_arg(text: str, flag: str = "--lora") -> tuple[str, float]:
  """`PATH[:SCALE]` -> (path, scale); SCALE defaults to 1 (a path holding ':' keeps it when what
  follows the last ':' is not a number).

  Raises:
    UsageError: no such file or folder, or a scale that is not finite.
  """
  path, scale = text, 1.0
  head, sep, tail = text.rpartition(":")
  if sep:
    try:
      path, scale = head, float(tail)
    except ValueError:
      pass
  if not math.isfinite(scale):
    raise UsageError(f"{flag} {text!r}: the scale {tail!r} must be a finite number (1: as trained)")
  if not os.path.exists(path):
    raise UsageError(f"{flag} {text!r}: {path!r} is not a file or folder; pass a LoRA .safetensors "
                     "file (or its folder), optionally with :SCALE")
  return path, scale


def parse_prompts_at(values: list[str], flag: str = "--stream-prompt") -> dict[int, str]:
  """A stream's later prompts, CHUNK:PROMPT values (generate's --stream-prompt, serve's prompt_at)
  -> {0-based chunk: prompt}.

  Raises:
    UsageError: a value without a chunk number >= 2 (chunk 1's prompt is the prompt) or an empty prompt.
  """
  out = {}
  for value in values:
    head, _, prompt = value.partition(":")
    if not head.strip().isdigit() or int(head) < 2 or not prompt.strip():
      raise UsageError(f"{flag} {value!r}: give CHUNK:PROMPT with CHUNK >= 2 (chunk 1 takes the prompt), "
                       f"e.g. {flag} '3:a blue circle moving up'")
    out[int(head) - 1] = prompt.strip()
  return out
