"""Every measuring tool under end_to_end/ starts (`python -m <module> --help` exits 0), every
`python -m end_to_end.<module>` the repository names is one of them, and the folder stays organised by
purpose (end_to_end/README.md, Layout).

The commands are found by reading the source (`tests.harness.end_to_end_commands`), so a new one is
covered without a change here.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import re
import subprocess
import sys

from tests.harness import REPO_ROOT, child_env, end_to_end_commands

MAX_TOP_LEVEL_MODULES = 12
# Where `python -m end_to_end.<module>` is written for people to run: docs, docstrings, help texts,
# messages, scripts (the tests run the names they use, and name missing ones as positive controls).
NAMED_IN = ("*.md", "docs/**/*.md", "end_to_end/**/*.md", "end_to_end/**/*.sh", "pyproject.toml",
            *(f"{top}/**/*.{ext}" for top in ("attention", "producers", "pipelines", "end_to_end")
              for ext in ("py", "json")))


def _help(module: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO_ROOT, env=child_env(),
                        capture_output=True, text=True, timeout=300)


def test_every_command_prints_its_help():
  commands = end_to_end_commands()
  # The discovery finds commands in every purpose folder, and no library.
  assert {"end_to_end.plan", "end_to_end.quality.check", "end_to_end.bench.pipeline", "end_to_end.aot.text",
          "end_to_end.serve.load", "end_to_end.train.tiny"} <= set(commands), commands
  assert not {"end_to_end.bench.presets", "end_to_end.quality.video_metrics"} & set(commands), commands
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    done = dict(zip(commands, pool.map(_help, commands)))
  failed = {m: (p.returncode, p.stderr[-1500:]) for m, p in done.items() if p.returncode != 0}
  assert not failed, failed
  empty = [m for m, p in done.items() if "usage:" not in p.stdout]
  assert not empty, f"--help printed no usage line: {empty}"


def _stale_names(root: pathlib.Path, commands: set[str]) -> list[str]:
  """Every `python -m end_to_end.<module>` written under `root` (NAMED_IN) that is not a command."""
  stale = set()
  for pattern in NAMED_IN:
    for path in root.glob(pattern):
      for name in re.findall(r"python -m (end_to_end(?:\.\w+)+)", path.read_text(encoding="utf-8")):
        if name not in commands:
          stale.add(f"{path.relative_to(root)}: python -m {name}")
  return sorted(stale)


def test_every_named_command_exists(tmp_path):
  """A renamed or removed command leaves no `python -m end_to_end.<module>` behind that would fail."""
  commands = set(end_to_end_commands())
  stale = _stale_names(pathlib.Path(REPO_ROOT), commands)
  assert not stale, "\n".join(stale)
  # Positive control: an old flat name in a doc is found; a current name in a docstring is not.
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs" / "usage.md").write_text("`python -m end_to_end.quality --matrix`\n")
  (tmp_path / "pipelines").mkdir()
  (tmp_path / "pipelines" / "flags.py").write_text('"""see python -m end_to_end.quality.check"""\n')
  assert _stale_names(tmp_path, commands) == ["docs/usage.md: python -m end_to_end.quality"]


def test_end_to_end_is_organised_by_purpose():
  top = sorted(name for name in os.listdir(os.path.join(REPO_ROOT, "end_to_end"))
               if name.endswith(".py") and name != "__init__.py")
  assert len(top) <= MAX_TOP_LEVEL_MODULES, (
      f"{len(top)} modules at end_to_end/'s top level ({top}); at most {MAX_TOP_LEVEL_MODULES}: put a new "
      f"tool in the folder of its purpose (aot/, bench/, quality/, serve/, train/)")


NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
           "sixteen seventeen eighteen nineteen twenty twenty-one twenty-two twenty-three twenty-four").split()


def _counted(text: str) -> list[int]:
  """Every count of commands the text gives in words ("Nineteen commands", "all nineteen")."""
  words = "|".join(sorted(NUMBERS, key=len, reverse=True))  # "twenty-one" before "twenty"
  found = re.findall(rf"\b({words}) commands\b|\ball ({words})\b", text, flags=re.IGNORECASE)
  return [NUMBERS.index((a or b).lower()) for a, b in found]


def test_the_docs_count_the_commands():
  """end_to_end/README.md (and docs/performance.md, which points at it) say how many commands there
  are: a new or removed command updates the count."""
  commands = len(end_to_end_commands())
  for page in ("end_to_end/README.md", "docs/performance.md"):
    with open(os.path.join(REPO_ROOT, page), encoding="utf-8") as f:
      counts = _counted(f.read())
    assert counts and set(counts) == {commands}, (page, counts, commands)
  assert _counted("Eighteen commands that measure; all twelve") == [18, 12]  # the reader's control
  assert _counted("Twenty-one commands; all twenty-one; all twenty") == [21, 21, 20]

