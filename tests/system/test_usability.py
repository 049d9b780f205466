"""A newcomer's first hour: each test pins one friction met on a fresh machine (issue 12).

Command-line behaviour is run as a subprocess (`python -m ...`, as a user types it); runs that would
compute are stopped, or sized small. The generate command's two full runs (drawn seed, warning
lines, sidecar, stage lines, compilation cache) are in tests/pipelines/cli/test_generate.py.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import select
import subprocess
import sys
import time

import pytest

from tests.harness import REPO_ROOT, child_env, end_to_end_commands, user_docs
from pipelines.commands import compile_cache
from pipelines.storage import video_io
from attention.mesh import MeshSpec

ROOT = REPO_ROOT
PROMPT = "a red fox running through snow"


def _run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=child_env(),
                        capture_output=True, text=True, timeout=timeout)


def _words(text: str) -> str:
  """Text with every whitespace run as one space (argparse wraps help lines by terminal width)."""
  return " ".join(text.split())


# --- --help ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("module,expected", [
    ("pipelines.cli.generate", ["--mesh MESH device mesh", "(default: U=1,R=1)",
                            "(default: output.mp4)", "(default: the --preset's, else the model's: 24 for Wan 2.2 TI2V-5B, 16 for the others; a GIF without --fps", "text tokens per prompt (default: 512 as Wan",
                            "other counts become frames // 4 * 4 + 1, as in diffusers (16 -> 17, 10 -> 9)"]),
    ("end_to_end.quality.check", ["(default: tiny)", "(default: 64 for tiny, 48 otherwise)", "(default: 64)",
                            "(default: 17 for tiny, 9 otherwise)", "(default: 8 for tiny, 4 otherwise)",
                            "(default: mean)", "frames // 4 * 4 + 1"]),
    ("end_to_end.bench.attention", ["(default: 4096)", "(default: 12)", "(default: 128)", "(default: 5)"]),
])
def test_help_shows_defaults(module, expected):
  proc = _run(module, "--help")
  assert proc.returncode == 0, proc.stderr
  text = _words(proc.stdout)
  for phrase in expected:
    assert phrase in text, (phrase, proc.stdout)
  assert not [d for d in ("(default: None)", "(default: False)", "(default: True)") if d in text]


def _option_blocks(help_text: str) -> dict[str, str]:
  """--help's options, each as {"--flag": its header and help text, whitespace runs as one space},
  for the options that take a value (the on/off flags and -h left out)."""
  blocks, current = {}, None
  for line in help_text.splitlines():
    if re.match(r"  -", line):
      header = re.split(r"\s{2,}", line.strip())[0]
      words = header.replace(",", "").split()
      current = words[-2] if any(not w.startswith("-") for w in words) else None
      if current is not None:
        blocks[current] = line
    elif line.startswith("   ") and current is not None:
      blocks[current] += line
    else:
      current = None
  return {flag: _words(text) for flag, text in blocks.items()}


@pytest.mark.parametrize("module,opening,shown", [
    ("pipelines.cli.generate", "Generate a video with a Wan model, on one device or sharded over a mesh.",
     {"--model": "(default: tiny)",
      "--steps": "(default: the --preset's, 8 for tiny, 50 for a folder without its own generation_defaults.json)",
      "--lora-2": "(default: none)", "--seed": "(default: random"}),
    ("pipelines.serve.main", "Serve Wan videos over HTTP: a queue of generation jobs (OpenAI's Videos API) and a "
     "web page at /.", {"--port": "(default: 8000)", "--host": "(default: 127.0.0.1)", "--model": "(default: tiny)",
                        "--max-batch": "(default: 4)", "--warmup": "(default: none)"}),
])
def test_help_opens_with_one_line_for_users_and_shows_every_default(module, opening, shown):
  """The line after the usage says what the command does, in one sentence (not a module docstring
  for developers), and every option that takes a value says its default."""
  proc = _run(module, "--help")
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  after_usage = lines[lines.index("") + 1:]
  assert after_usage[0] == opening and after_usage[1] == "", after_usage[:3]
  assert "Imports no JAX" not in proc.stdout and "`" not in after_usage[0]
  blocks = _option_blocks(proc.stdout)
  assert {"--mesh", "--model"} <= set(blocks) and "--overwrite" not in blocks, sorted(blocks)  # the parser's control
  for flag, phrase in shown.items():
    assert phrase in blocks[flag], (flag, blocks[flag])
  required = {"--prompt"}  # generate's one option without a default
  assert [f"{flag}: {text}" for flag, text in blocks.items() if "default" not in text and flag not in required] == []
  assert not [d for d in ("(default: None)", "(default: [])", "(default: False)") if d in proc.stdout]


def test_quality_help_keeps_its_line_continuation():
  """The example's trailing backslash was eaten by the docstring, joining two lines."""
  lines = _run("end_to_end.quality.check", "--help").stdout.splitlines()
  i = next(i for i, line in enumerate(lines) if "--model ./Wan2.1-T2V-1.3B-Diffusers" in line)
  assert lines[i].endswith("--width 832 \\") and lines[i + 1].strip().startswith("--frames 81"), lines[i:i + 2]


