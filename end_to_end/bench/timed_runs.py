"""One timed text-to-video call of our `WanPipeline` or of diffusers' `WanPipeline`, by stage.

Stages (seconds; the same names for both pipelines):
  text_encode          tokenise + UMT5-encode prompt and negative prompt
  compile              our jitted denoise step's lower + compile (0 when cached); diffusers runs
                       eager PyTorch and has no such stage (reported as 0.0)
  denoise_step_min     fastest denoising step (transformer on cond and uncond, guidance, UniPC)
  denoise_step_median  median step
  denoise              all steps
  decode               VAE decode of the final latents (incl. our per-video loop)
  total                the whole call, prompt in, frames out (model load excluded; it is timed apart)
Our first call also compiles the text encoder and the VAE inside "text_encode" / "decode" (JAX
compiles on first use); a second call with the same shapes shows the steady state.
Accelerator work is waited for at each stage boundary (`block_until_ready`, `cuda.synchronize`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

STAGES = ("text_encode", "compile", "denoise_step_min", "denoise_step_median", "denoise", "decode", "total")


def _summary(text_encode: float, compile_s: float, steps: list[float], decode: float, total: float) -> dict[str, Any]:
  return dict(text_encode=text_encode, compile=compile_s, denoise_step_min=min(steps),
              denoise_step_median=statistics.median(steps), denoise=sum(steps), decode=decode, total=total,
              step_times=list(steps))


def run_ours(pipe, *, prompt: str, negative_prompt: str | None, latents: np.ndarray, height: int, width: int,
             frames: int, steps: int, guidance: float, max_sequence_length: int,
             mesh: str | None, attention_backend: str = "auto",
             guidance_2: float | None = None) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
  """One `pipe.generate` call (no progress bar, as diffusers' side; a flushed line as each stage starts
  and at steps 1, 10, 20, ...: a run stopped by a time limit shows where); `attention_backend` as `pipe.run`,
  `guidance_2` its `guidance_scale_2` (the low-noise expert's scale of a two-expert pipeline).

  Returns:
    (stage seconds as in STAGES plus step_times, the call's memory plan line and the device's peak
    GiB since the process started (`peak_device_gib`), frames float32
    [1, frames, H, W, 3], final latents float32 [1, C, F, Hl, Wl]).
  """
  from pipelines.pipeline import CallOptions, GenerationRequest

  step_times: list[float] = []
  start = time.perf_counter()

  def on_stage(name: str) -> None:
    print(f"    stage {name} starts at +{time.perf_counter() - start:.1f} s", flush=True)

  def on_step(k: int, seconds: float) -> None:
    step_times.append(seconds)
    if k == 0 or (k + 1) % 10 == 0:
      print(f"    step {k + 1}: {seconds:.2f} s (+{time.perf_counter() - start:.1f} s)", flush=True)

  request = GenerationRequest.build(
      pipe.facts, prompt, negative_prompt, height=height, width=width, num_frames=frames,
      num_inference_steps=steps, guidance_scale=guidance, latents=latents, max_sequence_length=max_sequence_length,
      mesh=mesh, attention_backend=attention_backend, step_cache=pipe.step_cache,
      **({} if guidance_2 is None else {"guidance_scale_2": guidance_2}))
  result = pipe.generate(request, CallOptions(progress=False, on_step=on_step, on_stage=on_stage))
  t = result.timings
  stages = _summary(t["text_encode"], t["compile"], step_times, t["decode"], t["total"])
  stages["memory_plan"] = result.settings.get("memory_plan")
  stages["peak_device_gib"] = peak_device_gib()
  return stages, result.frames, result.latents


def peak_device_gib() -> float | None:
  """The first device's peak bytes in use since the process started, GiB (None: not reported)."""
  import jax
  stats = jax.devices()[0].memory_stats() or {}
  return None if "peak_bytes_in_use" not in stats else round(stats["peak_bytes_in_use"] / 2 ** 30, 2)


def peak_host_gib() -> float:
  """This process's peak resident host memory since it started, GiB (the host keeps the weights
  a memory plan moves off the device). On a TPU VM it also counts the chip's memory mapped into the
  process (measured on a v5e: +8.9 GiB at the runtime's start, of which 4.7 GiB is host memory), so
  it overstates what the host holds there; `end_to_end/host_watchdog.sh` watches the machine's."""
  import resource
  return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)  # Linux: KiB


def load_diffusers(folder: str, *, dtype: str, device: str):
  """diffusers `WanPipeline.from_pretrained(folder)` in `dtype` with the VAE in float32 (as our
  pipeline and diffusers' Wan examples run it), moved to `device`, progress bar off."""
  import diffusers
  import torch

  torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  vae = diffusers.AutoencoderKLWan.from_pretrained(folder, subfolder="vae", torch_dtype=torch.float32)
  pipe = diffusers.WanPipeline.from_pretrained(folder, vae=vae, torch_dtype=torch_dtype).to(device)
  pipe.set_progress_bar_config(disable=True)
  return pipe


