"""The memory plan: where each of a pipeline's components lives, and when, on the device(s) at hand.

One generation runs three stages, each needing one component's weights on the device plus that
stage's working memory: the text encode (the UMT5 encoder), the denoising loop (the transformer: one
expert at a time), the VAE decode (the VAE, with its feature cache and one chunk's temporaries). A
chip too small for all of them at once still runs every stage if the components not in use leave it:
the host keeps a copy of every weight that moves, so leaving is free and coming back is one upload
(measured on one TPU v5e, JAX 0.10.2: host to chip 1.5 GiB/s, so 12.5 GiB of UMT5-XXL in ~8 s).

Placements, cheapest first (`MemoryPlan.choose` takes the first whose modelled peak fits; a caller
may force one):
- "resident": every weight stays on the device (the fastest path; what fits there always does this);
- "encoder-offloaded": the text encoder is uploaded for the encode and dropped after it (the
  transformer leaves during the encode too when both do not fit);
- "encoder-on-host": the text encoder runs on the host CPU and never takes device memory.
Independently, the transformer leaves the device before the decode when it does not fit beside the
decoder (`transformer_at_decode`), a model of two experts (Wan 2.2 A14B) holds one expert at a time
when both do not fit (`experts_swapped`), the VAE leaves the device for the text encode
(`vae_at_encode`) and for the loop (`vae_at_denoise`) when the stage's weights and work do not fit
beside it, and the decode runs in bands of latent rows
(`decode_band_rows`, `wan.vae.bands`) when even the decoder alone does not fit.

Bytes: weights from the arrays themselves; the step's working memory from the planner's step model
(`planner.candidates`: one block's activations plus the cross-attention K/V held); the decode's from
the compiled decoder programs' memory analysis (`wan.vae.decode_memory`); the encode's from
its activations. The device's memory is `memory_stats()["bytes_limit"] (None on a CPU: no limit,
everything resident).
"""

from __future__ import annotations

import dataclasses

GiB = 1024 ** 3
PLACEMENTS = ("resident", "encoder-offloaded", "encoder-on-host")
FIT_FRACTION = 0.92  # of the device's bytes_limit: what XLA's allocator fragments and keeps for itself


