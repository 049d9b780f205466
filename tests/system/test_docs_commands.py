"""Every shell command the user documentation shows is checked: the ```bash blocks of README.md and
docs/**/*.md (the measurement pages in docs/measurements/ too), one test per command, named by its
file and line; a command inside a shell loop is checked as one.

A command of this project (`.venv/bin/generate`, `.venv/bin/serve`, `python -m MODULE`,
`.venv/bin/python -m MODULE`) must answer `--help` with exit status 0, and every flag it uses must
appear in that help: a renamed or removed flag, or a renamed module, fails here at the doc line that
still names it. The modules come from the docs, the console scripts from pyproject.toml, so a rename
in the docs flows through. The README's main job (its first `generate`, on the embedded default) is
run for real. Anything else (set-up, curl against a running server, apt-get) must be listed in
`NOT_RUN` with the reason: a new command nobody listed fails.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib

import pytest

from tests.harness import REPO_ROOT, child_env

DOCS = ["README.md", *sorted(os.path.relpath(p, REPO_ROOT)
                             for p in glob.glob(os.path.join(REPO_ROOT, "docs", "**", "*.md"), recursive=True))]
# Pages whose links are checked besides DOCS (they show no commands to run).
LINKED = ["DESIGN.md", "end_to_end/README.md"]

# Commands the docs show that this test does not check, each with the reason (as `canonical` writes
# them: split into words, comments dropped, each word shlex-quoted).
NOT_RUN = {
    "bash end_to_end/tpu_recipe.sh": "needs a TPU machine (tests/tpu: collected and skipped here)",
    'python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install -e \'.[test]\'':
        "the set-up: installs packages (test_readme_commands_are_what_ci_runs checks it is .ci/run's)",
    "sudo apt-get update && sudo apt-get install -y chromium chromium-driver && .venv/bin/pip install selenium":
        "installs system packages",
    "curl -s localhost:8000/v1/videos -H 'Content-Type: application/json' -d "
    "'{\"prompt\": \"a red square moving right\", \"size\": \"64x64\", \"num_frames\": 17, \"seed\": 1}'":
        "needs a running server (tests/system/test_serve.py checks the API)",
    "curl -s localhost:8000/v1/videos -F 'prompt=a red square moving right' -F size=64x64 -F num_frames=17":
        "needs a running server (the same form as the SDK's: tests/system/test_openai_sdk.py)",
    "curl -s localhost:8000/v1/videos/video_...": "needs a running server and a job id",
    "curl -s localhost:8000/v1/videos/video_.../content -o square.mp4": "needs a running server and a job id",
    "curl -s -X POST localhost:8000/v1/videos/video_.../cancel": "needs a running server and a job id",
    "curl -s -X DELETE localhost:8000/v1/videos/video_...": "needs a running server and a job id",
    "bash end_to_end/gpu_wheels.sh": "downloads wheels from a package index (docs/measurements/gpu.md)",
    "bash end_to_end/gpu_recipe.sh": "needs a GPU machine (docs/measurements/gpu.md)",
}

_ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_SEPARATORS = {"&&", "||", ";", "|"}
# Shell syntax around the commands of a loop: a segment led by one of these is not a command, and
# `do` before a command is dropped (`for seed in 0 1; do python -m ... --seed $seed; done`).
_SHELL_SYNTAX = {"for", "done", "set"}
_PYTHONS = {"python", "python3", ".venv/bin/python", ".venv/bin/python3"}


@dataclasses.dataclass(frozen=True)
class DocCommand:
  """One command of a ```bash block: where it is, its text (continuation lines joined), and the
  heading of the section it is in."""
  path: str
  line: int
  text: str
  section: str

  @property
  def tokens(self) -> list[str]:
    """The words of the command, comments dropped, `;`, `&&`, `||` and `|` words of their own."""
    lexer = shlex.shlex(self.text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, "#"
    return list(lexer)

  @property
  def canonical(self) -> str:
    return " ".join(t if t in _SEPARATORS else shlex.quote(t) for t in self.tokens)


def doc_commands(path: str) -> list[DocCommand]:
  """The commands of the ```bash blocks of `path` (relative to the repository), comment lines left
  out, a line ending in a backslash joined with the next."""
  with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
    lines = f.read().splitlines()
  commands, fence, section, pending, start = [], None, "", "", 0
  for number, line in enumerate(lines, 1):
    stripped = line.strip()
    if stripped.startswith("```"):
      fence = None if fence is not None else stripped[3:].strip()
      continue
    if fence is None:
      if line.startswith("#"):
        section = line.lstrip("#").strip()
      continue
    if fence not in ("bash", "sh", "shell"):
      continue
    if not pending:
      start = number
    if stripped.endswith("\\"):
      pending += stripped[:-1] + " "
      continue
    text, pending = pending + stripped, ""
    if shlex.split(text, comments=True):
      commands.append(DocCommand(path, start, text, section))
  assert not pending, f"{path}: a command ends in a backslash at the end of its block: {pending!r}"
  return commands


ALL_COMMANDS = [c for path in DOCS for c in doc_commands(path)]


@dataclasses.dataclass(frozen=True)
class Program:
  """A command of this project: a console script (`entry`, "module:function") or `python -m module`."""
  name: str
  entry: str | None
  module: str | None
  args: tuple[str, ...]

  def argv(self, *args: str) -> list[str]:
    """The same program run by this interpreter, on this checkout's code, with `args`."""
    if self.entry is not None:
      module, function = self.entry.split(":")
      code = f"import sys; from {module} import {function}; sys.argv[0] = {self.name!r}; sys.exit({function}())"
      return [sys.executable, "-c", code, *args]
    return [sys.executable, "-m", self.module, *args]


