"""The mesh's one owner (attention/mesh_spec.py `MeshSpec`): parsing and printing, the errors that name
a fix, the checks against heads, devices and guidance, the built mesh's axis order, and that no other
module parses a mesh or requests fake devices."""

from __future__ import annotations

import importlib
import os
import pkgutil
import re

import jax
import pytest

from attention.mesh import MESH_AXES, WINDOWS_AXIS, WINDOWS_MESH_AXES, MeshSpec, batch_axis, sequence_spec
from tests.harness import REPO_ROOT

ROOT = REPO_ROOT


@pytest.mark.parametrize("text,expected", [
    ("U=2,R=2", MeshSpec(2, 2)), ("R=2,U=4", MeshSpec(4, 2)), ("U=4", MeshSpec(4, 1)), ("r=3", MeshSpec(1, 3)),
    ("U=1,R=1", MeshSpec()), ("CFG=2,U=2,R=2", MeshSpec(2, 2, 2)), ("u=4,cfg=2", MeshSpec(4, 1, 2)),
    ("W=2,U=2,R=2", MeshSpec(2, 2, windows=2)), ("CFG=2,W=2,U=2,R=1", MeshSpec(2, 1, 2, windows=2)),
    ("r=2,w=4", MeshSpec(1, 2, windows=4)), ("U=2,W=1", MeshSpec(2, 1)),
])
def test_parse_and_print(text, expected):
  spec = MeshSpec.parse(text)
  assert spec == expected
  assert MeshSpec.parse(str(spec)) == spec  # the printed form reads back
  assert spec.devices == spec.cfg * spec.windows * spec.ring * spec.ulysses


@pytest.mark.parametrize("spec,text", [
    (MeshSpec(2, 2, windows=2), "W=2,U=2,R=2"), (MeshSpec(2, 1, 2, windows=2), "CFG=2,W=2,U=2,R=1"),
    (MeshSpec(2, 2, 2), "CFG=2,U=2,R=2"), (MeshSpec(4, 1, windows=1), "U=4,R=1"),
])
def test_windows_printed_after_cfg_only_when_split(spec, text):
  assert str(spec) == text
  described = spec.describe()
  assert described["W"] == spec.windows and described["spec"] == text
  assert described["devices"] == spec.devices and spec.sequence_devices == spec.ring * spec.ulysses


def test_windows_degree_checked_like_the_others():
  for bad in (0, -1, True, 1.5, "2"):
    with pytest.raises(ValueError, match="windows="):
      MeshSpec(windows=bad)
  assert MeshSpec(windows=2).workable(4) == [MeshSpec(1, 1, windows=2)]  # W kept, R * U = 1
  assert [str(s) for s in MeshSpec(4, 1, 2, windows=2).workable(2)] == ["CFG=2,W=2,U=1,R=4", "CFG=2,W=2,U=2,R=2"]
  with pytest.raises(ValueError, match="needs 16 devices but 8 are visible"):
    MeshSpec(2, 2, 2, windows=2).check(device_count=8)
  with pytest.raises(ValueError, match=r"guidance is off .*use W=2,U=2,R=1"):
    MeshSpec(2, 1, 2, windows=2).check(cfg_active=False, device_count=8)


@pytest.mark.parametrize("text,match", [
    ("U2", "malformed"), ("U=2,U=2", "twice"), ("U=0", ">= 1"), ("X=2", "malformed"), ("CFG=3", "CFG=1 or CFG=2"),
    ("2x4", "did you mean 'U=2,R=4' or 'U=4,R=2'"), ("auto", "chosen by the planner"),
    ("W=0", ">= 1"), ("W=2,w=2", "W twice"), ("WINDOWS=2", "W: context windows run in parallel"),
    ("2x2", "W the context windows run in parallel"),
])
def test_parse_errors(text, match):
  with pytest.raises(ValueError, match=match):
    MeshSpec.parse(text)


