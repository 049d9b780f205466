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


def test_a_known_whole_decode_is_not_analysed_again(monkeypatch):
  """The memory plan passes the whole-frame peak of the programs it compiled for the decode: the band
  choice then neither lowers nor compiles that decode again, and chooses as it would have."""
  from pipelines.wan.vae import band_memory

  whole = V.decode_memory(CFG, B, HL, WL)
  budget = int(0.7 * whole)
  expected = V.choose_band_rows(CFG, B, HL, WL, budget_bytes=budget)
  monkeypatch.setattr(band_memory, "decode_memory", lambda *a, **k: pytest.fail(f"analysed again: {a} {k}"))
  assert V.choose_band_rows(CFG, B, HL, WL, budget_bytes=budget, whole=whole) == expected is not None
  assert V.choose_band_rows(CFG, B, HL, WL, budget_bytes=whole, whole=whole) is None
  with pytest.raises(pytest.fail.Exception, match="analysed again"):  # positive control: without it
    V.choose_band_rows(CFG, B, HL, WL, budget_bytes=budget)


def test_a_program_too_large_to_compile_counts_what_the_error_reports():
  """XLA:TPU refuses at compile time a program larger than the chip; its peak is then the arguments
  plus the temporaries the error names (or more than any device holds), and other errors propagate."""
  import jax
  import jax.numpy as jnp
  import pytest

  from pipelines.wan.vae import band_memory

  lowered = jax.jit(lambda x, y: x @ y).lower(jnp.ones((4, 8)), jnp.ones((8, 2), jnp.bfloat16))

  class TooLarge:
    in_avals = lowered.in_avals

    def __init__(self, message):
      self.message = message

    def compile(self):
      raise RuntimeError(self.message)

  oom = ("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. ... the total memory required for HLO "
         "temporaries (18.19G) exceeds available HBM (15.75G).")
  assert band_memory.program_peak(TooLarge(oom)) == 4 * 8 * 4 + 8 * 2 * 2 + int(18.19 * 2 ** 30)
  assert band_memory.program_peak(TooLarge("RESOURCE_EXHAUSTED: no size")) >= band_memory.TOO_LARGE
  with pytest.raises(RuntimeError, match="another failure"):
    band_memory.program_peak(TooLarge("another failure"))
  assert band_memory.program_peak(lowered) > 0  # a program that compiles: its analysis
