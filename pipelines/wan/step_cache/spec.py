"""Step-cache settings: the spec strings, MagCache's calibrated ratios, the record of a cached run.

No JAX: what a step-cache argument means (`parse_step_cache`), checked before anything is loaded.
The methods and the state they carry are described in pipelines/wan/step_cache/forward.py. S: denoising
steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

METHODS = ("first-block", "mag")
MAG_DEFAULT_MAX_SKIPS = 3  # diffusers MagCacheConfig.max_skip_steps
MAG_DEFAULT_RETENTION = 0.2  # diffusers MagCacheConfig.retention_ratio
# Ratios of the embedded tiny model (`WanPipeline.tiny()`), written by
# `python -m end_to_end.train.calibrate_cache --model tiny --out pipelines/wan/step_cache/mag_ratios_tiny.json`.
TINY_RATIOS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mag_ratios_tiny.json")

SPEC_HELP = ("None, 'first-block:THRESH' (e.g. 'first-block:0.05') or 'mag:THRESH[:K][@RATIOS.json]' "
             "(e.g. 'mag:0.1', 'mag:0.1:3@ratios.json'); THRESH a finite number >= 0, K an int >= 1")


class StepCacheError(ValueError):
  """A step-cache spec or calibration file that cannot be used; the message says what to pass."""


@dataclasses.dataclass(frozen=True)
class StepCacheSpec:
  """A parsed step-cache setting.

  Attributes:
    method: "first-block" or "mag".
    threshold: skip while the method's error measure is below it (strictly; 0 never skips).
    max_skips: MagCache's K, the most consecutive skipped steps (None for first-block).
    retention: MagCache's fraction of first steps that always run (None for first-block).
    ratios: MagCache's calibrated magnitude ratios, one per step of the calibration run.
    ratios_source: where `ratios` came from (a file path), for the record.
  """
  method: str
  threshold: float
  max_skips: int | None = None
  retention: float | None = None
  ratios: tuple[float, ...] | None = None
  ratios_source: str | None = None

  def __post_init__(self):
    if self.method not in METHODS:
      raise StepCacheError(f"step cache method {self.method!r} is not one of {METHODS}")
    if not (isinstance(self.threshold, (int, float)) and math.isfinite(self.threshold)
            and self.threshold >= 0):
      raise StepCacheError(f"step cache threshold {self.threshold!r} must be a finite number >= 0")
    if self.method == "mag":
      if not (isinstance(self.max_skips, int) and self.max_skips >= 1):
        raise StepCacheError(f"MagCache K={self.max_skips!r} must be an int >= 1")
      if not (isinstance(self.retention, (int, float)) and 0 <= self.retention <= 1):
        raise StepCacheError(f"MagCache retention={self.retention!r} must be in [0, 1]")
      _check_ratios(self.ratios, self.ratios_source or "ratios")

  def describe(self) -> str:
    """The spec string that gives this setting back (with the ratios file unless it is the
    built-in tiny calibration)."""
    if self.method == "first-block":
      return f"first-block:{self.threshold:g}"
    shipped = self.ratios_source in (None, TINY_RATIOS_FILE)
    return f"mag:{self.threshold:g}:{self.max_skips}" + ("" if shipped else f"@{self.ratios_source}")

  def identity(self) -> dict[str, Any]:
    """What a resumed run must match (`pipelines.pipeline.run.resume`): the setting and its ratios, not the
    file they were read from."""
    out = self.to_dict()
    out.pop("ratios_source", None)
    out["spec"] = self.describe().split("@")[0]
    return out

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready record of the setting (ratios included for MagCache)."""
    out = {"spec": self.describe(), "method": self.method, "threshold": self.threshold}
    if self.method == "mag":
      out.update(max_skips=self.max_skips, retention=self.retention, ratios_source=self.ratios_source,
                 ratios=list(self.ratios))
    return out


def _check_ratios(ratios: Any, source: str) -> tuple[float, ...]:
  if (not isinstance(ratios, (list, tuple)) or not ratios
      or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0
                 for r in ratios)):
    raise StepCacheError(f"{source}: MagCache ratios must be a non-empty list of finite numbers > 0, "
                         f"got {str(ratios)[:80]}")
  return tuple(float(r) for r in ratios)


def load_ratios(path: str) -> tuple[float, ...]:
  """MagCache ratios from a calibration file (`end_to_end.train.calibrate_cache` output, or any JSON
  object with "ratios": [gamma_0, ..., gamma_{S-1}]).

  Raises:
    StepCacheError: no such file, not JSON, or no valid "ratios" list in it.
  """
  if not os.path.isfile(path):
    raise StepCacheError(f"MagCache ratios file {path!r} does not exist; write one with "
                         "`python -m end_to_end.train.calibrate_cache --model MODEL --out FILE.json`")
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise StepCacheError(f"MagCache ratios file {path!r} is not valid JSON: {e}") from e
  if not isinstance(data, dict) or "ratios" not in data:
    raise StepCacheError(f"MagCache ratios file {path!r} has no 'ratios' list")
  return _check_ratios(data["ratios"], path)