def test_check_names_what_works():
  with pytest.raises(ValueError, match=r"12 heads, not divisible by the Ulysses degree U=8; with 8 devices use "
                                       r"one of: U=1,R=8, U=2,R=4, U=4,R=2"):
    MeshSpec(8, 1).check(num_heads=12, device_count=8)
  with pytest.raises(ValueError, match="needs 16 devices but 8 are visible"):
    MeshSpec(4, 4).check(device_count=8)
  with pytest.raises(ValueError, match=r"guidance is off .*use U=2,R=2"):
    MeshSpec(2, 2, 2).check(cfg_active=False, device_count=8)
  MeshSpec(2, 2, 2).check(num_heads=12, device_count=8, cfg_active=True)  # fits: no error
  mesh = MeshSpec(2, 2, 2).build()
  assert tuple(mesh.axis_names) == MESH_AXES and dict(mesh.shape) == {"cfg": 2, "ring": 2, "ulysses": 2}
  # Ulysses innermost, then ring, cfg outermost: consecutive devices share a Ulysses group
  assert [d.id for d in mesh.devices[0, 0]] == [0, 1] and [d.id for d in mesh.devices[1, 0]] == [4, 5]
  assert MeshSpec.of(mesh) == MeshSpec(2, 2, 2)
  assert batch_axis(mesh) == "cfg" and WINDOWS_AXIS not in mesh.axis_names  # W = 1: the three-axis mesh


def test_too_few_accelerator_devices_names_what_runs_here():
  """On one TPU chip the README's mesh names what would run there (the planner's pick, or one
  device); with a few chips, a mesh that fits too; on CPU it stays the simulated-devices advice."""
  spec = MeshSpec.parse("U=2,R=2")
  with pytest.raises(ValueError) as one:
    spec.check(device_count=1, platform="tpu")
  assert str(one.value) == ("mesh U=2,R=2 needs 4 devices but 1 are visible; what runs here: --mesh auto (the "
                            "planner's pick for the 1 visible tpu device; python -m end_to_end.plan) or drop --mesh "
                            "(mesh=None in Python: one device)")
  with pytest.raises(ValueError, match=r"2 visible gpu devices; .*or a mesh of at most 2 devices \(e.g. U=1,R=2\)"):
    spec.check(device_count=2, platform="gpu")
  with pytest.raises(ValueError, match=r"needs 4 devices but 1 are visible; use a smaller mesh \(on CPU, set "
                                       r"XLA_FLAGS=--xla_force_host_platform_device_count=4"):
    spec.check(device_count=1, platform="cpu")
  with pytest.raises(ValueError, match="on CPU, set XLA_FLAGS"):  # platform None: this process's backend (cpu)
    spec.check(device_count=1)
  spec.check(device_count=4, platform="tpu")  # fits: no error


@pytest.mark.parametrize("text,shape", [("W=2,U=2,R=1", (1, 2, 1, 2)), ("CFG=2,W=2,U=2,R=1", (2, 2, 1, 2)),
                                        ("W=4,R=2", (1, 4, 2, 1))])
def test_windows_mesh_layout(text, shape):
  """W > 1: axes (cfg, windows, ring, ulysses), row-major over the devices (a windows group is R * U
  consecutive devices); the rows split over (cfg, windows), cfg-major."""
  spec = MeshSpec.parse(text)
  mesh = spec.build()
  assert tuple(mesh.axis_names) == WINDOWS_MESH_AXES == ("cfg", "windows", "ring", "ulysses")
  assert tuple(mesh.devices.shape) == shape == spec.shape
  assert [d.id for d in mesh.devices.flat] == list(range(spec.devices))
  c, w, r, u = shape
  assert [d.id for d in mesh.devices[c - 1, w - 1].flat] == list(range(spec.devices - r * u, spec.devices))
  assert MeshSpec.of(mesh) == spec
  assert MeshSpec.of(mesh, shard_weights=True) == MeshSpec.parse(text, shard_weights=True)
  assert batch_axis(mesh) == ("cfg", "windows")
  assert sequence_spec(mesh) == jax.sharding.PartitionSpec(("cfg", "windows"), ("ring", "ulysses"))


def test_one_parser_one_device_request():
  """The mesh is parsed and fake devices are requested in attention/mesh_spec.py only."""
  for package in ("attention", "pipelines", "end_to_end"):
    for info in pkgutil.walk_packages([os.path.join(ROOT, package)], prefix=f"{package}."):
      if info.name.endswith("__main__"):
        continue
      module = importlib.import_module(info.name)
      for name in ("parse_mesh", "format_mesh", "check_mesh", "working_meshes"):
        assert not hasattr(module, name) or info.name == "attention.mesh_spec", f"{info.name}.{name}"
  writers = []
  for folder in ("attention", "pipelines", "end_to_end"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
      for f in files:
        if f.endswith(".py") and re.search(r'os\.environ\["XLA_FLAGS"\]\s*=', open(os.path.join(dirpath, f)).read()):
          writers.append(os.path.relpath(os.path.join(dirpath, f), ROOT))
  assert writers == [os.path.join("attention", "mesh_spec.py")]