@functools.cache
def console_scripts() -> dict[str, str]:
  with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["project"]["scripts"]


def segments(tokens: list[str]) -> list[list[str]]:
  """The simple commands of a command line (split at &&, ||, ; and |), leading VAR=value and `do`
  dropped, a loop's own syntax (`for ... in ...`, `done`) left out."""
  parts, current = [], []
  for token in tokens + [";"]:
    if token in _SEPARATORS:
      while current and (_ENV_ASSIGNMENT.match(current[0]) or current[0] == "do"):
        current.pop(0)
      if current and current[0] not in _SHELL_SYNTAX:
        parts.append(current)
      current = []
    else:
      current.append(token)
  return parts


def program(words: list[str]) -> Program | None:
  """The project command `words` runs, or None when it is something else."""
  exe, *args = words
  scripts = console_scripts()
  name = exe.removeprefix(".venv/bin/")
  if name in scripts and exe in (name, f".venv/bin/{name}"):
    return Program(name, scripts[name], None, tuple(args))
  if exe in _PYTHONS and len(args) >= 2 and args[0] == "-m":
    return Program(f"python -m {args[1]}", None, args[1], tuple(args[2:]))
  return None


def _env() -> dict[str, str]:
  """A child's environment that imports this checkout (not another editable install of it)."""
  path = os.environ.get("PYTHONPATH")
  return child_env(PYTHONPATH=REPO_ROOT + (os.pathsep + path if path else ""))


@functools.cache
def help_output(argv: tuple[str, ...]) -> tuple[int, str]:
  """(exit status, stdout + stderr) of `argv --help`; one subprocess per program."""
  done = subprocess.run([*argv, "--help"], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True,
                        timeout=300)
  return done.returncode, done.stdout + done.stderr


def flags(args: tuple[str, ...]) -> list[str]:
  """The options of a command line: `--name` (of `--name=value` too) and `-x`, an optional one
  written `[--name VALUE]` too; not `-1`."""
  return [a.lstrip("[").rstrip("]").split("=", 1)[0] for a in args if re.match(r"--?[A-Za-z]", a.lstrip("["))]


def problems(command: DocCommand) -> list[str]:
  """What is wrong with a documented command: an unlisted command that is not this project's, a
  program whose --help fails, a flag its --help does not name, a test file that does not exist."""
  if command.canonical in NOT_RUN:
    return []
  found = []
  for words in segments(command.tokens):
    prog = program(words)
    if prog is None:
      found.append(f"{shlex.join(words)!r} is not a command of this project; check it here or list it in NOT_RUN "
                   f"with the reason: {command.canonical!r}")
      continue
    status, text = help_output(tuple(prog.argv()))
    if status != 0:
      found.append(f"`{prog.name} --help` exits {status}: {text[-2000:]}")
      continue
    found += [f"{prog.name} has no flag {flag} (not in its --help)" for flag in flags(prog.args)
              if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)]
    found += [f"{prog.name}: no such file {a}" for a in prog.args
              if re.fullmatch(r"tests/\S+\.py", a) and not os.path.exists(os.path.join(REPO_ROOT, a))]
  return found


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=[f"{c.path}:{c.line}" for c in ALL_COMMANDS])
def test_documented_command(command):
  assert problems(command) == [], f"{command.path}:{command.line}: {command.text}"


