"""end_to_end.bench.stream: per-chunk rows, the FLOP count and the cache's bytes (no timing asserted)."""

import json

from end_to_end.bench import stream
from pipelines.wan.pretrained import TINY_TRANSFORMER


def test_rows_flops_and_cache_bytes(tmp_path, capsys):
  """Five chunks of 3 frames, window 6: past frames 0, 3, 3, 3, 3; the FLOPs grow with the keys
  seen; the run's cache holds 3 frames of 16 tokens (keys and values, 2 layers, fp32)."""
  path = str(tmp_path / "s.json")
  stream.main(["--chunks", "5", "--json", path])
  result = json.load(open(path))
  assert [r["past_frames"] for r in result["chunks"]] == [0, 3, 3, 3, 3]
  flops = [r["tflops"] for r in result["chunks"]]
  assert flops[1] > flops[0] and flops[1] == flops[4]
  c = TINY_TRANSFORMER
  assert result["cache_bytes_run"] == 2 * c.num_layers * 3 * 16 * c.dim * 4
  assert "from chunk 3 on with the window full" in capsys.readouterr().out
