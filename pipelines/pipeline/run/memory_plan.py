"""A call's memory plan (`parallel.memory.MemoryPlan`) from its pipeline and request: the bytes of
each component and stage, the device's memory, and the placement asked for.

Weights only move in a one-process run whose weights are replicated (a mesh of several devices
holds a copy per device; the plan counts one device's); otherwise every weight stays resident.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np

from pipelines.parallel import planner
from pipelines.parallel.memory import GiB, ComponentBytes, MemoryPlan, device_budget, host_available
from pipelines.pipeline.run.decoding import band_rows_for, decode_work_bytes, streamed_work_bytes
from pipelines.pipeline.checked.request import GenerationRequest
from pipelines.wan import vae as wan_vae


def text_work_bytes(config: Any, prompts: int, length: int) -> int:
  """The UMT5 encode's activations for `prompts` x `length` tokens, fp32: the FFN's [P, L, 2 d_ff],
  four [P, L, d_model] streams and one layer's [P, heads, L, L] attention scores (an upper bound:
  XLA fuses most of it; measured 0.02 GiB for UMT5-XXL at 2 x 512 on a TPU v5e)."""
  tokens = prompts * length
  return 4 * (tokens * (2 * config.d_ff + 4 * config.d_model) + prompts * config.num_heads * length * length)


def step_work_bytes(request: GenerationRequest, temp_bytes: int | None = None) -> int:
  """One denoising step's working memory per device: the step's temporaries, the held
  cross-attention K/V, latents and solver state. The temporaries are `temp_bytes` (XLA's analysis of
  the compiled step) where given, else the planner's model for the request's mesh (one block's
  activations: an upper bound, e.g. 4.6 GiB where XLA needs 1.6 GiB for Wan 2.1 1.3B at 480p, 7.0
  where it needs 3.35 for TI2V-5B at 704x1280x121, compiled for one v5e)."""
  from pipelines.wan.transformer import param_counts

  r, config = request, request.model.transformer
  spec = r.plan.spec
  found = planner.candidates(config, r.token_facts, param_counts=param_counts(config), devices=spec.devices,
                             frames=r.num_frames, height=r.height, width=r.width, cfg=r.cfg,
                             dtype=r.model.dtype, experts=r.model.experts,
                             chip=planner.CHIPS["v5e"],  # the activations do not depend on the chip
                             windows=None if r.windows is None else (r.clip_frames, 1))
  same = [c for c in found if (c.mesh.ulysses, c.mesh.ring, c.mesh.cfg) == (spec.ulysses, spec.ring, spec.cfg)]
  candidate = (same or found)[0]
  latent_bytes = 4 * int(np.prod(r.latent_shape))  # float32
  # the latents, the solver's history (UniPC keeps up to 3 predictions) and the step's prediction
  activations = candidate.activation_bytes if temp_bytes is None else temp_bytes
  return int(activations + candidate.kv_bytes) + 4 * latent_bytes


def plan_memory(pipe: Any, request: GenerationRequest, placement: str = "auto",
                decoder: dict[str, Any] | None = None) -> MemoryPlan:
  """The call's `MemoryPlan`: `placement` ("auto" or one of `memory.PLACEMENTS`) on the first device
  of the request's mesh, for this request's sizes; the step's working memory from XLA's analysis of
  its compiled program where this pipeline compiled it before (a second call), else modelled. A run of several processes or with sharded weights
  is planned resident (its weights do not move), with a warning when another placement was asked.
  `decoder`: the decode's programs as `decoding.lower_decoder` lowered them (the compile-ahead's), analysed
  instead of a lowering of their own where the VAE is on the planned device's platform (`decode_work_bytes`).

  Raises:
    ValueError: an unknown placement; a model no plan fits (`MemoryPlan.choose`).
  """
  plan = request.plan
  if jax.process_count() > 1 or plan.spec.shard_weights:
    if placement not in ("auto", "resident"):
      warnings.warn(f"placement={placement!r}: weights move only in a one-process run with replicated "
                    "weights; this run keeps them resident", stacklevel=3)
    return MemoryPlan(placement="resident")
  device = plan.mesh.devices.flat[0] if plan.mesh is not None else jax.devices()[0]
  budget = device_budget(device)
  if budget is None and placement == "auto":
    return MemoryPlan()
  weights = pipe.weights.bytes_of()
  latents_shape = request.latent_shape
  measured = pipe.compiled_steps.temp_bytes(plan, latents_shape)  # a call of these shapes compiled before
  decode_mesh = plan.decode_mesh
  if decoder is not None and wan_vae.platform_of(pipe.weights.vae.params) != device.platform:
    decoder = None  # lowered for the VAE where it is now (the host): not the planned device's programs
  work = decode_work_bytes(pipe.weights, latents_shape, decode_mesh, decoder) if request.decode and budget else None
  streamed = (streamed_work_bytes(pipe.weights, latents_shape) if work is not None
              and weights["vae"] + work > budget else None)  # analysed only where the whole decode cannot fit
  b = ComponentBytes(text_encoder=weights["text_encoder"], experts=weights["experts"], vae=weights["vae"],
                     text_work=text_work_bytes(pipe.text_encoder_config, 2 * request.videos,
                                               request.max_sequence_length),
                     step_work=step_work_bytes(request, measured), decode_work=work, streamed_work=streamed,
                     step_measured=measured is not None)
  rows = None if work is None or decode_mesh is not None else band_rows_for(pipe.weights, latents_shape, work)
  chosen = MemoryPlan.choose(b, budget, placement=placement, band_rows_for=rows)
  _warn_if_host_short(chosen, pipe.weights.host_bytes(), host_available())
  return chosen


def _warn_if_host_short(plan: MemoryPlan, held: int, available: int | None) -> None:
  """Warns when the host copies `plan` takes beyond those `held` already exceed the host memory
  `available`: the process would be killed for lack of memory midway, with no error of its own."""
  if not plan.host or available is None or plan.host - held <= available:
    return
  warnings.warn(f"{plan.line()}: its host copies need {(plan.host - held) / GiB:.1f} GiB more host memory, "
                f"{available / GiB:.1f} GiB are available, so the process may be killed midway; free host "
                "memory, or run a model whose weights move less (--quantize int8 halves the transformer's "
                "copy; a larger accelerator keeps more of them resident)", stacklevel=3)