@dataclasses.dataclass(frozen=True)
class ComponentBytes:
  """What one generation holds on a device, by component (bytes per device).

  Attributes:
    text_encoder, experts, vae: the weights (experts: one entry per transformer expert).
    text_work: the encode's activations (beyond its weights).
    step_work: one denoising step's working memory: activations, the held text K/V, latents and
      solver state.
    decode_work: the untiled decode's memory beyond the VAE's weights (cache, one chunk's
      temporaries, its output chunk); None when unknown (then the decode is not planned).
    streamed_work: the same for the layer-streamed decode (`wan.vae.streamed`: one program per
      layer, the same video), or None when not analysed (the whole decode fits on its own).
    step_measured: True when `step_work` holds XLA's analysis of the compiled step (a call of these
      shapes ran before in this process), False when it is the planner's model (an upper bound).
  """
  text_encoder: int
  experts: tuple[int, ...]
  vae: int
  text_work: int
  step_work: int
  decode_work: int | None
  streamed_work: int | None = None
  step_measured: bool = False

  @property
  def transformer(self) -> int:
    return sum(self.experts)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Where the components live during one generation (frozen).

  Attributes:
    placement: one of `PLACEMENTS` (the text encoder: always on the device, uploaded for the encode
      only, or on the host CPU).
    transformer_at_encode: False when the transformer leaves the device for the encode.
    transformer_at_decode: False when the transformer leaves the device before the decode.
    experts_swapped: True when a two-expert model holds one expert on the device at a time.
    vae_at_encode: False when the VAE leaves the device for the text encode (back for the encode of
      the inputs or the loop).
    vae_at_denoise: False when the VAE leaves the device for the denoising loop (after any encode
      of the inputs; back for the decode).
    decode_streamed: True when the decode runs one program per layer (`wan.vae.streamed`).
    decode_band_rows: None (whole frames), or the latent rows of each band the decode runs in.
    budget: the bytes the plan fits in (None: not limited, a CPU).
    peak: the modelled peak bytes of the plan (the largest stage).
    forced: True when the placement was asked for rather than chosen.
    host: the host copies of the weights the plan moves (`host_copies`), bytes; None: not modelled.
    step_measured: the peak counts XLA's analysis of the compiled step (`ComponentBytes.step_measured`).
  """
  placement: str = "resident"
  transformer_at_encode: bool = True
  transformer_at_decode: bool = True
  experts_swapped: bool = False
  vae_at_encode: bool = True
  vae_at_denoise: bool = True
  decode_streamed: bool = False
  decode_band_rows: int | None = None
  budget: int | None = None
  peak: int | None = None
  forced: bool = False
  host: int | None = None
  step_measured: bool = False

  @property
  def text_on_device(self) -> bool:
    """The text encoder's weights stay on the device between calls."""
    return self.placement == "resident"

  @property
  def moves_weights(self) -> bool:
    """Some component leaves the device during a call."""
    return not (self.placement == "resident" and self.transformer_at_encode and self.transformer_at_decode
                and not self.experts_swapped and self.vae_at_encode and self.vae_at_denoise)

  def line(self) -> str:
    """The plan in one line (the CLI's stage line, the sidecar, serve's log)."""
    parts = [self.placement + (" (asked for)" if self.forced else "")]
    if not self.transformer_at_encode:
      parts.append("transformer off the device for the encode")
    if self.experts_swapped:
      parts.append("one expert on the device at a time")
    if not self.vae_at_encode:
      parts.append("VAE off the device for the encode")
    if not self.vae_at_denoise:
      parts.append("VAE off the device for the denoise")
    if not self.transformer_at_decode:
      parts.append("transformer off the device for the decode")
    if self.decode_streamed:
      parts.append("decode streamed layer by layer")
    if self.decode_band_rows is not None:
      parts.append(f"decode in bands of {self.decode_band_rows} latent rows")
    if self.budget is not None and self.peak is not None:
      over = "over by the step's modelled share, an upper bound: the step's compile decides"
      parts.append(f"modelled peak {_size(self.peak)} of {_size(self.budget)}"
                   + (" (the step's from its compiled program)" if self.step_measured else "")
                   + (f" ({over})" if self.peak > self.budget and not self.step_measured else ""))
    if self.host:
      parts.append(f"host copies {_size(self.host)}")
    return "memory plan: " + ", ".join(parts)

  @classmethod
  def choose(cls, b: ComponentBytes, budget: int | None, *, placement: str = "auto",
             band_rows_for: object = None) -> MemoryPlan:
    """The cheapest plan whose modelled peak fits `budget`, or `placement` as asked; where none fits
    only because of the step's modelled working memory (an upper bound), the most frugal plan (its
    `line()` says the peak is over).

    Args:
      b: the components' bytes.
      budget: the bytes a device gives the run (`device_budget`), or None: not limited (all resident).
      placement: "auto" or one of `PLACEMENTS` (forced: used even where it does not fit the model,
        which is then only the peak it reports).
      band_rows_for: callable (bytes available to the decode beyond the VAE's weights) -> band rows
        or None (whole frames fit); raises ValueError when no band fits. None: never banded.

    Raises:
      ValueError: an unknown placement; nothing fits even without the step's working memory (naming
        the stage and the bytes); a decode no band fits (from `band_rows_for`).
    """
    check_placement(placement)
    if budget is None:
      return cls(placement="resident" if placement == "auto" else placement, forced=placement != "auto")
    names = PLACEMENTS if placement == "auto" else (placement,)
    plans = [_plan(b, budget, name, band_rows_for) for name in names]
    fitting = [p for p in plans if p.peak <= budget]
    if fitting:
      return dataclasses.replace(fitting[0], forced=placement != "auto")
    if placement != "auto":
      return dataclasses.replace(plans[0], forced=True)
    best = plans[-1]
    if _peak(dataclasses.replace(b, step_work=0), best, budget) <= budget:
      # Only the step's modelled share is over, and it is the planner's upper bound (XLA's analysis of
      # the compiled step on a v5e: 1.61 GB where it says 4.6 GiB for Wan 2.1 1.3B at 480p, 3.39 GB
      # where it says 7.0 GiB for TI2V-5B at 704x1280x121): the most frugal plan runs, its line says
      # so, and the step's compile is the judge (XLA refuses a program larger than the device).
      return best
    raise ValueError(f"the model does not fit this device even with the text encoder on the host and one "
                     f"component at a time: {_size(best.peak)} needed by its largest stage "
                     f"({_largest_stage(b, best)}), {_size(budget)} available; use a smaller video "
                     "(--size, --frames), --quantize int8, or a mesh of several devices (--mesh auto)")


def check_placement(placement: str) -> str:
  """`placement` when it is "auto" or one of `PLACEMENTS`; else ValueError naming them."""
  if placement != "auto" and placement not in PLACEMENTS:
    raise ValueError(f"placement={placement!r} is not one; use 'auto' or one of {', '.join(PLACEMENTS)}")
  return placement