def test_end_to_end_readme_names_every_tool():
  with open(os.path.join(ROOT, "end_to_end", "README.md"), encoding="utf-8") as f:
    readme = f.read()
  tools = [f"python -m {module}" for module in end_to_end_commands()]
  assert {"python -m end_to_end.quality.check", "python -m end_to_end.bench.attention"} <= set(tools)
  assert [t for t in tools if t not in readme] == []


# --- frames ----------------------------------------------------------------------------------------

def test_frame_rounding_is_described_as_diffusers_does_it():
  """diffusers' rule, num_frames // 4 * 4 + 1, rounds 16 up to 17: nothing may call it "round down"."""
  said = []
  for pattern in ("*.md", "*/*.md", "*/*.py", "*/*/*.py"):
    for path in glob.glob(os.path.join(ROOT, pattern)):
      with open(path, encoding="utf-8") as f:
        text = _words(f.read())
      said += [(os.path.relpath(path, ROOT), m.group(0))
               for m in re.finditer(r"round(s|ed|ing)? down", text) if not path.endswith("tests/system/test_usability.py")]
  assert said == []


# --- meshes ----------------------------------------------------------------------------------------

def test_grid_mesh_gets_the_spec_it_probably_means(tmp_path):
  proc = _run("pipelines.cli.generate", "--prompt", PROMPT, "--mesh", "2x2", "--out", str(tmp_path / "x.mp4"))
  assert proc.returncode == 2
  assert "generate: error: --mesh: mesh spec='2x2' does not say which degree is which; did you mean " \
         "'U=2,R=2'?" in proc.stderr, proc.stderr
  proc = _run("end_to_end.quality.check", "--mesh", "2x4")
  assert proc.returncode == 2 and "did you mean 'U=2,R=4' or 'U=4,R=2'?" in proc.stderr, proc.stderr
  with pytest.raises(ValueError, match="did you mean 'U=1,R=8' or 'U=8,R=1'"):
    MeshSpec.parse("1x8")


