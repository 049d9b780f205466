"""flax imported without IPython (pipelines/commands/startup.py), against a stand-in IPython package
that records its import: each case runs in a fresh interpreter, since this one has flax loaded."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import types

import pytest

from pipelines.commands import startup

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture
def fake_ipython(tmp_path):
  """A folder holding an `IPython` package whose import appends to a marker file and then fails as
  a missing one would (flax and treescope take ImportError as "no IPython")."""
  package = tmp_path / "site" / "IPython"
  package.mkdir(parents=True)
  marker = tmp_path / "imported.txt"
  package.joinpath("__init__.py").write_text(
      f"open({str(marker)!r}, 'a').write('imported\\n')\nraise ImportError('stand-in IPython')\n")
  return tmp_path / "site", marker


def _run(site: pathlib.Path, code: str) -> str:
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "JAX_PLATFORMS": "cpu"}
  done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  return done.stdout.strip()


def test_flax_imports_without_importing_ipython(fake_ipython):
  site, marker = fake_ipython
  out = _run(site, "import sys\nfrom pipelines.commands.startup import import_flax_without_ipython\n"
                   "import_flax_without_ipython()\n"
                   "print('flax.nnx' in sys.modules, 'IPython' in sys.modules)")
  assert out == "True False"  # flax loaded; IPython neither imported nor left blocked
  assert not marker.exists()


def test_a_plain_flax_import_does_import_ipython(fake_ipython):
  """Positive control: without the helper flax.nnx's import reaches the stand-in IPython."""
  site, marker = fake_ipython
  _run(site, "import flax.nnx")
  assert marker.read_text().startswith("imported")


def test_an_imported_ipython_is_left_alone(monkeypatch):
  """In a notebook IPython is already loaded: the helper must not hide it (in this process, with the
  import recorded rather than run)."""
  shell = types.ModuleType("IPython")
  monkeypatch.setitem(sys.modules, "IPython", shell)
  seen = []
  monkeypatch.setattr(startup.importlib, "import_module", lambda name: seen.append((name, sys.modules["IPython"])))
  startup.import_flax_without_ipython()
  assert seen == [("flax.nnx", shell)] and sys.modules["IPython"] is shell


def test_the_blocker_is_removed_when_the_import_fails(monkeypatch):
  monkeypatch.delitem(sys.modules, "IPython", raising=False)
  monkeypatch.delitem(sys.modules, "flax.nnx", raising=False)
  seen = []

  def failing(name):
    seen.append(sys.modules["IPython"])
    raise ImportError("no flax here")

  monkeypatch.setattr(startup.importlib, "import_module", failing)
  with pytest.raises(ImportError, match="no flax"):
    startup.import_flax_without_ipython()
  assert seen == [None] and "IPython" not in sys.modules  # hidden during the import only


def test_both_commands_load_the_pipeline_through_it(monkeypatch):
  """`generate`'s loader (run on the tiny model) and `serve`'s call the helper."""
  from pipelines.cli import generate
  from pipelines.serve import main as serve_main

  calls = []
  monkeypatch.setattr(generate, "import_flax_without_ipython", lambda: calls.append("generate"))
  monkeypatch.setattr(serve_main, "import_flax_without_ipython", lambda: calls.append("serve"))
  plan = types.SimpleNamespace(model="tiny", dtype="float32", vae_dtype="float32", loras=[], quantize=None,
                               placement="auto")
  assert generate._load(plan, None) is not None
  serve_main.loader(types.SimpleNamespace())
  assert calls == ["generate", "serve"]
