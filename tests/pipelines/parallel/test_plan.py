"""Tests for the parallel plan (pipelines/parallel/plan.py): CFG parallelism and weight sharding, and
generate's --mesh auto. (MeshSpec: tests/attention/test_mesh_spec.py; the planner: test_planner.py;
the plan command: tests/end_to_end/test_plan.py.)

CFG-parallel and weight-sharded runs of the fp32 tiny pipeline must equal the one-device run
(>= 60 dB PSNR; sharded runs agree to ~1e-7, so the bound has a wide margin), and their compiled
denoise step must hold exactly the collectives the design says: one exchange of the noise
prediction over "cfg" per step, and with sharded weights only per-layer all-gathers inside the
layer scan on top.
"""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest

from attention.mesh import MESH_AXES, WINDOWS_MESH_AXES, MeshSpec
from end_to_end.aot.collectives import hlo_collectives
from tests.numerics import assert_psnr_at_least
from pipelines.parallel.mesh_rules import check_spec
from pipelines.parallel.plan import ParallelPlan
from pipelines.pipeline import wan_pipeline

KW = dict(height=32, width=32, num_frames=5, num_inference_steps=2, seed=1, max_sequence_length=16,
          progress=False)
MESH_PSNR_DB = 60.0


# --- CFG parallelism and weight sharding ----------------------------------------------------------

def _computations(hlo: str) -> dict[str, list[str]]:
  """HLO module text -> {computation name: its lines}."""
  out, name = {}, None
  for line in hlo.splitlines():
    header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if header and not line.startswith(" "):
      name = header.group(1)
      out[name] = []
    elif line == "}":
      name = None
    elif name is not None:
      out[name].append(line)
  return out


def _collective_lines(lines: list[str], op: str) -> list[str]:
  return [l for l in lines if re.search(rf"\s{op}(-start)?\(", l)]


@pytest.fixture(scope="module")
def pipe():
  return wan_pipeline.WanPipeline.tiny(random=True)


@pytest.fixture(scope="module")
def reference(pipe):
  return pipe.run("a fox", **KW).frames


def _compiled(pipe, mesh: str, shard_weights: bool):
  pipe.compiled_steps.clear()
  frames = pipe.run("a fox", mesh=mesh, shard_weights=shard_weights, **KW).frames
  (exe,) = pipe.compiled_steps.programs()
  return frames, exe.as_text()


@pytest.mark.parametrize("mesh,sharded", [("CFG=2,U=4", True), ("CFG=2,R=4", False)])
def test_cfg_parallel_equals_one_device(pipe, reference, monkeypatch, mesh, sharded):
  """With sharded weights the text encoder's large weights are split over the mesh too (here every
  leaf of >= 64 values, so the tiny encoder's are); back on one device they are whole again."""
  from pipelines.wan.transformer import weight_placement
  monkeypatch.setattr(weight_placement, "LARGE_LEAF_ELEMENTS", 64)
  frames, _ = _compiled(pipe, mesh, sharded)
  assert_psnr_at_least(frames, reference, MESH_PSNR_DB, name=f"{mesh}{' weights sharded' if sharded else ''}")
  split = [x for x in jax.tree.leaves(pipe._text_params) if not x.sharding.is_fully_replicated]
  assert (len(split) >= 4) == sharded, len(split)  # positive control: the encoder's weights are split
  if sharded:
    np.testing.assert_array_equal(pipe.run("a fox", **KW).frames, reference)  # one device again


