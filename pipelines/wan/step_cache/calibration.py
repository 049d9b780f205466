"""What a MagCache calibration was made for, and whether a run matches it.

MagCache's per-step magnitude ratios (`pipelines/wan/step_cache/forward.py`, arXiv:2506.09045) are a
property of one model at one setting: the residual's magnitude from step to step depends on the
weights, on the token count (size, frames), on the sampler's sigmas (steps) and on the text
conditioning (text length, as Wan's cross-attention sees the zero padding). Ratios measured for
another model or setting skip the wrong steps: the tiny model's first file, measured on the
random-weight model at 256x256 / 512 tokens / 50 steps (ratios ~1.0), made `mag:0.05` on the trained
default (64x64, 64 tokens, 8 steps; ratios 1.0 down to 0.75) skip 5 of 8 steps including the last.

`end_to_end.train.calibrate_cache` writes `record_fields(...)` into every calibration file;
`check_calibration` compares a file's fields with a run's and says what differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The fields a calibration file records about the run it measured (besides "ratios").
FIELDS = ("model", "model_fingerprint", "width", "height", "frames", "steps", "max_sequence_length")


def record_fields(*, model: str, fingerprint: str, width: int, height: int, frames: int, steps: int,
                  max_sequence_length: int) -> dict[str, Any]:
  """The metadata `end_to_end.train.calibrate_cache` writes next to the ratios.

  Args:
    model: the model's name ("tiny", "tiny-random", or a folder's base name).
    fingerprint: `WanPipeline.fingerprint()` (SHA-256 hex of configs and sampled weights).
    width, height: pixels; frames: video frames; steps: denoising steps; max_sequence_length:
      text tokens per prompt.
  """
  return {"model": model, "model_fingerprint": fingerprint, "width": int(width), "height": int(height),
          "frames": int(frames), "steps": int(steps), "max_sequence_length": int(max_sequence_length)}


def _short(key: str, value: Any) -> str:
  """A field's value for a message: fingerprints cut to 12 hex digits."""
  if key == "model_fingerprint" and isinstance(value, str):
    return value[:12] + "..."
  return repr(value)


def _recorded(metadata: Mapping[str, Any]) -> dict[str, Any]:
  """`FIELDS` from a calibration file's JSON object, reading the older layout too (size and text
  length only under "calibration", no fingerprint); a field it lacks is absent."""
  out = {k: metadata[k] for k in FIELDS if k in metadata}
  old = metadata.get("calibration")
  if isinstance(old, Mapping):
    size = old.get("size")
    if "width" not in out and isinstance(size, str) and "x" in size:
      try:
        out["width"], out["height"] = (int(v) for v in size.split("x"))
      except ValueError:
        pass
    for key in ("frames", "max_sequence_length"):
      if key not in out and key in old:
        out[key] = old[key]
  return out


def check_calibration(metadata: Mapping[str, Any], *, model: str, height: int, width: int,
                      num_frames: int, steps: int, fingerprint: str | None = None,
                      max_sequence_length: int | None = None, source: str = "the MagCache ratios") -> str | None:
  """Compares what a calibration was made for with a run; a warning when they differ.

  Args:
    metadata: the calibration file's JSON object (`end_to_end.train.calibrate_cache` output).
    model: the run's model name (`WanPipeline.name`: "tiny" for both embedded models, so pass
      `fingerprint` to tell them apart).
    height, width: pixels; num_frames: frames; steps: denoising steps of the run.
    fingerprint: the run's `WanPipeline.fingerprint()`; None skips the weights comparison.
    max_sequence_length: the run's text tokens; None skips that comparison.
    source: how to name the file in the message (e.g. its path).

  Returns:
    None when every recorded field matches the run; else one line naming each field that differs
    or that the file does not record, what the file says and what the run uses, and the
    `train.calibrate_cache` command that measures ratios for this run. A step count that differs is
    included (ratios for another count are resampled by nearest index, which is only an
    approximation of the run's own sigmas).
  """
  recorded = _recorded(metadata)
  run: dict[str, Any] = {"model": model, "width": width, "height": height, "frames": num_frames,
                         "steps": steps}
  if fingerprint is not None:
    run["model_fingerprint"] = fingerprint
  if max_sequence_length is not None:
    run["max_sequence_length"] = max_sequence_length
  differ = [f"{k.replace('_', ' ')} {_short(k, recorded[k])} (this run: {_short(k, v)})"
            for k, v in run.items() if k in recorded and recorded[k] != v]
  missing = [k for k in run if k not in recorded]
  if not differ and not missing:
    return None
  parts = []
  if differ:
    parts.append("were calibrated for " + ", ".join(differ))
  if missing:
    parts.append("do not record the " + ", ".join(k.replace("_", " ") for k in missing))
  text = "" if max_sequence_length is None else f" --max-sequence-length {max_sequence_length}"
  return (f"{source} " + " and ".join(parts) + "; the skipped steps may be wrong (a step-cache "
          "calibration belongs to one model and setting). Measure ratios for this run with `python -m "
          f"end_to_end.train.calibrate_cache --model MODEL --size {width}x{height} --frames {num_frames} "
          f"--steps {steps}{text} --out ratios.json` and pass mag:THRESH@ratios.json")


def warn_other_calibration(spec: Any, *, model: str, fingerprint: Any, height: int, width: int, num_frames: int,
                           steps: int, max_sequence_length: int) -> None:
  """Warns (`check_calibration`'s line) when a MagCache spec's ratios file was made for another model
  or setting: its skips would not fit this run. `spec`: the run's `StepCacheSpec` or None (nothing
  to check, as for another method or ratios given as numbers); `fingerprint`: a callable giving the
  run's `WanPipeline.fingerprint()` (only called when there is a file to compare)."""
  import warnings

  from pipelines.storage import weights

  if spec is None or spec.method != "mag" or spec.ratios_source is None:
    return
  try:
    metadata = weights.read_json(spec.ratios_source)
  except weights.CheckpointError:
    return  # ratios given as numbers, not a file: nothing recorded to compare
  line = check_calibration(metadata, model=model, height=height, width=width, num_frames=num_frames, steps=steps,
                           fingerprint=fingerprint(), max_sequence_length=max_sequence_length,
                           source=spec.ratios_source)
  if line is not None:
    warnings.warn(line, stacklevel=4)