def _size(n: int) -> str:
  return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2 ** 20:.1f} MiB"


def _stages(b: ComponentBytes, p: MemoryPlan) -> dict[str, int]:
  """Each stage's modelled bytes on the device under plan `p` (decode: as banded by `p`)."""
  text_weights = b.text_encoder if p.placement != "encoder-on-host" else 0
  resident_text = b.text_encoder if p.placement == "resident" else 0
  experts = max(b.experts) if p.experts_swapped else b.transformer
  decode = b.streamed_work if p.decode_streamed else (0 if b.decode_work is None else b.decode_work)
  return {
      "text encode": text_weights + (b.transformer if p.transformer_at_encode else 0)
                     + (b.vae if p.vae_at_encode else 0) + (b.text_work if p.placement != "encoder-on-host" else 0),
      "denoise": resident_text + experts + (b.vae if p.vae_at_denoise else 0) + b.step_work,
      "decode": resident_text + (b.transformer if p.transformer_at_decode else 0) + b.vae + decode,
  }


def _largest_stage(b: ComponentBytes, p: MemoryPlan) -> str:
  stages = _stages(b, p)
  return max(stages, key=stages.get)


def _plan(b: ComponentBytes, budget: int, placement: str, band_rows_for: object) -> MemoryPlan:
  """`placement` with the transformer's moves and the decode's bands it needs under `budget`."""
  p = MemoryPlan(placement=placement, budget=budget)
  if _stages(b, p)["text encode"] > budget:
    p = dataclasses.replace(p, transformer_at_encode=False)
  if _stages(b, p)["text encode"] > budget:
    p = dataclasses.replace(p, vae_at_encode=False)
  if len(b.experts) > 1 and _stages(b, p)["denoise"] > budget:
    p = dataclasses.replace(p, experts_swapped=True)
  if _stages(b, p)["denoise"] > budget:
    p = dataclasses.replace(p, vae_at_denoise=False)
  if _stages(b, p)["decode"] > budget:
    p = dataclasses.replace(p, transformer_at_decode=False)
  if b.streamed_work is not None and _stages(b, p)["decode"] > budget:
    streamed = dataclasses.replace(p, decode_streamed=True)
    if _stages(b, streamed)["decode"] <= budget:
      p = streamed
  resident_text = b.text_encoder if placement == "resident" else 0
  if b.decode_work is not None and band_rows_for is not None and _stages(b, p)["decode"] > budget:
    try:
      rows = band_rows_for(budget - resident_text - b.vae)
    except ValueError:  # no band fits beside what this placement keeps: the plan does not fit
      rows = None
    if rows is not None:
      p = dataclasses.replace(p, decode_band_rows=rows)
  p = dataclasses.replace(p, peak=_peak(b, p, budget), step_measured=b.step_measured)
  return dataclasses.replace(p, host=host_copies(b, p))


def host_copies(b: ComponentBytes, p: MemoryPlan) -> int:
  """The host memory plan `p` holds for the weights it moves: a copy of each component that leaves
  the device (kept, so that leaving is free), plus the encode's activations where the text encoder
  runs on the host (one layer's weights converted at a time: `umt5.encode_text_layerwise`)."""
  moved_experts = not (p.transformer_at_encode and p.transformer_at_decode) or p.experts_swapped
  return ((b.text_encoder if p.placement != "resident" else 0) + (b.transformer if moved_experts else 0)
          + (b.vae if not (p.vae_at_encode and p.vae_at_denoise) else 0)
          + (b.text_work if p.placement == "encoder-on-host" else 0))


def _peak(b: ComponentBytes, p: MemoryPlan, budget: int) -> int:
  """The largest stage's modelled bytes under plan `p` (a banded decode fits by construction)."""
  stages = _stages(b, p)
  if p.decode_band_rows is not None:
    stages["decode"] = min(stages["decode"], budget)
  return max(stages.values())


def device_budget(device: object = None) -> int | None:
  """`FIT_FRACTION` of the device's memory (`memory_stats()["bytes_limit"]`); None where the
  backend reports none (the CPU)."""
  import jax

  device = jax.devices()[0] if device is None else device
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001 - backends without memory stats
    stats = None
  limit = (stats or {}).get("bytes_limit")
  return None if not limit else int(FIT_FRACTION * limit)


def host_available() -> int | None:
  """The host memory the kernel can give a process now without swapping (Linux's MemAvailable),
  bytes; None where it is not reported."""
  try:
    with open("/proc/meminfo") as f:
      fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024  # "kB" in the file: KiB
  except (OSError, KeyError, ValueError):
    return None