def test_cfg_parallel_collectives(pipe, reference):
  """CFG=2,U=2,R=2 with and without sharded weights: the same video as one device, and the compiled
  step's collectives as designed."""
  mesh = "CFG=2,U=2,R=2"
  plain, plain_hlo = _compiled(pipe, mesh, False)
  assert_psnr_at_least(plain, reference, MESH_PSNR_DB, name=mesh)
  sharded, sharded_hlo = _compiled(pipe, mesh, True)
  assert_psnr_at_least(sharded, reference, MESH_PSNR_DB, name=f"{mesh} weights sharded")
  leaves = jax.tree.leaves(pipe._experts[0])
  split = [x for x in leaves if not x.sharding.is_fully_replicated]
  assert split and all(MESH_AXES in tuple(x.sharding.spec) for x in split)  # over all 3 axes

  # One exchange of the noise prediction over cfg: a collective-permute between the two halves.
  noise_bytes = 4 * int(np.prod(pipe.latent_shape(1, 32, 32, 5)))
  permutes = _collective_lines(plain_hlo.splitlines(), "collective-permute")
  half = MeshSpec.parse(mesh).devices // 2
  cross = [l for l in permutes if re.search(rf"\{{0,{half}\}}", l)]
  assert len(cross) == 1, cross
  assert hlo_collectives(cross[0])["collective-permute"]["bytes"] == noise_bytes

  # Sharding the weights adds only all-gathers, one per sharded block weight the step reads, inside
  # the layer scan. The cross-attention's text projections (attn2 to_k, to_v, norm_k) are not among
  # them: the text K/V are computed once per prompt before the loop (`transformer.text_kv`).
  before, after = hlo_collectives(plain_hlo), hlo_collectives(sharded_hlo)
  for op in ("all-to-all", "collective-permute", "all-reduce"):
    assert after[op]["count"] == before[op]["count"], op
  added = after["all-gather"]["count"] - before["all-gather"]["count"]
  text_kv_weights = [x for path, x in jax.tree_util.tree_leaves_with_path(pipe._experts[0])
                     if "attn2" in jax.tree_util.keystr(path)
                     and any(n in jax.tree_util.keystr(path) for n in ("to_k", "to_v", "norm_k"))
                     and not x.sharding.is_fully_replicated]
  assert len(text_kv_weights) == 5  # to_k and to_v kernel and bias, norm_k
  assert added == len(split) - len(text_kv_weights), (added, len(split))
  bodies = [m.group(1) for m in re.finditer(r"body=%?([\w.\-]+)", sharded_hlo)]
  computations = _computations(sharded_hlo)
  in_bodies = sum(len(_collective_lines(computations[b], "all-gather")) for b in bodies)
  in_plain_bodies = sum(len(_collective_lines(_computations(plain_hlo)[b], "all-gather"))
                        for b in re.findall(r"body=%?([\w.\-]+)", plain_hlo))
  assert in_bodies - in_plain_bodies == added


def test_cfg_mesh_needs_guidance(pipe):
  with pytest.raises(ValueError, match="guidance is off"):
    pipe.run("a fox", mesh="CFG=2,U=2", **dict(KW, guidance_scale=1.0))
  with pytest.raises(ValueError, match="shard_weights=True splits the weights over a mesh"):
    pipe.run("a fox", shard_weights=True, **KW)


# --- the windows degree -------------------------------------------------------------------------

def test_plan_windows_degree():
  """`ParallelPlan.windows` is the spec's W on a mesh (from a string, a `MeshSpec` or a built mesh),
  1 without one or without a windows split; the description carries W."""
  plan = ParallelPlan.build("CFG=2,W=2,U=2,R=1", heads=4, cfg_active=True, shard_weights=True)
  assert plan.windows == 2 and plan.cfg_parallel and plan.shard_weights
  assert tuple(plan.mesh.axis_names) == WINDOWS_MESH_AXES and plan.mesh.devices.size == 8
  assert str(plan) == "CFG=2,W=2,U=2,R=1" and plan.describe()["mesh"]["W"] == 2
  assert ParallelPlan.build(plan.mesh, heads=4).windows == 2
  assert ParallelPlan.build(MeshSpec(windows=4), heads=4).windows == 4
  plain = ParallelPlan.build("U=2,R=2", heads=4)
  assert plain.windows == 1 and plain.describe()["mesh"]["W"] == 1 and tuple(plain.mesh.axis_names) == MESH_AXES
  assert ParallelPlan.single().windows == 1
  assert plan.placement != ParallelPlan.build("CFG=2,U=4,R=1", heads=4, shard_weights=True).placement
  with pytest.raises(ValueError, match="needs 16 devices but 8 are visible"):
    ParallelPlan.build("W=2,CFG=2,U=2,R=2", heads=4)
  check_spec(MeshSpec(windows=2, shard_weights=True), cfg_active=False, heads=4)  # W alone: a 2-device mesh