_NUMBER = r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?"
_SPEC = re.compile(rf"^(?P<method>[a-z-]+):(?P<threshold>{_NUMBER})(?::(?P<k>[0-9]+))?(?:@(?P<file>.+))?$")


def parse_step_cache(spec: str | StepCacheSpec | None, *, model: str = "") -> StepCacheSpec | None:
  """A `step_cache` argument as a `StepCacheSpec` (None: caching off). No compute.

  Args:
    spec: None, a `StepCacheSpec`, or a string (see `SPEC_HELP`): "first-block:THRESH",
      "mag:THRESH[:K][@RATIOS.json]".
    model: the pipeline's `name` ("tiny" for the embedded model): "mag" without @FILE uses the
      shipped tiny calibration for "tiny" and is refused for any other model.

  Raises:
    StepCacheError (a ValueError): anything else, naming the value and the accepted forms.
  """
  if spec is None or isinstance(spec, StepCacheSpec):
    return spec
  if not isinstance(spec, str):
    raise StepCacheError(f"step_cache={spec!r} must be {SPEC_HELP}, not a {type(spec).__name__}")
  match = _SPEC.match(spec.strip())
  if match is None or match["method"] not in METHODS:
    raise StepCacheError(f"step_cache={spec!r} is not understood; use {SPEC_HELP}")
  threshold = float(match["threshold"])
  if match["method"] == "first-block":
    if match["k"] is not None or match["file"] is not None:
      raise StepCacheError(f"step_cache={spec!r}: first-block takes only a threshold "
                           "(e.g. 'first-block:0.05')")
    return StepCacheSpec("first-block", threshold)
  k = MAG_DEFAULT_MAX_SKIPS if match["k"] is None else int(match["k"])
  if k < 1:
    raise StepCacheError(f"step_cache={spec!r}: K={k} must be >= 1 (the most consecutive skips)")
  path = match["file"]
  if path is None:
    if model != "tiny":
      raise StepCacheError(
          f"step_cache={spec!r}: MagCache needs ratios calibrated for this model ({model or 'unnamed'}); "
          "write them with `python -m end_to_end.train.calibrate_cache --model FOLDER --out ratios.json` "
          f"and pass 'mag:{match['threshold']}:{k}@ratios.json'")
    path = TINY_RATIOS_FILE
  return StepCacheSpec("mag", threshold, max_skips=k, retention=MAG_DEFAULT_RETENTION,
                       ratios=load_ratios(path), ratios_source=path)


def nearest_interp(ratios: Sequence[float], length: int) -> np.ndarray:
  """Resamples calibrated ratios to `length` steps by nearest index (diffusers' `nearest_interp`).

  Returns:
    float32 [length]: ratios[round(i * (len - 1) / (length - 1))]; the last ratio when length == 1.
  """
  src = np.asarray(ratios, np.float32)
  if length == 1:
    return src[-1:]
  index = np.round(np.arange(length, dtype=np.float64) * (len(src) - 1) / (length - 1)).astype(int)
  return src[index]


def summary(spec: StepCacheSpec, steps: Sequence[tuple[int, bool, float]], *,
            num_layers: int) -> dict[str, Any]:
  """The record of a cached run for `run(...).settings["step_cache"]` and the sidecar.

  Args:
    spec: the setting.
    steps: (step index, skipped, metric) per step of the video, from `cached_forward`'s stats (a
      resumed run's steps before its checkpoint come from the checkpoint).
    num_layers: Z, blocks per transformer evaluation.

  Returns:
    `spec.to_dict()` plus steps_recorded (the step indices covered), skipped_steps (step
    indices), skipped_fraction (of the recorded steps), skipped_block_fraction (of block
    evaluations: first-block always runs block 0), and metrics (per recorded step; None where not
    finite).
  """
  skipped_steps = [k for k, skipped, _ in steps if skipped]
  per_skip = (num_layers - 1) / num_layers if spec.method == "first-block" else 1.0
  fraction = len(skipped_steps) / len(steps) if steps else 0.0
  return {**spec.to_dict(), "steps_recorded": [k for k, _, _ in steps], "skipped_steps": skipped_steps,
          "skipped_fraction": fraction, "skipped_block_fraction": fraction * per_skip,
          "metrics": [float(m) if math.isfinite(m) else None for _, _, m in steps]}
