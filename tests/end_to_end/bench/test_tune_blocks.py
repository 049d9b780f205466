"""The block-size tuner (end_to_end/bench/tune_blocks.py): its pick rule over measured tables, and a small
measured grid (refusing to time Pallas in interpret mode)."""

import pytest

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


def test_tune_blocks_pick_rule():
  from end_to_end.bench import tune_blocks

  def row(bq, bk, code=1.0, error=None):
    cell = dict(error=error) if error else dict(code_mib=code)
    return dict(block_q=bq, block_kv=bk, lse=cell, fixed_m=dict(cell))

  # T = 3000: blocks of 2048 pad it to 4096 (x1.86 the work of 3072); 1024 x 1024 has code 2x the
  # least; 512 x 512 is refused. Left: the small pairs and 1024 x 512 / 512 x 1024 (equal area, the
  # larger block_q wins).
  rows = [row(256, 256), row(512, 256), row(512, 512, error="CompileTimeScopedVmemOom"), row(512, 1024, 1.2),
          row(1024, 512, 1.1), row(1024, 1024, 2.0), row(2048, 512), row(512, 2048)]
  table = dict(shape=[1, 3000, 2, 128], rows=rows)
  assert tune_blocks.eligible_pairs(table) == [(256, 256), (512, 256), (512, 1024), (1024, 512)]
  assert tune_blocks.pick_blocks([table]) == (1024, 512)
  # A second shape where 1024 x 512 is refused: the pick must pass in every table.
  other = dict(shape=[1, 4096, 2, 128], rows=[r if (r["block_q"], r["block_kv"]) != (1024, 512)
                                              else row(1024, 512, error="refused") for r in rows])
  assert tune_blocks.pick_blocks([table, other]) == (512, 1024)
  assert tune_blocks.pick_blocks([dict(shape=[1, 256, 1, 128], rows=[row(256, 256, error="x")])]) is None


def test_tune_blocks_measures_grid_and_refuses_interpret_timing(tmp_path):
  from end_to_end.bench import tune_blocks

  path = tmp_path / "table.json"
  rows = tune_blocks.main(["--backend", "xla", "--seq", "256", "--heads", "2", "--head-dim", "32",
                           "--dtype", "float32", "--block-q", "128,256", "--block-kv", "128", "--repeats", "1",
                           "--json", str(path)])
  assert sorted((r["block_q"], r["block_kv"]) for r in rows) == [(128, 128), (256, 128)]
  times = [r["fixed_m"]["median_s"] for r in rows]
  assert times == sorted(times) and all(t > 0 for t in times)
  import json
  assert json.loads(path.read_text())["rows"] == rows
  with pytest.raises(SystemExit, match="interpret mode"):
    tune_blocks.main(["--backend", "pallas"])
