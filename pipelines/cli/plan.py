"""`Plan`: the `generate` flags as asked (presets applied), checked where no JAX is needed."""

from __future__ import annotations

import dataclasses
from typing import Any

from attention.mesh_spec import MeshSpec
from pipelines.parallel import distributed


@dataclasses.dataclass(frozen=True)
class Plan:
  """The flags as asked (presets applied), with every check that needs no JAX done; the video's
  values (size, frames, steps, ...) are checked by `check_plan`'s `GenerationRequest`."""
  prompt: str
  negative_prompt: str
  model: str | None  # --model ("tiny" when nothing names the model); None: `files`
  preset: str | None
  width: int
  height: int
  frames: int  # as asked; the request rounds it to 4k + 1
  steps: int | None  # None: the custom schedule's length
  guidance: tuple[float, ...]
  shift: float | None  # None: the folder's
  seed: int | None  # None: drawn by `check_plan` (--seed -1 or none)
  mesh: MeshSpec | None  # None: --mesh auto, resolved by `check_plan`
  devices: int | None
  dtype: str
  max_sequence_length: int | None  # None: the model's (`presets.default_text_length`)
  out: str
  fps: float
  overwrite: bool
  nan_guard: bool = True
  decode_compile_effort: float | None = None  # None: the platform's (`vae.decode_compile_effort`)
  loras: tuple[tuple[str, float, int], ...] = ()  # (path, scale, expert 0 or 1), in loading order
  processes: distributed.ProcessSpec | None = None  # None: a single-process run
  compile_cache: str | None = None  # the persistent compilation cache's directory; None: off
  checkpoint_dir: str | None = None  # --checkpoint-dir or --resume
  checkpoint_every: int = 1
  checkpoint_default: bool = True  # False with --no-checkpoint
  keep_checkpoint: bool = False
  resume: bool = False
  step_cache: str | None = None  # --step-cache SPEC, parsed by the request; None: off
  attention_backend: str = "auto"  # "auto" | "xla" | "pallas"
  attention_exchange: str = "bf16"  # "bf16" | "fp8": Q, V, output in e4m3 across the Ulysses all-to-alls
  vae_parallel: bool = True  # decode split by rows over the mesh's devices
  contact_sheet: bool = False  # also write contact_sheet.contact_sheet_path(out)
  quantize: str | None = None  # --quantize: the block weights as int8 / fp8 / int8-w8a8 (after LoRAs)
  placement: str = "auto"  # --placement: the memory plan's placement (`parallel.memory`)
  image: str | None = None  # --image PATH (image-to-video)
  video: str | None = None  # --video PATH (video-to-video; a VACE model's video)
  mask: str | None = None  # --mask PATH (VACE)
  reference_images: tuple[str, ...] = ()  # --reference-image PATH, repeated (VACE)
  conditioning_scale: Any = 1.0  # --conditioning-scale (VACE): a float or a tuple of floats
  strength: float = 0.8  # --strength (with --video)
  context_frames: int | None = None  # --context-frames (long videos in context windows)
  context_overlap: int | None = None  # --context-overlap; None: the request's default
  context_fuse: str = "pyramid"  # --context-fuse
  last_image: str | None = None  # --last-image PATH
  size_given: bool = True  # --size given; else an --image sets it (`presets.size_for_image`)
  fps_given: bool = True  # --fps or --preset given; else the model's (`presets.model_fps`)
  scheduler: str | None = None  # --scheduler or the preset's; None: the folder's
  timesteps: tuple[float, ...] | None = None  # --timesteps or the preset's custom schedule
  sigmas: tuple[float, ...] | None = None  # --sigmas
  model_folder: str | None = None  # a Hub --model's snapshot folder (`check_plan` downloads it; per host)
  model_commit: str | None = None  # a Hub --model's resolved commit
  files: Any = None  # --transformer / --vae / --text-encoder ...: a `wan.pretrained.Sources` (model None)

  @property
  def mesh_devices(self) -> int | None:
    """Devices of the mesh (None for --mesh auto without --devices: the visible ones)."""
    return self.mesh.devices if self.mesh is not None else self.devices

  @property
  def writes(self) -> bool:
    """This process writes the output (process 0, or the only one)."""
    return self.processes is None or self.processes.process_id == 0


# --- before JAX starts --------------------------------------------------------------------------
