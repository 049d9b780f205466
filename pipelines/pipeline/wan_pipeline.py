"""Wan text-to-video pipeline (diffusers' `WanPipeline`) over a (cfg, ring, ulysses) mesh.

Glossary (DESIGN.md section 1): B videos (prompts), C latent channels, F / Hl / Wl latent frames /
height / width, L text tokens (`max_sequence_length`), N heads, U / R Ulysses / ring degrees.

What one call does, in diffusers' order (diffusers pipelines/wan/pipeline_wan.py, `__call__`):
0. the arguments are checked into a `GenerationRequest` (pipeline/request.py; before any compute);
1. prompts cleaned (`tokenizer.prompt_clean`), tokenised to L, UMT5-encoded; rows past each prompt's
   true length zeroed (pipeline/text.py). Text states given as `prompt_embeds` / `negative_prompt_embeds`
   are used as they are instead. Each prompt's rows are repeated `num_videos_per_prompt` times;
2. noise [B, C, F, Hl, Wl] float32 drawn on the host (video i from `numpy.random.default_rng(seed + i)`,
   pipeline/seed.py): the same seed, the same video on every mesh; diffusers' torch `generator` has
   no counterpart: pass its noise as `latents` for exact parity;
3. the scheduler's timesteps on the host; for step k the expert is `transformer` while
   t_k >= boundary_ratio * num_train_timesteps, else `transformer_2` (Wan 2.2 A14B);
4. the denoising loop (pipeline/loop.py) runs one compiled step per timestep (pipeline/step.py:
   transformer on [cond; uncond], guidance mix, scheduler step; latents and solver state donated);
   progress, the NaN guard, the resume writer, diffusers' `callback_on_step_end`, the step-cache
   statistics and the call's LoRA scale are hooks (pipeline/hooks.py);
5. latents de-normalised with the VAE statistics, decoded, mapped to [0, 1].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from attention.mesh import MeshSpec
from pipelines.pipeline.load import loading, single_file
from pipelines.pipeline.run import resume as resume_state, text as text_states
from pipelines.parallel.memory import check_placement
from pipelines.pipeline.run.call_options import CallOptions, split_options
from pipelines.pipeline.run.decoding import decode_videos
from pipelines.pipeline.checked.inputs import check_output_type, frames_to_pil
from pipelines.pipeline.load.lora_loading import LoraLoaderMixin
from pipelines.pipeline.load.placement import PlacedWeights
from pipelines.pipeline.checked.model_facts import ModelFacts
from pipelines.pipeline.checked.request import GenerationRequest
from pipelines.pipeline.run.text_cache import TextStatesCache
from pipelines.pipeline.run.continued import run_continued
from pipelines.pipeline.run.runner import GenerationResult, Runner
from pipelines.pipeline.run.step import CompiledSteps
from pipelines.pipeline.run.ti2v import conditioning as ti2v_conditioning
from pipelines.pipeline.checked.vace_inputs import conditioning as vace_conditioning
from pipelines.wan import conditioning as wan_conditioning, lora, step_cache as wan_step_cache, vae as wan_vae
from pipelines.wan.step_cache import warn_other_calibration
from pipelines.wan.transformer import WanTransformer, check_quantization, quantize_transformer
from pipelines.wan.encoders import UMT5Config, UMT5Params, text_length
from pipelines.wan.pretrained import (TINY_DEFAULT_FOLDER, TINY_I2V_FOLDER, TINY_TRAINED_NAMES, TINY_TRAINED_VIDEO,
                                      GenerationDefaults)

DTYPES = loading.DTYPES


class WanPipeline(LoraLoaderMixin, single_file.SingleFileMixin):
  """Text-to-video Wan (2.1 T2V, 2.2 T2V A14B with two experts, or 2.2 TI2V-5B), sequence-parallel
  transformer.

  Build with `from_pretrained(folder)`, `from_single_file(...)` or `tiny()`; call with prompts (`__call__`, or `run` for the
  timings and settings too, or `generate` with a checked `GenerationRequest`). LoRAs:
  `load_lora_weights`, `set_adapters` / `get_active_adapters`, `set_lora_scale`, `fuse_lora` /
  `unfuse_lora`. Step caching: `enable_cache` / `disable_cache`. Progress bars:
  `set_progress_bar_config(disable=...)`.

  Attributes:
    transformer_config: config shared by both experts.
    boundary_ratio: None (one expert) or the Wan 2.2 switch ratio.
    expand_timesteps: one timestep per token (Wan 2.2 TI2V-5B; `wan.conditioning.ti2v`); image conditioning
      through `pipeline.run.ti2v.ti2v_condition`.
    scheduler_config: `UniPCConfig`, `FlowEulerConfig` or `DPMSolverConfig` (`schedulers.SchedulerConfig`).
    dtype: transformer / text encoder dtype; the VAE runs in `vae.dtype`.
    name: where the weights came from (folder path, "tiny" (the trained default) or "tiny-random").
    max_sequence_length: the default text length L of calls (`tokenizer.text_length`).
    weights: the arrays and where they are (`PlacedWeights`).
    compiled_steps: the compiled denoise steps of this pipeline (`CompiledSteps`).
    step_cache: the step-cache spec every call uses (`enable_cache`), or None.
    quantization: the block weights' quantization (`quantize`; `wan.transformer.QUANTIZATION_MODES`), or None.
  """

  def __init__(self, *, tokenizer: Any, text_encoder: tuple[UMT5Config, UMT5Params],
               transformers: Sequence[WanTransformer], vae: wan_vae.WanVAE,
               scheduler_config: Any, boundary_ratio: float | None = None, expand_timesteps: bool = False,
               name: str = "", generation_defaults: GenerationDefaults | None = None):
    loading.check_parts(text_encoder[0], transformers, vae, boundary_ratio)
    self.transformer_config = transformers[0].config
    self.text_encoder_config = text_encoder[0]
    self.tokenizer = tokenizer
    self.max_sequence_length = text_length(getattr(tokenizer, "model_max_length", None))
    self.scheduler_config, self.boundary_ratio = scheduler_config, boundary_ratio
    self.expand_timesteps, self.name = bool(expand_timesteps), name
    self.generation_defaults = GenerationDefaults() if generation_defaults is None else generation_defaults
    self.dtype = transformers[0].dtype
    split = [nnx.split(t) for t in transformers]
    self._graphdef = split[0][0]
    self.weights = PlacedWeights([state for _, state in split], text_encoder[1], vae)
    self.compiled_steps = CompiledSteps(self._graphdef)
    self.step_cache: wan_step_cache.StepCacheSpec | None = None
    self.quantization: str | None = None
    self._lora_weights = lora.LoraWeights()
    self._progress = True
    self._fingerprint: tuple[int, str] | None = None
    self._interrupt = False  # diffusers' `interrupt`: a callback may set it
    self._num_timesteps: int | None = None
    self._current_timestep: Any = None
    self.memory_placement = "auto"  # `set_memory_placement`
    self.text_cache = TextStatesCache()  # prompts encoded while the text encoder is off the device

  # --- construction ---

  @classmethod
  def from_pretrained(cls, folder: str, dtype: str = "float32", vae_dtype: str = "float32", *,
                      mesh: Mesh | MeshSpec | str | None = None, shard_weights: bool = False,
                      progress: bool | None = None, quantize: str | None = None, revision: str | None = None,
                      token: str | bool | None = None, cache_dir: str | None = None,
                      local_files_only: bool = False) -> WanPipeline:
    """Loads a diffusers-format Wan folder (safetensors only), local or a Hugging Face Hub repo's.

    The weight files are memory-mapped and each weight is laid out, cast and placed on its devices
    in one copy, straight from the mapping (`distributed.put_host_leaves`): host memory beyond the
    placed weights is one tensor at a time, and a sharded weight is never assembled whole.

    Args:
      folder: holds model_index.json, transformer/ (+ transformer_2/ and `boundary_ratio` in
        model_index.json for Wan 2.2 A14B), text_encoder/, tokenizer/, vae/, scheduler/; a folder in
        the official Wan layout (`wan.pretrained.layouts`: config.json with Wan's fields, .pth files); or
        a Hub id, "org/name" or "org/name@revision" (not an existing path): only the files the pipeline
        loads are downloaded into the Hub cache (`pretrained.hub`), and the pipeline is named by it.
      dtype: "float32" or "bfloat16": transformer(s) and text encoder (diffusers' `torch_dtype`).
      vae_dtype: the VAE's dtype; float32 by default as Wan's reference code and diffusers' Wan
        examples run it.
      mesh: the mesh the pipeline will be called on (as `__call__`'s `mesh`): the transformer
        weights go straight to their places on it (replicated, or split with `shard_weights`), and
        with `shard_weights` the text encoder's large weights too. None: the first device.
      shard_weights: with `mesh`, FSDP-style weight sharding (see `__call__`).
      progress: progress bars while loading (None: for large folders only).
      quantize: None, "int8", "fp8" or "int8-w8a8": the transformers' block Linear weights
        quantized as they are loaded, from the checkpoint's values (`quantize` says what and how;
        `transformer.load_transformer`: one fp32 stacked kernel at a time on the devices);
        with `shard_weights` the 1-byte values and their scales are what is split and gathered.
      revision, token, cache_dir, local_files_only: a Hub id's, as huggingface_hub's (HF_TOKEN,
        HF_HUB_CACHE, HF_HUB_OFFLINE and HF_ENDPOINT apply).

    Raises:
      ValueError: an unknown dtype or quantize mode, or a mesh that does not fit the devices or heads.
      weights.CheckpointError: a folder that is not a Wan pipeline, a bad weight file; a Hub repo
        missing, of another pipeline, not cached while offline (`pretrained.download_snapshot`).
      tokenizer.TokenizerNotFoundError: no tokenizer/ folder.
    """
    check_quantization(quantize)  # before any loading
    folder, name, _ = loading.locate(folder, revision=revision, token=token, cache_dir=cache_dir,
                                     local_files_only=local_files_only, image_to_video=cls.image_to_video)
    parts, plan = single_file.pretrained_parts(folder, dtype, vae_dtype, mesh, shard_weights, progress, quantize,
                                               image_to_video=cls.image_to_video, name=name)
    return single_file.built(cls, parts, plan, quantize)

  @classmethod
  def tiny(cls, dtype: str = "float32", *, random: bool = False, quantize: str | None = None,
           image: bool = False, vae_dtype: str = "float32") -> WanPipeline:
    """The embedded default (no download, no files outside the package).

    Args:
      dtype: "float32" or "bfloat16" (transformer and text encoder); vae_dtype: the VAE's, the same two.
      random: False (default): the trained tiny model in `TINY_DEFAULT_FOLDER` (`end_to_end.train.tiny`):
        the shapes world, e.g. "a red square moving right", at its folder's defaults (64x64 x 17
        frames, `generation_defaults.json`). True: random weights from a fixed seed
        (`wan.pretrained.tiny`): noise-like videos, every code path, fastest compiles (most tests).
      quantize: None, "int8", "fp8" or "int8-w8a8" (`quantize`).
      image: "tiny-i2v", `TINY_I2V_FOLDER` (a TI2V folder, `train.long_clips`): `pipe(prompt,
        image=first_frame)` continues the given frame; it also knows slow motions over 65 frames.

    Raises: ValueError: `image` with `random`, or an unknown quantize mode.
    """
    check_quantization(quantize)
    if image and random:
      raise ValueError("image=True is the trained default run with a first frame (tiny-i2v); the random-weight "
                       "model (random=True) was not trained for it: pass one of them")
    if random:
      pipe = cls(**loading.tiny_random_parts(dtype, vae_dtype))
      if quantize is not None:
        pipe.quantize(quantize)
      return pipe
    folder = TINY_I2V_FOLDER if image else TINY_DEFAULT_FOLDER
    pipe = cls.from_pretrained(folder, dtype=dtype, vae_dtype=vae_dtype, quantize=quantize)
    pipe.name = "tiny-i2v" if image else "tiny"
    return pipe

  def quantize(self, mode: str) -> None:
    """Quantizes the transformer(s)' block Linear weights now, in place (`wan.transformer.quantization`: the
    modes, what keeps its dtype and why, the error bounds); the weights stay where they were placed
    (with sharded weights the 1-byte values and their fp32 scales are what is split).

    LoRAs fused before this call are part of the quantized weights. The full-precision weights are
    not kept, so afterwards every LoRA method that changes weights is refused: to use a LoRA, load
    with quantize=None, load the LoRA, then call `quantize`.

    Raises:
      ValueError: an unknown mode, or weights quantized already.
    """
    mode = check_quantization(mode)
    if self.quantization is not None:
      raise ValueError(f"the weights are quantized already ({self.quantization}); load the pipeline again to "
                       f"quantize them as {mode!r}")
    if mode is None:
      return
    states = []
    for state in self.weights.experts:  # a new tree (merge shares the Variables): the old state is left whole
      model = nnx.merge(self._graphdef, jax.tree.map(lambda a: a, state))
      graphdef, state = nnx.split(quantize_transformer(model, mode))
      states.append(state)
    self._graphdef = graphdef
    self.compiled_steps = CompiledSteps(graphdef)
    self.weights.replace_experts(states)
    self.quantization = mode

  # --- what the model is ---

  image_to_video = False  # WanImageToVideoPipeline: True
  # WanVideoToVideoPipeline: True: `latents` without a video are the already noised start and
  # `strength` sets the step it starts from (diffusers' meanings; `GenerationRequest.build`).
  video_to_video = False

  def _conditioning_weights(self) -> dict[str, Any]:
    """Weights beyond the transformer, text encoder and VAE that decide the video (the fingerprint
    covers them): none for text-to-video."""
    return {}

  def initial_latents(self, request: GenerationRequest, noise: np.ndarray, sigma: np.float32, stage: Any
                      ) -> np.ndarray:
    """The loop's starting latents float32 [B', C, F, Hl, Wl]: the noise (or the `latents` given),
    or for video-to-video the request's video encoded by the VAE and noised to `sigma`, the first
    running step's (`wan.conditioning.noised`; diffusers' `WanVideoToVideoPipeline.prepare_latents`;
    `stage(line)` announces the encode)."""
    if request.video is None or request.latents is not None:
      return noise
    frames = request.video.frames
    stage(f"video encode: {len(frames)} frames at {request.width}x{request.height} (VAE)")
    x0 = wan_conditioning.encode_video(self.vae, request.video.pixels(request.height, request.width))
    return wan_conditioning.noised(x0, noise, sigma)

  def conditioning(self, request: GenerationRequest, stage: Any) -> Any:
    """The step's conditioning beyond the text (`step.denoise_step`'s `condition`): None for
    text-to-video; image-to-video pipelines encode the request's images (`stage(line)` announces
    the work). A Wan 2.2 TI2V model (`expand_timesteps`) always runs per-token timesteps, with the
    request's first frame when it has one (`pipeline.run.ti2v.conditioning`), as does any model given
    a window's first frames (`pipeline.run.continued`); a VACE model its VACE context, from the
    request's video, mask and reference images or none of them (`vace_inputs.conditioning`)."""
    if self.transformer_config.has_vace:
      return vace_conditioning(self.vae, request, stage)
    if not self.expand_timesteps and request.first_frame_latents is None:
      return None
    return ti2v_conditioning(self.vae, request, self.transformer_config.patch_size, stage)

  @property
  def num_experts(self) -> int:
    return len(self.weights.experts)

  @property
  def vae(self) -> wan_vae.WanVAE:
    return self.weights.vae

  @property
  def _experts(self) -> list[nnx.State]:
    """The experts' weights (the LoRA methods read and replace them).

    Raises:
      ValueError: the weights are quantized (`quantize`): a LoRA is fused into full-precision
        weights, which a quantized pipeline no longer holds.
    """
    if self.quantization is not None:
      raise ValueError(f"this pipeline's weights are quantized ({self.quantization}): LoRAs are fused into the "
                       "full-precision weights, which it no longer holds; load it with quantize=None, load the "
                       f"LoRAs, then call pipe.quantize({self.quantization!r})")
    return self.weights.experts

  @_experts.setter
  def _experts(self, states: list[nnx.State]) -> None:
    self.weights.experts = states

  @property
  def _text_params(self) -> UMT5Params:
    return self.weights.text_params

  @property
  def facts(self) -> ModelFacts:
    """What checking a call needs to know of this model (`model_facts.ModelFacts`)."""
    return ModelFacts(
        name=self.name, transformer=self.transformer_config, spatial_factor=self.vae.config.spatial_factor,
        temporal_factor=self.vae.config.temporal_factor, boundary_ratio=self.boundary_ratio,
        scheduler=self.scheduler_config, max_sequence_length=self.max_sequence_length,
        dtype=jnp.dtype(self.dtype).name, image_to_video=self.image_to_video and not self.expand_timesteps,
        trained_video=TINY_TRAINED_VIDEO if self.name in TINY_TRAINED_NAMES else None,
        quantize=self.quantization, expand_timesteps=self.expand_timesteps, defaults=self.generation_defaults)

  def latent_shape(self, batch: int, height: int, width: int, num_frames: int) -> tuple[int, ...]:
    """[B, C, F, Hl, Wl] for a video of `num_frames` (4k+1) x height x width."""
    return self.facts.latent_shape(batch, height, width, num_frames)

  def fingerprint(self) -> str:
    """SHA-256 (hex) of this pipeline's model: configs, dtypes and sampled values of every weight
    (`resume.model_fingerprint`); computed again only after the weights change (a LoRA fused)."""
    if self._fingerprint is None or self._fingerprint[0] != self.weights.version:
      transformer = dataclasses.asdict(self.transformer_config)
      if not self.transformer_config.has_vace:  # so the other models' fingerprints stay as they were
        del transformer["vace_layers"], transformer["vace_in_channels"]
      config = {"transformer": transformer,
                "text_encoder": dataclasses.asdict(self.text_encoder_config),
                "vae": dataclasses.asdict(self.vae.config), "dtype": jnp.dtype(self.dtype).name,
                "vae_dtype": jnp.dtype(self.vae.dtype).name, "boundary_ratio": self.boundary_ratio,
                **({"quantize": self.quantization} if self.quantization else {})}
      if self.expand_timesteps:  # only then, so the other models' fingerprints stay as they were
        config["expand_timesteps"] = True
      trees = {f"transformer{i or ''}": state for i, state in enumerate(self.weights.experts)}
      trees.update(text_encoder=self.weights.text_params, vae=self.vae, **self._conditioning_weights())
      self._fingerprint = (self.weights.version, resume_state.model_fingerprint(trees, config))
    return self._fingerprint[1]

  # --- settings kept on the pipeline (diffusers' names) ---

  def enable_cache(self, step_cache: str | wan_step_cache.StepCacheSpec) -> None:
    """Every following call caches steps: "first-block:THRESH" (first-block residual cache) or
    "mag:THRESH[:K][@RATIOS.json]" (MagCache), or a `step_cache.StepCacheSpec`: steps whose change
    measure stays below THRESH reuse a cached residual instead of running the transformer's blocks
    (pipelines/wan/step_cache/forward.py; diffusers' `enable_cache` idea).

    Raises:
      ValueError: a malformed spec, or MagCache without ratios calibrated for this model.
    """
    self.step_cache = wan_step_cache.parse_step_cache(step_cache, model=self.name)

  def set_memory_placement(self, placement: str = "auto") -> None:
    """Where the weights live in every following call (`parallel.memory`, diffusers' nearest:
    `enable_model_cpu_offload`): "auto" (the fastest placement that fits the device), "resident",
    "encoder-offloaded" or "encoder-on-host". Raises ValueError for another name."""
    self.memory_placement = check_placement(placement)

  def disable_cache(self) -> None:
    """Every following call runs every block of every step."""
    self.step_cache = None

  def set_progress_bar_config(self, disable: bool = False, **kwargs: Any) -> None:
    """diffusers' `set_progress_bar_config`: `disable=True` silences the stage lines and the bar."""
    del kwargs  # tqdm's other options (leave, desc, ...) are not forwarded
    self._progress = not disable

  @property
  def interrupt(self) -> bool:
    """diffusers' `interrupt`: set `pipe._interrupt = True` (e.g. in `callback_on_step_end`) to skip
    the remaining denoising steps of the current call; reset to False as each call starts."""
    return self._interrupt

  @property
  def num_timesteps(self) -> int | None:
    """diffusers' `num_timesteps`: the current (or last) call's number of denoising steps."""
    return self._num_timesteps

  @property
  def current_timestep(self) -> Any:
    """diffusers' `current_timestep`: the step's timestep during denoising, None outside it."""
    return self._current_timestep

  # --- the call ---

  def check_inputs(self, prompt: Any = None, negative_prompt: Any = None, **kwargs: Any) -> GenerationRequest:
    """Checks a call (no compute) and returns its `GenerationRequest`; the keyword arguments are
    `__call__`'s (`GenerationRequest.build` and `call_options.split_options` check them).

    Raises:
      ValueError: every bad argument, each message naming the argument, its value and the fix.
    """
    request, _ = self._request(prompt, negative_prompt, kwargs)
    return request

  def __call__(self, prompt: str | Sequence[str] | None = None, negative_prompt: str | Sequence[str] | None = None,
               height: int | None = None, width: int | None = None, num_frames: int | None = None,
               num_inference_steps: int | None = None, guidance_scale: float | None = None,
               seed: int | Sequence[int] | None = None, latents: Any = None,
               max_sequence_length: int | None = None, mesh: Mesh | str | None = None, *,
               guidance_scale_2: float | None = None, flow_shift: float | None = None,
               num_videos_per_prompt: int = 1, prompt_embeds: Any = None, negative_prompt_embeds: Any = None,
               output_type: str = "np", callback_on_step_end: Any = None,
               callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
               attention_kwargs: dict[str, Any] | None = None, **options: Any) -> Any:
    """Generates videos; diffusers `WanPipeline.__call__(...).frames` with the same argument names.

    `call_options.CALL_DOCS` documents every argument (diffusers' meanings; plus `seed`, `mesh`,
    `flow_shift`, `timesteps` / `sigmas` (a custom schedule), `scheduler` ("unipc", "euler",
    "dpm++")); `**options` takes `generator` (refused with the fix: pass noise as `latents`)
    and, for one release, the keyword arguments this call took before the step cache, resumable
    denoising, progress and the NaN guard moved to objects (`call_options.LEGACY_OPTIONS`).

    Returns:
      as `output_type`: float32 numpy [B', frames, height, width, 3] in [0, 1] ("np"), float32
      numpy [B', C, F, Hl, Wl] ("latent"), or a list of B' lists of PIL images ("pil").

    Raises:
      ValueError: every bad argument (before any compute); a callback's bad return value.
      resume.ResumeError: see `generate`.
      NonFiniteLatentsError: latents became NaN/inf (the NaN guard is on by default).
    """
    check_output_type(output_type)
    if output_type == "pil":
      import PIL.Image  # noqa: F401  (fails now, not after the run, if pillow is missing)
    result = self.run(prompt, negative_prompt, height, width, num_frames, num_inference_steps, guidance_scale,
                      seed, latents, max_sequence_length, mesh, guidance_scale_2=guidance_scale_2,
                      flow_shift=flow_shift, num_videos_per_prompt=num_videos_per_prompt,
                      prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
                      callback_on_step_end=callback_on_step_end,
                      callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
                      attention_kwargs=attention_kwargs, decode=output_type != "latent", **options)
    if output_type == "latent":
      return result.latents
    return frames_to_pil(result.frames) if output_type == "pil" else result.frames

  def run(self, prompt: Any = None, negative_prompt: Any = None, height: int | None = None,
          width: int | None = None, num_frames: int | None = None, num_inference_steps: int | None = None,
          guidance_scale: float | None = None,
          seed: int | Sequence[int] | None = None, latents: Any = None, max_sequence_length: int | None = None,
          mesh: Mesh | str | None = None, **kwargs: Any) -> GenerationResult:
    """`__call__` returning a `GenerationResult` (frames, latents, timings and the resolved settings);
    `decode=False` skips the VAE (`frames` is None). The keyword arguments are `__call__`'s.

    Raises:
      as `__call__`.
    """
    request, options = self._request(prompt, negative_prompt, dict(
        kwargs, height=height, width=width, num_frames=num_frames, num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale, seed=seed, latents=latents, max_sequence_length=max_sequence_length,
        mesh=mesh))
    return self.generate(request, options)

  def _request(self, prompt: Any, negative_prompt: Any, kwargs: dict[str, Any]
               ) -> tuple[GenerationRequest, CallOptions]:
    """(the checked request, the call's other options) of a call's arguments."""
    request_args, options = split_options(kwargs, default_progress=self._progress)
    if "step_cache" not in request_args:
      request_args["step_cache"] = self.step_cache
    return GenerationRequest.build(self.facts, prompt, negative_prompt, video_to_video=self.video_to_video,
                                   **request_args), options

  def generate(self, request: GenerationRequest, options: CallOptions | None = None, *,
               resume: resume_state.ResumeConfig | None = None) -> GenerationResult:
    """Runs a checked request (`GenerationRequest.build(pipe.facts, ...)`).

    Args:
      request: the generation.
      options: progress, the NaN guard, per-step callbacks and extra hooks (`CallOptions`; default:
        progress as `set_progress_bar_config` says, NaN guard on).
      resume: resumable denoising (`resume.ResumeConfig`): the state is saved to its folder every
        `every` steps; `resume=True` there continues a saved run, whose settings must match
        (naming each difference); the video equals the uninterrupted run's.

    Raises:
      ValueError: a request checked against another model (`request.model != pipe.facts`).
      resume.ResumeError: `resume` without a checkpoint, a checkpoint of another run, or one in the
        way of a new run; raised before any denoising.
      NonFiniteLatentsError: latents became NaN/inf (with the NaN guard), naming the step.
    """
    if request.model != self.facts:
      raise ValueError(f"the request was checked against another model ({request.model}); this pipeline is "
                       f"{self.facts}: build it with GenerationRequest.build(pipe.facts, ...)")
    warn_other_calibration(  # MagCache ratios made for another model or setting
        request.step_cache, model=self.name, fingerprint=self.fingerprint, height=request.height,
        width=request.width, num_frames=request.num_frames, steps=request.steps,
        max_sequence_length=request.max_sequence_length)
    options = CallOptions(progress=self._progress) if options is None else options
    if resume is not None:
      options = dataclasses.replace(options, resume=resume)
    self._interrupt = False  # diffusers: reset as each call starts; a callback may set it
    self._num_timesteps = request.steps_run
    if request.windows is not None and request.windows.fuse == "continue":
      return run_continued(self, request, options)
    return Runner(self, request, options).run()

  # --- stages ---

  def encode_prompts(self, prompts: Sequence[str], max_sequence_length: int) -> Any:
    """Cleaned, tokenised and UMT5-encoded prompts, zero past each true length.

    Returns:
      [len(prompts), L, text_dim] in the model dtype (diffusers casts to the transformer dtype).
    """
    return text_states.encode_prompts(self.tokenizer, self.text_encoder_config, self.weights.text_params,
                                      prompts, max_sequence_length, self.dtype, mesh=self.weights.text_mesh)

  def decode(self, latents: np.ndarray, mesh: Mesh | None = None, *,
             compile_effort: float | None = None, band_rows: int | None = None, streamed: bool = False) -> np.ndarray:
    """Diffusion latents float32 [B, C, F, Hl, Wl] -> float32 numpy [B, frames, H, W, 3] in [0, 1]
    (`decoding.decode_videos`: one video at a time; with a `mesh`, split along height; on one
    device in bands of `band_rows` latent rows when given, or `streamed` layer by layer; the programs
    compiled at `compile_effort`, None: the platform's)."""
    return decode_videos(self.weights, latents, mesh, compile_effort=compile_effort, band_rows=band_rows,
                         streamed=streamed)