def test_a_mesh_too_large_for_one_chip_names_what_runs_here(monkeypatch):
  """The Python call and `generate` (as "--mesh: ...", `flag_error`) on a host with one TPU device:
  the plan asks the backend for its platform, so the message proposes the planner's pick or one
  device, not simulated CPU devices."""
  from pipelines.cli.flags import flag_error

  monkeypatch.setattr(jax, "device_count", lambda *a: 1)
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  with pytest.raises(ValueError, match=r"needs 4 devices but 1 are visible; what runs here: --mesh auto") as e:
    ParallelPlan.build("U=2,R=2", heads=12)
  assert str(flag_error(e.value)).startswith("--mesh: mesh U=2,R=2 needs 4 devices")
  assert "drop --mesh" in str(e.value) and "XLA_FLAGS" not in str(e.value)


# --- generate --mesh auto ------------------------------------------------------------------------

def test_generate_mesh_auto_and_cfg(tmp_path, capsys):
  from pipelines.cli import generate
  args = ["--prompt", "a fox", "--size", "32x32", "--frames", "5", "--steps", "1", "--seed", "1",
          "--max-sequence-length", "16"]
  assert generate.main(args + ["--mesh", "auto", "--out", str(tmp_path / "auto.npy")]) == 0
  err = capsys.readouterr().err
  assert "--mesh auto:" in err, err
  sidecar = json.loads((tmp_path / "auto.npy.json").read_text())
  assert sidecar["mesh"]["auto"] is True and sidecar["mesh"]["devices"]
  assert MeshSpec.parse(sidecar["mesh"]["spec"]).devices == jax.device_count()
  assert generate.main(args + ["--mesh", "CFG=2,U=2,R=2", "--shard-weights", "--out", str(tmp_path / "c.npy")]) == 0
  sidecar = json.loads((tmp_path / "c.npy.json").read_text())
  assert sidecar["mesh"]["spec"] == "CFG=2,U=2,R=2" and sidecar["mesh"]["shard_weights"] is True
  assert_psnr_at_least(np.load(tmp_path / "c.npy"), np.load(tmp_path / "auto.npy"), MESH_PSNR_DB,
                       name="generate CFG=2,U=2,R=2 sharded vs auto")
  capsys.readouterr()
  assert generate.main(args + ["--mesh", "CFG=2,U=2", "--guidance", "1.0", "--out", str(tmp_path / "d.npy")]) == 2
  assert ("--mesh: mesh CFG=2,U=2,R=1 splits classifier-free guidance over CFG=2, but guidance is off "
          "(guidance_scale <= 1); use U=2,R=1 (or turn guidance on)") in capsys.readouterr().err



def test_generate_mesh_auto_keeps_windows_that_continue_off_the_windows_axis(tmp_path, capsys):
  """Windows that continue run one after another: --mesh auto plans them with W = 1 (W > 1 would be
  refused), where the same windows blended may take a windows axis (the planner is offered W up
  to their count)."""
  from pipelines.cli import devices, generate
  from pipelines.pipeline.checked.model_facts import ModelFacts
  from pipelines.pipeline.checked.request import GenerationRequest
  call = dict(height=32, width=32, num_frames=65, context_frames=17, context_overlap=8, seed=0)
  for fuse, parallel in (("continue", 1), ("pyramid", 5)):
    request = GenerationRequest.build(ModelFacts.tiny_random("float32"), "x", context_fuse=fuse, **call)
    assert devices._parallel_windows(request) == parallel
  args = ["--model", "tiny-random", "--prompt", "a fox", "--size", "32x32", "--frames", "29", "--steps", "1",
          "--seed", "1", "--context-frames", "17", "--context-overlap", "8", "--mesh", "auto"]
  assert generate.main(args + ["--context-fuse", "continue", "--out", str(tmp_path / "c.npy")]) == 0
  spec = MeshSpec.parse(json.loads((tmp_path / "c.npy.json").read_text())["mesh"]["spec"])
  assert spec.windows == 1 and spec.devices == jax.device_count()
  capsys.readouterr()
  assert generate.main(args[:-2] + ["--mesh", "W=2,U=2,R=2", "--context-fuse", "continue",
                                    "--out", str(tmp_path / "w.npy")]) == 2
  assert "context_fuse='continue' runs the windows one after another" in capsys.readouterr().err