# --- the quality check's default -------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # fork + exec of a child process is safe
def test_quality_default_check_passes_on_the_default_model():
  """`python -m end_to_end.quality.check` (its first example) passes on the trained tiny default with the
  thresholds for trained content, and prints meshes as U=..,R=.."""
  proc = _run("end_to_end.quality.check", timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert re.search(r"^bfloat16 +U=2,R=2 +auto .* pass$", proc.stdout, re.M), proc.stdout
  assert "thresholds for structured video of a trained checkpoint, --content trained" in proc.stdout
  assert "17 frames 64x64, 8 steps" in proc.stdout
  assert "2x2" not in proc.stdout


def test_quality_rounds_frames_as_the_pipeline_does(capsys):
  """--frames 4 runs 5 frames (its explicit latents had the shape of 4 frames: a ValueError). The
  sizes of test_reliability's calls, so that a worker reuses their compiled programs."""
  from end_to_end.quality import check as quality_check

  argv = ["--frames", "4", "--steps", "1", "--height", "32", "--width", "32", "--max-sequence-length", "8",
          "--dtype", "float32", "--mesh", "U=1,R=1"]
  assert quality_check.main(argv) == 0
  out = capsys.readouterr()
  assert "quality: warning: num_frames=4 is not 4k + 1 (the VAE's frame groups); rounding to 5" in out.err
  assert "5 frames 32x32" in out.out


# --- a long run says so before it starts ------------------------------------------------------------

def test_long_run_says_so_before_compute(tmp_path):
  """A real model's preset on the tiny model on this CPU: the preset warning as a `generate:
  warning:` line, then the estimate, before any compute (the run is stopped there)."""
  out = tmp_path / "x.mp4"
  cmd = [sys.executable, "-m", "pipelines.cli.generate", "--preset", "wan2.1-t2v-1.3b", "--prompt", PROMPT,
         "--out", str(out)]
  proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
  err = b""
  try:
    deadline = time.monotonic() + 120
    while b"this run is long" not in err or not err.endswith(b"\n"):
      assert time.monotonic() < deadline and proc.poll() is None, err.decode(errors="replace")
      if select.select([proc.stderr], [], [], 1.0)[0]:
        err += os.read(proc.stderr.fileno(), 65536)
  finally:
    proc.kill()
    proc.wait()
  text = err.decode(errors="replace")
  assert "generate: warning: --preset wan2.1-t2v-1.3b sets the size/steps of a real Wan checkpoint" in text
  assert "UserWarning" not in text, text
  line = next(line for line in text.splitlines() if "this run is long" in line)
  assert line.startswith("generate: this run is long: denoising alone takes about "), line
  assert "(50 steps x ~" in line and "32760 tokens x 4 layers x 2 rows on " in line, line
  assert "text encode:" not in text and not out.exists()  # no compute yet


# --- the Python API --------------------------------------------------------------------------------

def test_api_progress_is_on_by_default(capsys):
  from pipelines import WanPipeline

  pipe = WanPipeline.tiny(random=True)
  call = dict(height=32, width=32, num_frames=5, num_inference_steps=1, max_sequence_length=8, seed=0)
  pipe(PROMPT, **call)
  err = capsys.readouterr().err
  for stage in ("text encode: 2 prompt(s) x 8 tokens", "denoise: 100%", "decode: 1 video(s) of 5 frames 32x32"):
    assert stage in err, err
  pipe(PROMPT, **call, progress=False)
  assert capsys.readouterr().err == ""


# --- the compilation cache's place -----------------------------------------------------------------

def test_compile_cache_location(monkeypatch, tmp_path):
  """Where generate keeps compiled programs (its runs are in tests/pipelines/cli/test_generate.py); nothing is written."""
  for name in (compile_cache.ENV, "JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert compile_cache.resolve_dir(None, False) == str(tmp_path / "home" / ".cache" / "wan-usp-jax" / "jax")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compile_cache.resolve_dir(None, False) == str(tmp_path / "xdg" / "wan-usp-jax" / "jax")
  monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "moved"))
  assert compile_cache.resolve_dir(None, False) == str(tmp_path / "moved")
  assert compile_cache.resolve_dir(str(tmp_path / "flag"), False) == str(tmp_path / "flag")  # the flag wins
  assert compile_cache.resolve_dir(str(tmp_path / "flag"), True) is None
  for off in ("", "off", "OFF", "0", "none"):
    monkeypatch.setenv(compile_cache.ENV, off)
    assert compile_cache.resolve_dir(None, False) is None
  assert not os.path.exists(tmp_path / "home") and not os.path.exists(tmp_path / "xdg")


# --- files ----------------------------------------------------------------------------------------

def test_sidecars_are_ignored_and_nothing_else():
  with open(os.path.join(ROOT, ".gitignore"), encoding="utf-8") as f:
    patterns = [line.strip() for line in f if line.strip() and not line.startswith("#")]

  def ignored(name: str) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)

  for out in ("fox.mp4", "fox.gif", "fox.npy", "frames/"):
    assert ignored(os.path.basename(video_io.sidecar_path(out))), video_io.sidecar_path(out)
  assert video_io.sidecar_path("fox.mp4") == "fox.mp4.json"
  assert not [n for n in ("model_index.json", "config.json", "quality.json", "fox.json") if ignored(n)]


