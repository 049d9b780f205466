"""The collectives report (end_to_end/aot/collectives.py): a compiled USP program moves exactly the
theoretical minimum, op by op and byte by byte (fp32 on CPU meshes)."""

import pytest

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


@pytest.mark.parametrize("mesh,tokens,heads,kv_heads", [("U=2,R=4", 250, 4, 2), ("R=2,U=4", 256, 8, 2)])
def test_collectives_report_meets_minimum(mesh, tokens, heads, kv_heads, tmp_path):
  from end_to_end.aot.collectives import main
  report = main(["--mesh", mesh, "--tokens", str(tokens), "--heads", str(heads), "--kv-heads",
                 str(kv_heads), "--head-dim", "16", "--dtype", "float32", "--json", str(tmp_path / "r.json")])
  # fp32 on CPU: the compiled program moves exactly the theoretical minimum, op by op, byte by byte.
  assert report["collectives"] == report["minimum"]
  assert report["collectives"]["all-to-all"]["bytes"] > 0
  assert (tmp_path / "r.json").exists()
