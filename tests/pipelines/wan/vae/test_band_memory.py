"""The banded decode's memory (`pipelines/wan/vae/band_memory.py`): XLA's analysis of the compiled
programs on abstract inputs, and the band height a budget allows. The tiny preset at Hl = 40, Wl = 3
(tail radius 11, so 1-row bands run in windows of 23 rows) keeps each compile to about a second."""

import pytest

from pipelines.wan import vae as V

CFG, B, HL, WL = V.VAE_PRESETS["tiny"], 1, 40, 3


def test_choose_band_rows_and_the_memory_it_promises():
  whole = V.decode_memory(CFG, B, HL, WL)
  # The cache and activations (nearly all of the bytes here) scale with the window's rows.
  assert V.decode_memory(CFG, B, HL, WL, band_rows=1) < 0.7 * whole
  assert V.choose_band_rows(CFG, B, HL, WL, budget_bytes=whole) is None
  budget = int(0.7 * whole)
  rows = V.choose_band_rows(CFG, B, HL, WL, budget_bytes=budget)
  assert 1 <= rows < HL - 2 * V.tail_radius(CFG)
  # The estimate (the whole decode scaled by the window's rows) holds for the compiled programs.
  assert V.decode_memory(CFG, B, HL, WL, band_rows=rows) <= budget
  with pytest.raises(ValueError, match="no band height fits budget_bytes=1000"):
    V.choose_band_rows(CFG, B, HL, WL, budget_bytes=1000)
