"""Device memory of the Wan VAE decode, whole-frame (`decode`) or banded (`bands.decode_banded`), from
XLA's memory analysis of its programs lowered on abstract inputs; and the band height a budget allows.

A program's peak is its arguments + outputs + temporaries - the bytes outputs alias (the donated
cache), as `jax.stages.Compiled.memory_analysis()` reports them for the default backend. Nothing is
allocated, but every program is compiled, once per process (the peaks are cached): a second or two
each on CPU for the tiny presets, seconds for the Wan 2.1 VAE at 720p, minutes on TPU (`effort`).

Measured on CPU (XLA:CPU's analysis; a TPU's temporaries differ: 18.19 GB for the 720p later-chunk
decode program there), Wan 2.1 VAE, B = 1, 720 x 1280 (Hl, Wl = 90, 160; radius 15), peak bytes:
  bf16: `decode` 15.57 GB (its later-chunk program: cache 4.38 GB, temporaries 11.02 GB);
        banded, band_rows 30 (2 windows of 60 rows) 10.40 GB, 16 (46 rows) 8.02 GB, 8 (38) 6.65 GB;
        the banded head (whole frames, latent resolution) 0.30 GB.
  fp32: `decode` 21.90 GB; banded 38 (68 rows) 16.55 GB, 30 14.64 GB, 8 9.40 GB.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.wan.vae import bands, model as vae_model
from pipelines.wan.vae.config import WanVAEConfig


def program_peak(lowered) -> int:
  """Bytes a lowered program holds at its peak once compiled: arguments + outputs + temporaries -
  aliased (XLA's `memory_analysis()`). A program too large for the device does not compile on a
  TPU (XLA:TPU checks its memory at compile time): then its arguments' bytes plus the temporaries the
  error reports ("the total memory required for HLO temporaries (18.19G) exceeds available HBM"), or
  where the error names none, more than any device holds (`TOO_LARGE`)."""
  try:
    m = lowered.compile().memory_analysis()
  except Exception as e:  # noqa: BLE001 - XlaRuntimeError: RESOURCE_EXHAUSTED at compile
    if "RESOURCE_EXHAUSTED" not in str(e) and "Ran out of memory" not in str(e):
      raise
    return _arguments_bytes(lowered) + _reported_temporaries(str(e))
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


TOO_LARGE = 1 << 50  # bytes: a program no device holds (its compile ran out of memory, no size given)


def _reported_temporaries(message: str) -> int:
  """The temporaries' bytes an out-of-memory compile error names ("... temporaries (18.19G) ..."), or
  `TOO_LARGE`."""
  found = re.search(r"temporaries \(([0-9.]+)([KMGT])\)", message)
  if found is None:
    return TOO_LARGE
  return int(float(found.group(1)) * 1024 ** "KMGT".index(found.group(2)) * 1024)


def _arguments_bytes(lowered) -> int:
  return int(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(lowered.in_avals)))


@functools.cache
def _lowered(config: WanVAEConfig, batch: int, latent_height: int, latent_width: int, band_rows: int | None,
             dtype: np.dtype) -> dict[str, Any]:
  """The decode's programs lowered on the default backend: `decode`'s (band_rows None) or `decode_banded`'s."""
  vae = vae_model.abstract_vae(config, dtype)
  if band_rows is None:
    return vae_model.lower_decode_programs(vae, batch=batch, latent_height=latent_height,
                                           latent_width=latent_width, devices=jax.devices()[:1], split=False)
  return bands.lower_decode_band_programs(vae, batch=batch, latent_height=latent_height,
                                          latent_width=latent_width, band_rows=band_rows)


@functools.cache
def _peak(config: WanVAEConfig, batch: int, latent_height: int, latent_width: int, band_rows: int | None,
          dtype: np.dtype, program: str) -> int:
  """`program_peak` of one of `_lowered`'s programs; cached, as a compile can take minutes."""
  return program_peak(_lowered(config, batch, latent_height, latent_width, band_rows, dtype)[program])


def decode_memory(vae_or_config: vae_model.WanVAE | WanVAEConfig, batch: int, latent_height: int,
                  latent_width: int, band_rows: int | None = None, dtype: jnp.dtype | None = None) -> int:
  """Peak device bytes of the programs a decode of [B, C, F, Hl, Wl] latents runs, the largest of them.

  Args:
    vae_or_config: the model (only its config and dtype are used) or a config.
    batch, latent_height, latent_width: B, Hl, Wl.
    band_rows: None: `decode`'s two chunk programs (the whole frame); else `decode_banded`'s four
      (the head on whole frames, the tail on one band's window).
    dtype: the parameters' dtype; None: the model's, or fp32 for a config.

  Returns:
    max over the programs of `program_peak` (weights, cache, one chunk's input and temporaries),
    compiled for the default backend (once per process for each set of arguments). Not counted:
    what the caller holds between programs: for `decode` the decoded video (on the device), for
    `decode_banded` nothing on the device (the head's outputs and the video are on the host).
    Raises as the lowering does (band_rows < 1).
  """
  if isinstance(vae_or_config, WanVAEConfig):
    config, dtype = vae_or_config, jnp.float32 if dtype is None else dtype
  else:
    config, dtype = vae_or_config.config, vae_or_config.dtype if dtype is None else dtype
  key = (config, batch, latent_height, latent_width, band_rows, np.dtype(dtype))
  return max(_peak(*key, program) for program in _lowered(*key))


def choose_band_rows(config: WanVAEConfig, batch: int, latent_height: int, latent_width: int,
                     budget_bytes: int, dtype: jnp.dtype = jnp.float32, whole: int | None = None) -> int | None:
  """The band height for `decode_banded` whose decode fits `budget_bytes`, or None if `decode` fits.
  `whole`: the whole-frame decode's peak where the caller has it (from the programs it compiled for
  that decode), so that it is neither lowered nor compiled again here; None: `decode_memory`'s.

  Compiles `decode`'s programs and the banded head's (`decode_memory`'s analysis), not the tail's:
  the tail's peak for bands of h rows is ESTIMATED by scaling the whole-frame decode's peak, all but
  the weights, by its window's share of the frame, (h + 2 r) / Hl (r = `bands.tail_radius`):
  activations, cache and temporaries scale with the rows. The answer is the largest h whose
  estimate and the head's compiled peak fit; verify it with `decode_memory(..., band_rows=h)`.

  Raises:
    ValueError: even 1-row bands do not fit (the numbers in the message), or a window of 1 + 2r
      rows already covers the frame (bands cannot save memory there).
  """
  if whole is None:
    whole = decode_memory(config, batch, latent_height, latent_width, None, dtype)
  if whole <= budget_bytes:
    return None
  weights = sum(math.prod(s) for s in config.param_shapes().values()) * np.dtype(dtype).itemsize
  key = (config, batch, latent_height, latent_width, 1, np.dtype(dtype))  # the head is the same for any band
  head = max(_peak(*key, program) for program in ("head_first", "head_later"))
  r = bands.tail_radius(config)
  fits = math.floor((budget_bytes - weights) / (whole - weights) * latent_height) - 2 * r
  best = min(fits, latent_height - 2 * r - 1)
  if head > budget_bytes or best < 1:
    one = weights + (whole - weights) * (1 + 2 * r) / latent_height
    raise ValueError(f"no band height fits {budget_bytes=}: the whole-frame decode needs {whole} bytes, "
                     f"the banded head {head}, 1-row bands ~{one:.0f} (windows of 1 + 2 * {r} of "
                     f"{latent_height} rows; weights {weights}); raise the budget or lower the batch")
  return best


def decode_step_memory_analysis(config: WanVAEConfig, batch: int, latent_height: int, latent_width: int,
                                dtype: jnp.dtype = jnp.float32):
  """XLA's `memory_analysis()` of the compiled later-chunk decode program, from abstract shapes.

  Nothing is allocated (weights, cache and latent frame are `jax.ShapeDtypeStruct`s); returns the
  default backend's `CompiledMemoryStats` (argument, output, alias and temp bytes). `model.decode` cites it.
  """
  later = _lowered(config, batch, latent_height, latent_width, None, np.dtype(dtype))["later"]
  return later.compile().memory_analysis()
