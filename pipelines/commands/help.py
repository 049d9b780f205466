"""What every command line of this project shares: the `--help` layout and how warnings are shown.

(The mesh notation, "U=2,R=2" / "CFG=2,U=2,R=2", is `attention.MeshSpec`'s: parsed, printed and
checked there only.) Imports no JAX.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator

# The project's own code: its warnings name its arguments (`warnings_as_lines(words=...)`).
_PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """`--help` with the description printed as written (examples keep their lines) and every
  option's default appended as " (default: X)".

  Like argparse's ArgumentDefaultsHelpFormatter, except that a help text that already names its
  default, an option whose default is None or an empty list (its help says "(default: ...)" in
  words instead of "None" or "[]") and an on/off flag are left as written.
  """

  def _get_help_string(self, action: argparse.Action) -> str:
    text = action.help or ""
    if ("default" in text or action.default in (None, []) or action.default is argparse.SUPPRESS
        or action.nargs == 0 or not action.option_strings):
      return text
    return f"{text} (default: %(default)s)" if text else "default: %(default)s"


@contextlib.contextmanager
def warnings_as_lines(prog: str, words: Callable[[str], str] | None = None) -> Iterator[list[str]]:
  """Inside, each Python warning that would be shown prints as one line `PROG: warning: MESSAGE`
  on stderr (no file path, no source line); yields the list of those messages, in order.

  Args:
    words: rewrites the messages of this project's own warnings (raised from its `pipelines`
      code), which name Python arguments, in the command's words (`generate`: `cli.flags.in_flags`,
      "context_frames=17" -> "--context-frames 17"); other libraries' warnings are shown as they are.

  Only how warnings are shown changes, not which are shown (the warnings filters are kept), and
  everything is restored on exit.
  """
  seen: list[str] = []

  def show(message, category, filename, lineno, file=None, line=None):
    del category, lineno, file, line
    text = str(message)
    if words is not None and os.path.abspath(filename).startswith(_PROJECT):
      text = words(text)
    seen.append(text)
    print(f"{prog}: warning: {text}", file=sys.stderr, flush=True)

  with warnings.catch_warnings():
    warnings.showwarning = show
    yield seen