def test_readme_says_how_long_the_tests_take():
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    readme = f.read()
  test_section = readme[readme.index("## Test"):]
  assert re.search(r"On 2 CPU cores the test command takes about \d+ min", _words(test_section)), test_section


# --- argument errors before heavy imports ----------------------------------------------------------

_IMPORTS_JAX = """
import sys
from pipelines.cli import generate
codes = []
for argv in ({cases}):
  try:
    codes.append(generate.main(list(argv)))
  except SystemExit as e:  # --help and argparse's own errors
    codes.append(e.code)
print(codes, "jax" in sys.modules)
"""


def test_help_and_argument_errors_do_not_import_jax():
  """`--help` and the flags' own errors (mesh, output, fps, argparse's) answer before JAX is imported
  (0.2 s, not the 1-10 s of importing JAX first); the positive control is a check that needs the
  model's facts (GenerationRequest.build), which imports JAX."""
  cases = [["--help"], ["--mesh", "X=3", "--prompt", "a"], ["--mesh", "U=1", "--shard-weights", "--prompt", "a"],
           ["--mesh", "CFG=2,U=2", "--guidance", "1", "--prompt", "a"], ["--out", "x.txt", "--prompt", "a"],
           ["--fps", "nan", "--prompt", "a"], ["--bogus"]]
  out = subprocess.run([sys.executable, "-c", _IMPORTS_JAX.format(cases=repr(cases))], cwd=ROOT, env=child_env(),
                       capture_output=True, text=True, timeout=120)
  assert out.stdout.strip().splitlines()[-1] == f"{[0] + [2] * (len(cases) - 1)} False", out.stdout + out.stderr
  control = [["--steps", "0", "--prompt", "a"]]
  out = subprocess.run([sys.executable, "-c", _IMPORTS_JAX.format(cases=repr(control))], cwd=ROOT, env=child_env(),
                       capture_output=True, text=True, timeout=120)
  assert out.stdout.strip() == "[2] True", out.stdout + out.stderr


def test_readme_names_the_sidecars_the_writer_writes():
  """Every sidecar name the README and docs/ give for an output is `video_io.sidecar_path` of it (a
  folder of PNG frames included)."""
  readme = _words(user_docs())
  pairs = [("square.mp4", "square.mp4.json"), ("fox.gif", "fox.gif.json"), ("frames/", "frames.frames.json")]
  for out, named in pairs:
    assert f"`{named}`" in readme, named
    assert video_io.sidecar_path(out) == named
  assert video_io.sidecar_path("frames/") != "frames/.json"  # positive control: not the naive name


def test_generate_needs_no_torch_and_the_readme_says_where_a_cpu_torch_comes_from():
  """torch (and diffusers, its user) are test references only: not among the package's own
  dependencies, and the README names PyTorch's CPU index for machines where PyPI gives CUDA."""
  import tomllib
  project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
  names = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
  assert not names & {"torch", "diffusers", "accelerate"}, names
  assert {"torch", "diffusers"} <= {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower()
                                    for d in project["optional-dependencies"]["test"]}  # control: the parser works
  readme = _words(open(os.path.join(ROOT, "README.md")).read())
  assert "--index-url https://download.pytorch.org/whl/cpu" in readme
  assert "`pip install -e .` alone runs `generate` without them" in readme


def test_readme_plan_command_runs_as_printed():
  """The docs' `end_to_end.plan` command (docs/parallelism.md), copied from them, exits 0 on a host
  without libtpu (it says `--estimate`); without `--estimate` and without libtpu it exits 3 naming
  the fix."""
  command = re.search(r"python -m (end_to_end\.plan [^`#\n]*--estimate[^`#\n]*)", user_docs()).group(1).split()
  assert "--estimate" in command
  done = _run(*command)
  assert done.returncode == 0 and "recommend" in done.stdout.lower(), done.stdout + done.stderr
  try:
    import libtpu  # noqa: F401
  except ImportError:
    missing = _run(*[a for a in command if a != "--estimate"])
    assert missing.returncode == 3 and "libtpu" in missing.stderr and "--estimate" in missing.stderr
