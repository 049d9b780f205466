"""The call's arguments that are not the generation itself: progress, the NaN guard, per-step
callbacks, resumable denoising, extra hooks (`CallOptions`), and the documentation of every argument
of `WanPipeline.__call__` (`CALL_DOCS`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

from pipelines.pipeline.checked.request import GenerationRequest
from pipelines.pipeline.run.callback import check_callback
from pipelines.pipeline.checked.inputs import check_flag, not_a
from pipelines.pipeline.run.loop import StepHook
from pipelines.pipeline.run.resume import ResumeConfig

# `GenerationRequest.build`'s keyword arguments: what decides the video and where it runs (read from
# its signature: adding an argument there adds it to every call).


@functools.cache
def build_defaults() -> dict[str, Any]:
  """`GenerationRequest.build`'s keyword arguments and their defaults, read from its signature (the
  one list of a call's arguments: the command's flags, serve's fields and `REQUEST_ARGUMENTS` derive
  from it)."""
  parameters = inspect.signature(GenerationRequest.build).parameters.values()
  return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


# `video_to_video` is the pipeline class's kind (`WanPipeline.video_to_video`), not a call's.
REQUEST_ARGUMENTS = tuple(name for name in build_defaults()
                          if name not in ("prompt", "negative_prompt", "video_to_video"))
# Accepted by `__call__` / `run` for one release; the objects that replace them:
LEGACY_OPTIONS = {
    "progress": "pipe.set_progress_bar_config(disable=...)",
    "nan_guard": "CallOptions(nan_guard=...) with pipe.generate",
    "on_step": "CallOptions(on_step=...) or a hook (loop.StepHook) with pipe.generate",
    "checkpoint_dir": "pipe.generate(request, resume=ResumeConfig(checkpoint_dir, ...))",
    "checkpoint_every": "ResumeConfig(every=...)",
    "resume": "ResumeConfig(resume=True)",
    "keep_checkpoint": "ResumeConfig(keep=True)",
    "step_cache": "pipe.enable_cache(spec)",
}
# Every argument of `WanPipeline.__call__` (diffusers' meanings where diffusers has them), by name; a
# key naming several arguments documents them together (`call_doc`).
CALL_DOCS = {
    "prompt": "one prompt or a list (B prompts); None when `prompt_embeds` is given.",
    "negative_prompt": "str or list of B str; default \"\" (used only with guidance_scale > 1).",
    "height, width": "multiples of 16; None: the model's (its folder's `generation_defaults.json`, e.g. 64 x 64 for "
                     "the tiny models; else diffusers' 480 x 832).",
    "num_frames": "4k + 1; other counts become num_frames // 4 * 4 + 1 (16 -> 17, 10 -> 9) with a warning, as "
                  "diffusers does; None: the model's (else diffusers' 81).",
    "num_inference_steps": "scheduler steps, at most the scheduler's num_train_timesteps (1000); None: the length "
                           "of `timesteps` / `sigmas`, else the model's (else diffusers' 50).",
    "timesteps": "a custom schedule as N decreasing timesteps in (0, 1000] (lightx2v's `denoising_step_list`, e.g. "
                 "[1000, 750, 500, 250] for the 4-step distilled Wan): sigmas t / 1000, shifted by the scheduler, the "
                 "model fed each shifted sigma x 1000 (`wan.flow_schedule`).",
    "sigmas": "a custom schedule as N decreasing unshifted sigmas in (0, 1] (diffusers' flow schedulers' "
              "`set_timesteps(sigmas=)`); at most one of `timesteps` and `sigmas`.",
    "scheduler": "None (the model folder's scheduler), \"unipc\", \"euler\" (flow-match Euler) or \"dpm++\" (DPM-Solver++ "
                 "multistep, Wan's `--sample_solver dpm++`), keeping the flow shift; or a config "
                 "(`wan.schedulers.UniPCConfig`, `FlowEulerConfig`, `DPMSolverConfig`).",
    "guidance_scale": "CFG scale in [0, 100] (of `transformer`, the high-noise expert, for Wan 2.2); <= 1 turns the "
                      "unconditional pass off; None: the model's (2 for the tiny models; else diffusers' 5.0).",
    "seed": "video i of the B x num_videos_per_prompt batch (prompt-major) uses numpy.random.default_rng(seed + i); a "
            "list of B' ints gives each video its own (video i uses seed[i]); None draws one (reported in "
            "`run(...).settings`).",
    "latents": "explicit float32 noise [B', C, F, Hl, Wl] (diffusers' `latents`) instead of a seed; for "
               "`WanVideoToVideoPipeline` without a video, the already noised start (run from strength's step).",
    "max_sequence_length": "L, text tokens (prompts truncated / zero-padded to it); None: the pipeline's "
                           "`max_sequence_length`. Embeds given as `prompt_embeds` keep their own L.",
    "mesh": "None (one device), a spec string (\"U=2,R=2\"; \"CFG=2,U=2,R=2\" runs the cond and uncond halves on the two "
            "halves of the devices), an `attention.MeshSpec`, or a built mesh.",
    "guidance_scale_2": "the low-noise expert's scale in [0, 100] (two-expert pipelines); default guidance_scale.",
    "flow_shift": "overrides the scheduler config's shift; in [0.01, 1000] (Wan: 3.0 at 480p, 5.0 at 720p, 12 for Wan "
                  "2.2 A14B). The schedule and solver tables are computed when the call is checked: one that comes "
                  "out singular or non-finite is a ValueError naming flow_shift.",
    "num_videos_per_prompt": "videos per prompt (text states repeated prompt-major, as diffusers).",
    "prompt_embeds, negative_prompt_embeds": "precomputed text states [B, L, text_dim] (numpy, JAX or CPU torch) used "
                                             "as given; under CFG both must have the same L.",
    "output_type": "\"np\" (float32 [B', frames, H, W, 3] in [0, 1]), \"latent\" (the final latents, not decoded, before "
                   "de-normalisation) or \"pil\" (B' lists of PIL images, diffusers' rounding).",
    "callback_on_step_end": "diffusers' `callback(pipe, step_index, timestep, callback_kwargs) -> dict` after each "
                            "step, with the tensors named in `callback_on_step_end_tensor_inputs` (\"latents\" a copy, "
                            "safe to keep; \"prompt_embeds\", \"negative_prompt_embeds\"). Returned \"latents\" / "
                            "\"prompt_embeds\" / \"negative_prompt_embeds\" replace the pipeline's (same shape, finite, "
                            "else ValueError). `pipe._interrupt = True` skips the remaining steps; the latents so far "
                            "decode.",
    "callback_on_step_end_tensor_inputs": "names from `CALLBACK_TENSOR_INPUTS`; default [\"latents\"].",
    "attention_kwargs": "None or {\"scale\": s}, s in [-100, 100]: the LoRA scale for this call only (diffusers scales "
                        "its PEFT LoRA layers by s during the call); the pipeline's scale is restored afterwards.",
    "generator": "not supported (ValueError): pass diffusers' noise as `latents`.",
    "shard_weights": "split the transformer's block weights over the mesh (FSDP: gathered a layer at a time in the "
                     "layer scan); same video. Needs a mesh of several devices.",
    "vae_parallel": "decode split along height over the mesh's devices (default True).",
    "attention_backend": "\"auto\" (Pallas on TPU and GPU, XLA loops elsewhere), \"xla\" or \"pallas\".",
    "attention_implementation": "\"auto\" | \"lse\" | \"fixed_m\".",
    "attention_exchange": "\"bf16\" (default) or \"fp8\": Q, V and the attention output cross USP's Ulysses all-to-alls "
                          "in e4m3 with per-head scales, K in bf16 (`attention.fp8_exchange`; with U > 1).",
    "step_cache": "skip transformer blocks on steps whose change is small, reusing a cached residual "
                  "(`wan.step_cache`): \"first-block:THRESH\" or \"mag:THRESH[:K][@RATIOS.json]\", or None (off, "
                  "unless `pipe.enable_cache(spec)` set one for every call).",
    "decode": "False skips the VAE (run: `frames` is None).",
    "image, last_image, image_embeds": "image-to-video models only (`WanImageToVideoPipeline`): the first frame, the "
                                       "last frame (FLF2V, and Wan 2.2 I2V A14B), precomputed CLIP image states "
                                       "(`image_inputs.check_image_inputs`); a Wan 2.2 TI2V model takes an optional "
                                       "`image` only (either class; `pipeline.run.ti2v`).",
    "video, strength": "video-to-video (`WanVideoToVideoPipeline`, a text-to-video folder): the frames to start from "
                       "and the share of the schedule that runs, in (0, 1] (`video_inputs`; checked without a video "
                       "too). On a VACE model `video` is VACE's (`WanVACEPipeline`).",
    "mask, reference_images, conditioning_scale": "VACE models only (`WanVACEPipeline`, `vace_inputs`): which pixels "
                                                  "of `video` to generate (white) and keep (black), images the video "
                                                  "should show (each adds a latent frame in front, dropped before "
                                                  "decoding), the VACE hints' weight (one number or one per VACE "
                                                  "layer).",
    "context_frames, context_overlap, context_fuse": "a video longer than the model's trained clip in overlapping "
                                                     "context windows (ComfyUI's `WanContextWindowsManual`): each "
                                                     "step runs one forward per window of `context_frames` frames (4k "
                                                     "+ 1; Wan: 81), neighbouring windows sharing at least "
                                                     "`context_overlap` frames (a multiple of 4; default a quarter of "
                                                     "the window), their noise predictions blended with "
                                                     "`context_fuse` \"pyramid\" or \"flat\" weights "
                                                     "(`wan.conditioning.windows`). A mesh with W=2 runs two windows "
                                                     "at once on two device groups. `context_fuse` \"continue\" runs "
                                                     "the windows one after another instead, each a whole denoising "
                                                     "given the frames it shares with the one before "
                                                     "(`pipeline.run.continued`; text-to-video and TI2V models, one "
                                                     "window at a time). `context_fuse` None: the model's (the tiny "
                                                     "models' \"continue\"; \"pyramid\" where it cannot continue, "
                                                     "and for a folder without `generation_defaults.json`).",
}


def call_doc(name: str) -> str:
  """The documentation of `WanPipeline.__call__`'s argument `name` (its `CALL_DOCS` entry).

  Raises:
    KeyError: an argument the table does not document.
  """
  for key, line in CALL_DOCS.items():
    if name in key.split(", "):
      return line
  raise KeyError(f"{name!r} is not an argument CALL_DOCS documents")


@dataclasses.dataclass(frozen=True)
class CallOptions:
  """How one generation reports and guards itself (none of it changes the video).

  Attributes:
    progress: stage lines and a tqdm bar on stderr.
    nan_guard: stop with `NonFiniteLatentsError` at the first step whose latents hold NaN/inf.
    on_step: None or `on_step(step, seconds)` after each step.
    callback: diffusers' `callback_on_step_end`, or None.
    callback_tensor_inputs: the tensors it is handed.
    resume: resumable denoising (`ResumeConfig`), or None.
    hooks: extra `loop.StepHook`s, run after the built-in ones.
    text_kv_once: the text's cross-attention keys and values computed once per prompt and expert
      before the loop (again only if a callback replaces the text states or the weights change);
      False computes them inside every step (the same video, bit for bit; for measurements).
    decode_compile_effort: XLA's optimization effort in [-1, 1] for the VAE decoder's programs;
      None: the platform's (`vae.decode_compile_effort`: -0.5 on TPU, a ~4x faster compile for a
      decode ~9-19 % slower by libtpu's own estimate; JAX's own setting elsewhere). 0 suits a
      long-lived server whose compiles are paid once.
    decode_compile_ahead: compile the VAE decoder's programs in a background thread from the text
      encoding on, while the text encoder, the step's compile and the denoising loop run
      (`ahead.CompileAhead`; the same programs, the same video), so that the decoder's compile
      leaves the path to the first video where the host is idle (TPU, GPU: the device computes).
      False compiles them at the decode. None (the default): ahead on an accelerator, at the decode
      on the CPU backend, where the host computes the video itself (a compile beside it only
      competes for the same cores) and one compile at a time keeps XLA:CPU out of concurrent
      compiles.
    on_stage: None or `on_stage(name)` as each stage starts, name a `timings` key: "text_encode",
      "condition", "compile", "denoise", "decode" (e.g. `compile_cache.CacheUse.mark`: which stage
      found its programs in the persistent compilation cache), called in the thread that does the
      stage's work: "decode_compile_ahead" from the decoder's compile thread, beside the others.
  """
  progress: bool = True
  nan_guard: bool = True
  on_step: Callable[[int, float], None] | None = None
  callback: Callable | None = None
  callback_tensor_inputs: tuple[str, ...] = ("latents",)
  resume: ResumeConfig | None = None
  hooks: tuple[StepHook, ...] = ()
  text_kv_once: bool = True
  decode_compile_effort: float | None = None
  decode_compile_ahead: bool | None = None
  on_stage: Callable[[str], None] | None = None

  def __post_init__(self):
    from pipelines.wan.vae import check_compile_effort

    check_compile_effort(self.decode_compile_effort, "tpu")
    if self.on_stage is not None and not callable(self.on_stage):
      raise ValueError(f"on_stage={self.on_stage!r} must be None or a callable on_stage(name)")


def split_options(kwargs: dict[str, Any], *, default_progress: bool = True) -> tuple[dict[str, Any], CallOptions]:
  """A call's keyword arguments as (`GenerationRequest.build` arguments, `CallOptions`), the
  options checked.

  Raises:
    TypeError: an argument no call takes.
    ValueError: a bad option (naming it, its value and the fix).
  """
  unknown = sorted(set(kwargs) - set(REQUEST_ARGUMENTS) - set(LEGACY_OPTIONS)
                   - {"callback_on_step_end", "callback_on_step_end_tensor_inputs", "hooks"})
  options = sorted(set(unknown) & {f.name for f in dataclasses.fields(CallOptions)})
  if options:  # run options live in CallOptions, not among the request's arguments
    given = ", ".join(f"{name}={kwargs[name]!r}" for name in options)
    raise TypeError(f"WanPipeline call got {options}: run options, not request arguments; pass them as "
                    f"pipe.generate(GenerationRequest.build(pipe.facts, prompt, ...), CallOptions({given}))")
  if unknown:
    raise TypeError(f"WanPipeline call got unexpected keyword argument(s) {unknown}")
  request = {k: v for k, v in kwargs.items() if k in REQUEST_ARGUMENTS}
  on_step = kwargs.get("on_step")
  if on_step is not None and not callable(on_step):
    raise ValueError(f"on_step={on_step!r} must be None or a callable on_step(step, seconds){not_a(on_step)}")
  progress = check_flag("progress", kwargs.get("progress", default_progress))
  nan_guard = check_flag("nan_guard", kwargs.get("nan_guard", True))
  callback = kwargs.get("callback_on_step_end")
  tensor_inputs = check_callback(callback, kwargs.get("callback_on_step_end_tensor_inputs", ("latents",)))
  hooks = tuple(kwargs.get("hooks", ()))
  if any(not isinstance(h, StepHook) for h in hooks):
    raise ValueError(f"hooks={hooks!r} must be loop.StepHook instances")
  return request, CallOptions(progress=progress, nan_guard=nan_guard, on_step=on_step, callback=callback,
                              callback_tensor_inputs=tuple(tensor_inputs), resume=_resume_config(kwargs),
                              hooks=hooks)


def _resume_config(kwargs: dict[str, Any]) -> ResumeConfig | None:
  """The `ResumeConfig` of the legacy checkpoint_dir / checkpoint_every / resume / keep_checkpoint."""
  directory = kwargs.get("checkpoint_dir")
  resume = check_flag("resume", kwargs.get("resume", False))
  keep = check_flag("keep_checkpoint", kwargs.get("keep_checkpoint", False))
  every = kwargs.get("checkpoint_every", 1)
  if directory is None:
    if resume:
      raise ValueError("resume=True needs checkpoint_dir (the folder holding the checkpoint)")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
      raise ValueError(f"checkpoint_every={every!r} must be an int >= 1 (steps between checkpoints)")
    return None
  return ResumeConfig(directory, every=every, resume=resume, keep=keep)
