"""The checks and conversions of a pipeline call's single arguments (ints, numbers, flags, arrays).

Everything here runs before any compute: each bad argument raises a ValueError naming the argument,
its value and the fix (a bool is not an int, a str not a number, NaN/inf not a number either).
`GenerationRequest.build` (pipeline/request.py) applies them in diffusers' order.
"""

from __future__ import annotations

import math
import numbers
import reprlib
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.parallel import distributed
from pipelines.pipeline.checked import seed as seeding


def is_int(value: Any) -> bool:
  """An int or numpy integer; not a bool (True would pass for 1)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value: Any) -> bool:
  """An int or float (Python or numpy); not a bool, str, complex or array."""
  return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def not_a(value: Any, type_ok: bool = False) -> str:
  """", not a str" / ", not an int" (the wrong type named) for a message; "" when `type_ok`."""
  name = type(value).__name__
  return "" if type_ok else f", not {'an' if name[0] in 'aeiou' else 'a'} {name}"


def check_int(name: str, value: Any, *, minimum: int = 1, hint: str = "") -> int:
  """`value` as an int, if it is one (a bool is not) and >= `minimum`.

  Raises:
    ValueError: otherwise, naming the argument, its value, its type when wrong, and `hint`.
  """
  if not is_int(value) or value < minimum:
    what = {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")
    raise ValueError(f"{name}={value!r} must be {what}{not_a(value, is_int(value))}{hint}")
  return int(value)


def check_number(name: str, value: Any, *, positive: bool = False, within: tuple[float, float] | None = None,
                 hint: str = "") -> float:
  """`value` as a float, if it is a finite real number (a bool or str is not), > 0 with `positive`,
  in the closed range `within` (lo, hi) when given.

  Raises:
    ValueError: otherwise, naming the argument, its value, its type when wrong, the range, and `hint`.
  """
  bounds = "" if within is None else f" in [{within[0]:g}, {within[1]:g}]"
  if (not is_real(value) or not math.isfinite(value) or (positive and value <= 0)
      or (within is not None and not within[0] <= value <= within[1])):
    raise ValueError(f"{name}={value!r} must be a finite number{' > 0' if positive else ''}{bounds}"
                     f"{not_a(value, is_real(value))}{hint}")
  return float(value)


def check_flag(name: str, value: Any) -> bool:
  """`value` if it is a bool (numpy's included).

  Raises:
    ValueError: anything else (1, "no", None), naming the argument and its value.
  """
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name}={value!r} must be True or False{not_a(value)}")
  return bool(value)


def texts(value: Any, repeat: int = 1) -> list[str] | None:
  """A str (repeated `repeat` times) or a non-empty list / tuple of str as a list; None otherwise."""
  if isinstance(value, str):
    return [value] * repeat
  if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
    return list(value)
  return None


# diffusers `WanPipeline._callback_tensor_inputs`: what `callback_on_step_end` may ask for.
CALLBACK_TENSOR_INPUTS = ("latents", "prompt_embeds", "negative_prompt_embeds")
OUTPUT_TYPES = ("np", "latent", "pil")


def host_array(value: Any) -> np.ndarray | None:
  """`value` (numpy, JAX (also a global multi-process array) or CPU torch) as numpy; None when it
  is not an array of real numbers (a str, dict, bool or complex values, torch bfloat16, ...)."""
  try:
    array = distributed.to_host(value) if isinstance(value, jax.Array) else np.asarray(value)
  except (TypeError, ValueError, RuntimeError):  # e.g. a ragged list; torch bfloat16
    return None
  if array.dtype == bool or not (jnp.issubdtype(array.dtype, jnp.floating)
                                 or jnp.issubdtype(array.dtype, jnp.integer)):
    return None
  return array


def noise_array(latents: Any) -> np.ndarray:
  """Explicit noise (numpy, JAX or torch; float or int) as float32 numpy.

  Raises:
    ValueError: not an array of real numbers (a str, a dict, complex or bool values, ...).
  """
  array = host_array(latents)
  if array is None:
    try:
      what = f"{type(latents).__name__} of {np.asarray(latents).dtype}"
    except (TypeError, ValueError, RuntimeError):  # e.g. a ragged list; torch bfloat16
      what = type(latents).__name__
    raise ValueError(f"latents={reprlib.repr(latents)} ({what}) must be an array of real numbers "
                     "[B, C, F, Hl, Wl] (float32 noise), or None to draw it from the seed")
  return array.astype(np.float32)


def seed_or_latents(seed: Any, latents: Any, shape: tuple[int, ...], what: str) -> tuple[Any, np.ndarray | None]:
  """(seed, latents): exactly one of them, checked; a seed drawn (`seed.random_seed`) when neither is
  given. A seed is an int >= 0 or one per video (`seed.video_seeds`); latents float32 [B', C, F, Hl, Wl].

  Args:
    shape: the call's latent shape [B', C, F, Hl, Wl]; what: the call in words, for the messages.

  Raises:
    ValueError: both given, a negative or non-int seed, seeds not one per video, latents of another
      shape or with NaN/inf values, neither given in a multi-process run (each process would draw
      its own).
  """
  if isinstance(seed, (list, tuple)):
    seed = tuple(check_int(f"seed[{i}]", s, minimum=0) for i, s in enumerate(seed))
    seeding.video_seeds(seed, shape[0])  # raises unless one per video
  elif seed is not None:
    seed = check_int("seed", seed, minimum=0, hint=" (video i uses seed + i); or leave it out for a random one")
  if latents is not None:
    latents = noise_array(latents)
    if seed is not None:
      raise ValueError(f"give either seed ({seed=}) or latents, not both")
    if latents.shape != shape:
      raise ValueError(f"latents.shape={latents.shape} must be [B, C, F, Hl, Wl]={shape} for {what}")
    if not np.isfinite(latents).all():
      raise ValueError(f"latents hold {int((~np.isfinite(latents)).sum())} NaN/inf values; pass "
                       "finite noise (or a seed)")
    return None, latents
  if seed is None:
    if jax.process_count() > 1:
      raise ValueError("a multi-process run needs an explicit seed (or latents) so that every "
                       "process draws the same noise; pass seed=...")
    seed = seeding.random_seed()
  return seed, None


def embeds_array(name: str, value: Any, text_dim: int) -> np.ndarray:
  """Precomputed text states (diffusers' `prompt_embeds` / `negative_prompt_embeds`) as float32
  numpy [B, L, text_dim].

  Raises:
    ValueError: not an array of real numbers, not 3-d, an empty axis, last axis != text_dim, or
      NaN/inf values.
  """
  array = host_array(value)
  if array is None:
    raise ValueError(f"{name}={reprlib.repr(value)} ({type(value).__name__}) must be an array of real "
                     f"numbers [B, L, text_dim={text_dim}] (numpy, JAX or CPU torch)")
  if array.ndim != 3 or 0 in array.shape or array.shape[2] != text_dim:
    raise ValueError(f"{name}.shape={array.shape} must be [B, L, text_dim] with text_dim={text_dim} "
                     "(the text encoder's width, e.g. diffusers' encode_prompt output)")
  if not np.isfinite(array).all():
    raise ValueError(f"{name} holds {int((~np.isfinite(array)).sum())} NaN/inf values")
  return array.astype(np.float32)


def check_output_type(output_type: Any) -> str:
  """`output_type` if it is one of `OUTPUT_TYPES` (diffusers' names; its "pt" has no JAX meaning).

  Raises:
    ValueError: anything else.
  """
  if not isinstance(output_type, str) or output_type not in OUTPUT_TYPES:
    raise ValueError(f"output_type={output_type!r} must be one of {OUTPUT_TYPES}: 'np' (float32 frames in "
                     "[0, 1]), 'latent' (the final latents, not decoded) or 'pil' (lists of PIL images)")
  return output_type


def frames_to_pil(frames: np.ndarray) -> list[list[Any]]:
  """Videos float32 [B, frames, H, W, 3] in [0, 1] -> B lists of `frames` RGB `PIL.Image`s.

  As diffusers' `VideoProcessor.postprocess_video(..., output_type="pil")` (its `numpy_to_pil`:
  `(x * 255).round()` to uint8).
  """
  from PIL import Image

  pixels = (np.asarray(frames) * 255).round().astype(np.uint8)
  return [[Image.fromarray(frame) for frame in video] for video in pixels]


def round_num_frames(num_frames: int, temporal_factor: int = 4) -> int:
  """Frames as diffusers accepts them: k * temporal_factor + 1; any other count becomes
  `num_frames // temporal_factor * temporal_factor + 1` with a warning, as diffusers' WanPipeline
  does: for temporal_factor 4 a multiple of 4 goes up by one (16 -> 17), any other count down to
  the 4k + 1 below it (10 -> 9, 19 -> 17).

  Raises:
    ValueError: `num_frames` not an int >= 1.
  """
  check_int("num_frames", num_frames, hint=" (Wan uses 4k+1, e.g. 81)")
  if num_frames % temporal_factor != 1:
    rounded = max(num_frames // temporal_factor * temporal_factor + 1, 1)
    warnings.warn(f"{num_frames=} is not {temporal_factor}k + 1 (the VAE's frame groups); rounding to {rounded} "
                  f"as diffusers does (pass num_frames={rounded} to silence this)", stacklevel=2)
    return rounded
  return int(num_frames)


def check_size(height: int, width: int, vae_factor: int = 8, patch: int = 2) -> None:
  """Raises ValueError unless height and width are positive multiples of vae_factor x patch (16 for
  Wan 2.1: VAE factor 8 x patch 2; 32 for TI2V-5B: 16 x 2), naming the nearest valid sizes."""
  multiple = vae_factor * patch
  for name, value in (("height", height), ("width", width)):
    if not is_int(value) or value < multiple or value % multiple:
      near = is_real(value) and math.isfinite(value)  # 40 -> "use 32 or 48"; 32.0 -> "use 32 or 48"
      lower = max(multiple, int(value) // multiple * multiple) if near else multiple
      raise ValueError(f"{name}={value!r} must be a positive multiple of {multiple}{not_a(value, is_int(value))} "
                       f"(VAE factor {vae_factor} x patch {patch}); use {lower} or {lower + multiple}")