def test_the_checks_would_catch_a_bad_command():
  """Positive controls: a flag generate lacks, a module that does not exist, an unlisted command."""
  def crafted(text: str) -> DocCommand:
    return DocCommand("crafted.md", 1, text, "")

  bogus = problems(crafted('.venv/bin/generate --prompt "a red square moving right" --no-such-flag 3'))
  assert bogus == ["generate has no flag --no-such-flag (not in its --help)"], bogus
  assert problems(crafted('.venv/bin/generate --prompt "a red square moving right" --mesh U=2,R=2')) == []
  assert problems(crafted(".venv/bin/serve --port=8001 --bogus")) == ["serve has no flag --bogus (not in its --help)"]
  missing = problems(crafted("python -m end_to_end.no_such_tool --json x.json"))
  assert len(missing) == 1 and "exits 1" in missing[0] and "No module named" in missing[0], missing
  assert "not a command of this project" in problems(crafted("make video"))[0]
  assert problems(crafted(".venv/bin/python -m pytest -q tests/system/no_such_test.py")) == [
      "python -m pytest: no such file tests/system/no_such_test.py"]
  # A command inside a loop is checked, an optional flag in brackets too; the loop's syntax is not.
  looped = problems(crafted("for s in 0 1; do .venv/bin/generate --prompt x --seed $s [--no-such-flag N]; done"))
  assert looped == ["generate has no flag --no-such-flag (not in its --help)"], looped


def test_every_listed_command_is_still_in_the_docs():
  """NOT_RUN holds only commands the docs show (an edited command must be listed again)."""
  shown = {c.canonical for c in ALL_COMMANDS}
  assert [c for c in NOT_RUN if c not in shown] == []


def test_the_docs_have_commands():
  """The parser finds the README's three commands and a command in every docs page (a control for
  the parametrized test, which would pass on an empty list)."""
  assert {c.path for c in ALL_COMMANDS} == set(DOCS)
  sections = {c.section for c in ALL_COMMANDS if c.path == "README.md"}
  assert {"Set up", "Run", "Test"} <= sections, sections


def _readme(section: str) -> DocCommand:
  [command] = [c for c in ALL_COMMANDS if c.path == "README.md" and c.section == section]
  return command


def test_readme_commands_are_what_ci_runs_and_come_first():
  """The README's set-up and test commands are lines of .ci/run, verbatim, and the three commands a
  newcomer needs (set up, run, test) are in the README's first 60 lines."""
  with open(os.path.join(REPO_ROOT, ".ci", "run"), encoding="utf-8") as f:
    ci = [line.strip() for line in f]
  for section in ("Set up", "Test"):
    assert _readme(section).text in ci, (section, _readme(section).text)
  assert _readme("Test").text == ".venv/bin/python -m pytest -q -n 2"
  assert [c.line for c in map(_readme, ("Set up", "Run", "Test")) if c.line > 60] == []


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # fork + exec of a child process is safe
def test_readme_main_job_runs(tmp_path):
  """The README's main job (its first `generate` command), run as written in an empty folder: on the
  embedded default, it writes the video and its sidecar that its last line names (~25 s on 2 cores)."""
  command = next(c for c in ALL_COMMANDS if c.path == "README.md" and (p := program(c.tokens)) and p.name == "generate")
  prog = program(command.tokens)
  given = dict(zip(prog.args, prog.args[1:]))
  assert given.get("--model", "tiny") == "tiny", command.text  # no download: the embedded default
  out = given.get("--out", "output.mp4")
  began = time.monotonic()
  done = subprocess.run(prog.argv(*prog.args), cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
  seconds = time.monotonic() - began
  assert done.returncode == 0, done.stdout + done.stderr
  assert (tmp_path / out).stat().st_size > 0 and (tmp_path / f"{out}.json").exists(), os.listdir(tmp_path)
  assert f"wrote {out} and {out}.json" in done.stdout.strip().splitlines()[-1], done.stdout
  print(f"{command.path}:{command.line} ran in {seconds:.1f} s")


def _anchors(path: str) -> set[str]:
  """GitHub's anchors of a Markdown file's headings ("## LoRA and few-step" -> "lora-and-few-step")."""
  with open(path, encoding="utf-8") as f:
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in f if line.startswith("#")}


def test_docs_links_resolve():
  """Every relative link and image of README.md, docs/**/*.md, DESIGN.md and end_to_end/README.md
  names a file that exists (and a heading of it, after a #), so moving a page or a screenshot
  cannot leave a dead link."""
  dead = []
  for path in DOCS + LINKED:
    with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
      links = re.findall(r"\]\(([^)\s]+)\)", f.read())
    for link in links:
      if re.match(r"[a-z]+:", link):
        continue
      name, _, anchor = link.partition("#")
      target = os.path.normpath(os.path.join(REPO_ROOT, os.path.dirname(path), name)) if name else \
          os.path.join(REPO_ROOT, path)
      if not os.path.exists(target) or (anchor and anchor not in _anchors(target)):
        dead.append(f"{path}: {link}")
  assert dead == []
  assert "docs/tiny_red_square.png" in open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8").read()
