"""The quality check (end_to_end/quality/check.py) run in-process on the TPU: the tiny default in
bf16 and in fp32 on the one chip (U=1,R=1, the pipeline's default attention path) against its fp32
one-device LSE reference, also on the TPU, judged by the tool's own bars for trained content (fp32
60 dB / SSIM 0.99, bf16 35 dB / 0.98, mean over frames). Unlike tests/tpu/test_pipeline.py this is
TPU against TPU: what a user of the tool sees on the chip.
"""

from __future__ import annotations

import json

import pytest

from end_to_end.quality import check

pytestmark = pytest.mark.tpu


def test_quality_check_passes_on_the_chip(tmp_path):
  report_path = tmp_path / "quality.json"
  status = check.main(["--model", "tiny", "--mesh", "U=1,R=1", "--dtype", "bfloat16", "--dtype", "float32",
                       "--json", str(report_path)])
  report = json.loads(report_path.read_text())
  assert report["backend"] == "tpu", report["backend"]
  rows = {row["dtype"]: row for row in report["candidates"]}
  assert set(rows) == {"bfloat16", "float32"}
  for dtype, row in rows.items():
    assert row["passed"], f"{dtype}: {row['failures']} (PSNR mean {row['psnr_mean']:.2f} dB)"
  assert rows["float32"]["psnr_mean"] >= 60 and rows["bfloat16"]["psnr_mean"] >= 35
  assert status == 0
