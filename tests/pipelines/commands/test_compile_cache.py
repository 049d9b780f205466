"""Tests for pipelines/commands/compile_cache.py: "written" counts the entries a run added.

JAX decides once per process whether it uses the persistent cache, so each case runs in a fresh
Python process (`_run`): it enables the cache on a directory, compiles three distinct programs and
prints `CacheUse.report()` and `summary()` as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.harness import REPO_ROOT

ROOT = REPO_ROOT

SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp
from pipelines.commands import compile_cache
cache_dir, max_size = sys.argv[1], int(sys.argv[2])
use = compile_cache.enable(cache_dir)
jax.config.update("jax_compilation_cache_max_size", max_size)  # -1: no cap (JAX's default)
x = jnp.arange(8.0)
for k in range(3):  # three programs, each with its own cache key
  jax.jit(lambda v, k=k: jnp.sin(v) * (k + 2) + k).lower(x).compile()
print(json.dumps({"report": use.report(), "summary": use.summary()}))
"""


def _run(cache_dir: str, max_size: int) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-c", SCRIPT, cache_dir, str(max_size)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _entries(cache_dir: str) -> list[str]:
  return sorted(n for n in os.listdir(cache_dir) if n.endswith("-cache"))


def test_written_counts_new_entries(tmp_path):
  """Positive control: a writable cache without a cap writes every compiled program, and
  "written" equals JAX's count and the directory's growth."""
  cache_dir = str(tmp_path / "cache")
  out = _run(cache_dir, -1)
  report = out["report"]
  assert report["compiled_for_cache"] >= 3 and report["hits"] == 0, report
  assert report["written"] == report["compiled_for_cache"] == len(_entries(cache_dir)), report
  assert report["entries_before"] == 0 and report["entries_after"] == report["written"], report
  assert out["summary"] == f"compile cache filled ({report['written']} programs written)"


def test_written_excludes_programs_the_cache_refused(tmp_path):
  """A size cap (eviction on) and an entry left without its "-atime" file (a crashed writer): JAX
  counts a cache miss for every compiled program but each write fails in eviction (it only warns).
  The report says 0 written (the directory kept its 1 entry), not JAX's miss count."""
  cache_dir = tmp_path / "cache"
  cache_dir.mkdir()
  (cache_dir / "orphan-cache").write_bytes(b"x" * 16)  # no orphan-atime next to it
  out = _run(str(cache_dir), 1 << 30)
  report = out["report"]
  assert _entries(str(cache_dir)) == ["orphan-cache"]  # nothing was added
  assert report["compiled_for_cache"] >= 3, report  # JAX tried: the case is the one under test
  assert report["written"] == 0 and report["entries_before"] == report["entries_after"] == 1, report
  assert out["summary"].startswith("compile cache: nothing written; "), out["summary"]
  assert f"{report['compiled_for_cache']} compiled programs were not stored" in out["summary"]