def run_diffusers(pipe, *, prompt: str, negative_prompt: str | None, latents: np.ndarray, height: int,
                  width: int, frames: int, steps: int, guidance: float, max_sequence_length: int,
                  device: str) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
  """One diffusers `WanPipeline.__call__(..., output_type="np")`, timed by wrapping
  `encode_prompt` and `vae.decode` and by `callback_on_step_end` (step k ends at its callback;
  step 0 starts when the prompt encoding returns: the gap holds only timestep and latent set-up).

  Returns:
    (stage seconds as in STAGES plus step_times, frames float32 [1, frames, H, W, 3],
    final latents float32 [1, C, F, Hl, Wl]).
  """
  import torch

  def sync():
    if device.startswith("cuda"):
      torch.cuda.synchronize()

  marks: dict[str, Any] = {"steps": []}
  encode, decode = pipe.encode_prompt, pipe.vae.decode

  def timed_encode(*args, **kwargs):
    start = time.perf_counter()
    out = encode(*args, **kwargs)
    sync()
    marks["encoded"] = time.perf_counter()
    marks["text_encode"] = marks["encoded"] - start
    return out

  def timed_decode(*args, **kwargs):
    sync()
    start = time.perf_counter()
    out = decode(*args, **kwargs)
    sync()
    marks["decode"] = time.perf_counter() - start
    return out

  def on_step(_pipe, _i, _t, tensors):
    sync()
    marks["steps"].append(time.perf_counter())
    marks["latents"] = tensors["latents"].detach().float().cpu().numpy()
    return {}

  pipe.encode_prompt, pipe.vae.decode = timed_encode, timed_decode
  try:
    start = time.perf_counter()
    with torch.no_grad():
      out = pipe(prompt, negative_prompt=negative_prompt, height=height, width=width, num_frames=frames,
                 num_inference_steps=steps, guidance_scale=guidance,
                 latents=torch.from_numpy(np.array(latents, np.float32)).to(device),
                 max_sequence_length=max_sequence_length, output_type="np", callback_on_step_end=on_step)
    sync()
    total = time.perf_counter() - start
  finally:
    del pipe.encode_prompt, pipe.vae.decode
  ends = [marks["encoded"], *marks["steps"]]
  step_times = [b - a for a, b in zip(ends, ends[1:])]
  return (_summary(marks["text_encode"], 0.0, step_times, marks["decode"], total),
          np.asarray(out.frames, np.float32), marks["latents"])


def flops_of(preset: Any) -> dict[str, float]:
  """{"step_flops": matmul FLOPs of one denoising step of `preset` (`parallel.estimate.step_flops`:
  both CFG rows; it counts the text K/V projections, which the pipeline computes once per run, <1 %
  at real sizes), "decode_flops": its video's decode (`vae.decode_flops`)}."""
  from pipelines.parallel.estimate import step_flops
  from pipelines.wan import vae as wan_vae

  rows = 2 if preset.guidance > 1 else 1
  return {"step_flops": step_flops(preset.transformer, preset.tokens, preset.max_sequence_length, rows),
          "decode_flops": wan_vae.decode_flops(preset.vae.decode_layers(), *preset.latent_shape[2:])}


def step_rate(flops: float, seconds: float | None, mesh: str | None, stage: str = "step") -> dict[str, float | None]:
  """{"<stage>_tflops_per_s": per device, "<stage>_mfu": its fraction of the chip's bf16 peak (None off
  the known chips, `planner.chip_of`)} of a stage of `flops` taking `seconds` on `mesh`'s devices."""
  import jax

  from attention.mesh import MeshSpec
  from pipelines.parallel.planner import chip_of

  if not seconds:
    return {}
  devices = MeshSpec.parse(mesh).devices if mesh else 1
  rate = flops / seconds / devices
  chip = chip_of(jax.devices()[0].device_kind)
  return {f"{stage}_tflops_per_s": rate / 1e12, f"{stage}_mfu": rate / chip.peak_flops if chip is not None else None}


def stage_rates(ours: dict[str, Any], stages: dict[str, Any], mesh: str | None, vae_dtype: str) -> dict[str, Any]:
  """The step's rate (`step_rate`) and, for a one-device run, the decode's: the decode stage's
  seconds, so with any compile it ran and the copy to the host (`bench.decode` separates them),
  by `decode_rate`."""
  rates = step_rate(ours["step_flops"], stages.get("denoise_step_median"), mesh)
  if mesh is None:
    rates.update(decode_rate(ours["decode_flops"], stages.get("decode"), vae_dtype))
  return rates


def decode_rate(flops: float, seconds: float | None, vae_dtype: str) -> dict[str, float | None]:
  """`step_rate` of a one-device decode ("decode_tflops_per_s", "decode_mfu"), the MFU None unless
  the VAE is bf16 (a float32 VAE's products take several bf16 passes on a TPU)."""
  rate = step_rate(flops, seconds, None, "decode")
  if rate and vae_dtype != "bfloat16":
    rate["decode_mfu"] = None
  return rate


def run_line(i: int, stages: dict[str, Any], ours: dict[str, Any]) -> str:
  """Run `i`'s report: total, memory plan, device and host peaks, the step's and the decode's rates
  (`stage_rates`)."""
  line = (f"  ours run {i + 1}: total {stages['total']:.2f} s; {stages['memory_plan']}; device peak since the "
          f"process started {stages['peak_device_gib']} GiB, host {peak_host_gib()} GiB")
  for stage, source in (("step", "estimate.step_flops"), ("decode", "vae.decode_flops; the stage's seconds, "
                                                                     "compiles and host copy included")):
    if stages.get(f"{stage}_tflops_per_s"):
      mfu = stages.get(f"{stage}_mfu")
      line += (f"\n    {stage}: {ours[stage + '_flops'] / 1e12:.1f} TFLOP ({source}), {stages[stage + '_tflops_per_s']:.1f} "
               f"TFLOP/s per device" + (f", MFU {mfu:.1%} of the chip's bf16 peak" if mfu else ""))
  return line
