"""The whole-pipeline TPU AOT report's stages other than the denoise step: text encoder and VAE decode.

`python -m end_to_end.bench.pipeline --aot v6e:2x4 --stages text,step,decode --aot-models 14b` compiles
every program a run needs, per stage: the UMT5-XXL text encoder (`text.py`, once: every Wan model
shares it), the denoise step for each model (`step.compile_denoise_step`) and the VAE decoder's
first-chunk and later-chunk programs (`vae.py`), on one device and with the rows split over every
device of the topology (`decode_parallel`). With `--compile-cache DIR`, JAX's persistent
compilation cache is on and each row says whether DIR already held the program's entry ("entry
found": a second process compiling the same program computed the same key) or the compile wrote
it ("written"). On a host without a TPU the compile-only client cannot load a found entry (JAX
warns and compiles again), so the warm compile time itself needs a TPU; the key match is what can
be checked here.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

STAGES = ("text", "step", "decode")
# --aot-models name -> (VAE preset, height, width) of its decode.
DECODE_TARGETS = {"1.3b": ("wan2.1", 480, 832), "14b": ("wan2.1", 720, 1280), "a14b": ("wan2.1", 720, 1280),
                  "i2v-14b": ("wan2.1", 720, 1280), "vace-14b": ("wan2.1", 720, 1280),
                  "ti2v-5b": ("wan2.2", 704, 1280)}


def parse_stages(text: str) -> list[str]:
  """The comma-separated `--stages` value as a list (ValueError naming an unknown stage)."""
  stages = [s.strip() for s in text.split(",") if s.strip()]
  unknown = [s for s in stages if s not in STAGES]
  if unknown or not stages:
    raise ValueError(f"--stages {text!r}: comma-separated from {', '.join(STAGES)}")
  return stages


def enable_compile_cache(directory: str) -> None:
  """JAX's persistent compilation cache in `directory`, for every program however short its compile."""
  import jax

  os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class _CacheEvents(logging.Handler):
  """Records JAX's persistent-cache hit and miss log lines: (program, "hit" | "miss")."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.events: list[tuple[str, str]] = []

  def emit(self, record: logging.LogRecord) -> None:
    message = record.getMessage()
    for marker, status in (("Persistent compilation cache hit for", "hit"),
                           ("PERSISTENT COMPILATION CACHE MISS for", "miss")):
      if message.startswith(marker):
        self.events.append((message.split("'")[1], status))


def with_cache_status(directory: str | None, compile_fn: Callable[[], Any]) -> tuple[Any, str]:
  """(compile_fn(), status) of the programs compiled inside: "off" (no cache), "written" (every
  lookup missed: this compile wrote the entries), "entry found" (every lookup found its entry: a
  hit, or an entry the compile-only client could not load), or "mixed"; from JAX's own log lines
  and warnings, so other processes writing to the same directory do not blur it."""
  if directory is None:
    return compile_fn(), "off"
  logger, handler = logging.getLogger("jax._src.compiler"), _CacheEvents()
  level = logger.level
  logger.addHandler(handler)
  logger.setLevel(logging.DEBUG)
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      result = compile_fn()
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)
  found = {str(w.message).split("'")[1] for w in caught
           if str(w.message).startswith("Error reading persistent compilation cache entry")}
  statuses = {"hit" if name in found or status == "hit" else "miss" for name, status in handler.events}
  return result, {frozenset({"miss"}): "written", frozenset({"hit"}): "entry found"}.get(frozenset(statuses), "mixed")


def text_rows(devices: list[Any], mesh_spec: Any, cache_dir: str | None) -> list[dict[str, Any]]:
  """The text encoder as the pipeline places it: one device, and split when `mesh_spec` shards weights."""
  from end_to_end.aot.text import compile_text_encoder

  specs = [None] + ([mesh_spec] if mesh_spec is not None and mesh_spec.shard_weights else [])
  rows = []
  for spec in specs:
    row, cache = with_cache_status(cache_dir, lambda: compile_text_encoder(devices, mesh_spec=spec))
    rows.append(dict(row, cache=cache))
  return rows


def decode_rows(devices: list[Any], models: list[str], dtype: str, cache_dir: str | None,
                emit: Callable[[dict[str, Any]], None], compile_effort: float | None = None,
                breakdown: bool = False) -> list[dict[str, Any]]:
  """The VAE decoder's two programs for each distinct decode among `models`, one device and split,
  compiled at `compile_effort` (None: the pipeline's, `vae.decode_compile_effort`); with `breakdown`,
  each program's modelled time by op class (`compile_vae_decode`)."""
  import jax

  from end_to_end.aot.vae import compile_vae_decode

  rows = []
  for vae, height, width in dict.fromkeys(DECODE_TARGETS[m] for m in models if m in DECODE_TARGETS):
    for split in (False, True):
      start = time.perf_counter()
      try:
        found, cache = with_cache_status(cache_dir, lambda: compile_vae_decode(
            devices, height=height, width=width, vae=vae, dtype=dtype, split=split,
            compile_effort=compile_effort, breakdown=breakdown))
      except Exception as e:  # noqa: BLE001 - e.g. out of HBM: report the row, go on
        found, cache = [dict(stage="decode", program="both", vae=vae, height=height, width=width, split=split,
                             devices=sum(d.process_index == jax.process_index() for d in devices) if split else 1,
                             error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                             compile_s=time.perf_counter() - start)], "off"
      for row in found:
        rows.append(dict(row, cache=cache))
        emit(rows[-1])
  return rows


def format_decode_row(r: dict[str, Any]) -> str:
  """One line of the decode stage (per device: GiB, MiB; collectives count / MiB)."""
  where = f"rows over {r['devices']}" if r["split"] else "one device"
  head = f"decode {r['vae']} {r['height']}x{r['width']} {where:14s} {r['program']:5s}"
  if "error" in r:
    return f"{head} failed: {r['error']}"
  mem = r.get("memory_analysis", {})
  from end_to_end.aot.collectives import summary

  cycles = f"{r['estimated_cycles'] / 1e6:.0f} M cycles estimated, " if "estimated_cycles" in r else ""
  return (f"{head} compile {r['compile_s']:6.1f} s ({r['compile_cpu_s']:.1f} s CPU, effort "
          f"{r.get('compile_effort', 0):g}), convolutions "
          f"{r['convolutions']} ({r['distinct_convolutions']} distinct), args "
          f"{mem.get('argument_size_in_bytes', 0) / 2**30:.2f} GiB, temp {mem.get('temp_size_in_bytes', 0) / 2**30:.2f} "
          f"GiB, code {mem.get('generated_code_size_in_bytes', 0) / 2**20:.1f} MiB, collectives {summary(r['collectives'])}, "
          f"{cycles}cache {r['cache']}")


def print_row(line: str, row: dict[str, Any]) -> None:
  """Prints a compiled program's report `line`, then its modelled time by op class (`--breakdown`)
  where its row has one (the step's and the decoder's programs)."""
  print(line, flush=True)
  if "breakdown" in row:
    from end_to_end.aot.breakdown import format_breakdown
    print(format_breakdown(row["breakdown"]), flush=True)
