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


def test_plan_with_context_windows_offers_w(tmp_path, capsys):
  """--context-frames: candidates with W (windows at once) and memory by one window's tokens; a bad
  window is a usage error."""
  out, clip = tmp_path / "w.json", tmp_path / "clip.json"
  common = ["--preset", "wan2.1-t2v-14b", "--devices", "8", "--frames", "241"]
  assert plan_cli.main([*common, "--context-frames", "81", "--context-overlap", "32", "--json", str(out)]) == 0
  assert plan_cli.main([*common, "--json", str(clip)]) == 0
  windowed, whole = json.loads(out.read_text())["candidates"], json.loads(clip.read_text())["candidates"]
  assert any(c["mesh"].startswith("W=2,") for c in windowed) and not any("W=" in c["mesh"] for c in whole)
  same = lambda found: next(c for c in found if c["mesh"] == "U=8,R=1" and not c["shard_weights"])  # noqa: E731
  assert same(windowed)["activation_bytes"] < same(whole)["activation_bytes"] / 2
  assert "in windows of 81" in capsys.readouterr().out
  assert plan_cli.main([*common, "--context-frames", "80"]) == 2
