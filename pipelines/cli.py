"""What every command line of this project shares: the mesh notation, `--help` layout, and how
warnings are shown.

Imports no JAX, so the end_to_end tools can use it before they ask XLA for fake CPU devices.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import warnings
from collections.abc import Iterator


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """`--help` with the description printed as written (examples keep their lines) and every
  option's default appended as " (default: X)".

  Like argparse's ArgumentDefaultsHelpFormatter, except that a help text that already names its
  default, an option whose default is None (the help says what happens instead) and an on/off flag
  are left as written.
  """

  def _get_help_string(self, action: argparse.Action) -> str:
    text = action.help or ""
    if ("default" in text or action.default is None or action.default is argparse.SUPPRESS
        or action.nargs == 0 or not action.option_strings):
      return text
    return f"{text} (default: %(default)s)" if text else "default: %(default)s"


@contextlib.contextmanager
def warnings_as_lines(prog: str) -> Iterator[list[str]]:
  """Inside, each Python warning that would be shown prints as one line `PROG: warning: MESSAGE`
  on stderr (no file path, no source line); yields the list of those messages, in order.

  Only how warnings are shown changes, not which are shown (the warnings filters are kept), and
  everything is restored on exit.
  """
  seen: list[str] = []

  def show(message, category, filename, lineno, file=None, line=None):
    del category, filename, lineno, file, line
    seen.append(str(message))
    print(f"{prog}: warning: {message}", file=sys.stderr, flush=True)

  with warnings.catch_warnings():
    warnings.showwarning = show
    yield seen


def format_mesh(ulysses: int, ring: int) -> str:
  """(U, R) -> "U=2,R=2", the one mesh notation that every tool prints and reads (`parse_mesh`)."""
  return f"U={ulysses},R={ring}"


def parse_mesh(spec: str) -> tuple[int, int]:
  """Parses "U=2,R=2" (any order, either may be left out: "U=4" means R=1) into (U, R).

  Raises:
    ValueError: a malformed spec (for "AxB", naming the U=...,R=... it probably means), a repeated or
      unknown axis, or a degree < 1.
  """
  grid = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", str(spec))
  if grid is not None:
    a, b = grid.groups()
    meant = f"'U={a},R={b}'" if a == b else f"'U={a},R={b}' or 'U={b},R={a}'"
    raise ValueError(f"mesh {spec=} does not say which degree is which; did you mean {meant}? Name "
                     "them: U is the Ulysses degree, R the ring degree")
  degrees = {}
  for part in str(spec).replace(" ", "").split(","):
    match = re.fullmatch(r"([URur])=(\d+)", part)
    if match is None:
      raise ValueError(f"mesh {spec=} is malformed at {part!r}; write e.g. 'U=2,R=2', 'R=2,U=4' or 'U=4' "
                       "(U: Ulysses degree, R: ring degree)")
    axis, value = match.group(1).upper(), int(match.group(2))
    if axis in degrees:
      raise ValueError(f"mesh {spec=} gives {axis} twice; give each of U and R at most once")
    if value < 1:
      raise ValueError(f"mesh {spec=}: {axis}={value} must be >= 1")
    degrees[axis] = value
  return degrees.get("U", 1), degrees.get("R", 1)
