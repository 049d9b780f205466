"""`Plan`: the `generate` flags as asked (presets applied), checked where no JAX is needed."""

from __future__ import annotations

import dataclasses
from typing import Any

from attention.mesh_spec import MeshSpec
from pipelines.parallel import distributed


@dataclasses.dataclass(frozen=True)
class Plan:
  """The flags as asked (presets applied), with every check that needs no JAX done: the request's
  arguments as one mapping (checked by `check_plan`'s `GenerationRequest`) beside the command's own
  facts."""
  request: dict[str, Any]  # `GenerationRequest.build`'s keyword arguments by name; media as paths
  model: str | None  # --model ("tiny" when nothing names the model); None: `files`
  preset: str | None
  mesh: MeshSpec | None  # None: --mesh auto, resolved by `check_plan`
  devices: int | None
  dtype: str
  out: str
  fps: float
  overwrite: bool
  recorded: dict[str, Any] = dataclasses.field(default_factory=dict)  # the recorded flags, by dest (`records`)
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
  contact_sheet: bool = False  # also write contact_sheet.contact_sheet_path(out)
  quantize: str | None = None  # --quantize: the block weights as int8 / fp8 / int8-w8a8 (after LoRAs)
  placement: str = "auto"  # --placement: the memory plan's placement (`parallel.memory`)
  size_given: bool = True  # --size given; else an --image sets it (`presets.size_for_image`)
  defaulted: tuple[str, ...] = ()  # request names no flag nor --preset gave: the model's (`run_plan.model_defaults`)
  fps_given: bool = True  # --fps or --preset given; else the model's (`presets.model_fps`)
  model_folder: str | None = None  # a Hub --model's snapshot folder (`check_plan` downloads it; per host)
  model_commit: str | None = None  # a Hub --model's resolved commit
  stream: dict[str, Any] | None = None  # --stream's settings (`streaming.check_stream_flags`), None: one video
  vae_dtype: str = "float32"  # --vae-dtype: the VAE's weights and activations
  files: Any = None  # --transformer / --vae / --text-encoder ...: a `wan.pretrained.Sources` (model None)

  def asked(self, name: str, default: Any = None) -> Any:
    """The request argument `name` as asked (`default` when the command does not give it)."""
    return self.request.get(name, default)

  @property
  def mesh_devices(self) -> int | None:
    """Devices of the mesh (None for --mesh auto without --devices: the visible ones)."""
    return self.mesh.devices if self.mesh is not None else self.devices

  @property
  def writes(self) -> bool:
    """This process writes the output (process 0, or the only one)."""
    return self.processes is None or self.processes.process_id == 0


# --- before JAX starts --------------------------------------------------------------------------
