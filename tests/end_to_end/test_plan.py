"""The plan command (end_to_end/plan.py): a recommended mesh for each preset from a device count or a
TPU topology (--estimate), and without libtpu the fix named."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from end_to_end import plan as plan_cli


@pytest.mark.parametrize("preset", ["wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.2-t2v-a14b"])
@pytest.mark.parametrize("where", [["--devices", "8"], ["--topology", "v6e:2x4", "--estimate"]])
def test_plan_command(tmp_path, capsys, preset, where):
  out = tmp_path / "plan.json"
  assert plan_cli.main(["--preset", preset, *where, "--json", str(out)]) == 0
  report = json.loads(out.read_text())
  assert report["recommended"] is not None and report["memory"] == "estimate"
  chosen = [c for c in report["candidates"] if c["mesh"] == report["recommended"]
            and c["shard_weights"] == report["recommended_shard_weights"]]
  assert len(chosen) == 1 and chosen[0]["fits"]
  assert f"recommended: --mesh {report['recommended']}" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="libtpu present: it would compile")
def test_plan_topology_without_libtpu_says_how(capsys, monkeypatch):
  """--topology compiles each candidate with libtpu; without it, exit 3 naming the fix (or --estimate)."""
  from end_to_end.aot import step as aot_step
  for key in aot_step.OFFLINE_ENV:  # restored after the test (the command sets them for libtpu)
    monkeypatch.setenv(key, os.environ.get(key, aot_step.OFFLINE_ENV[key]))
  assert plan_cli.main(["--preset", "wan2.1-t2v-1.3b", "--topology", "v6e:2x4"]) == 3
  err = capsys.readouterr().err
  assert "libtpu" in err and "--estimate" in err
