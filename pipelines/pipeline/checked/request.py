"""One generation as checked: `GenerationRequest`, built by one constructor from a call's arguments.

`GenerationRequest.build` is the only place a call's arguments are checked (the Python call and the
`generate` command both build one; each bad argument raises a ValueError naming it, its value and
the fix, before any compute). The sidecar's settings and the resume identity are derived from it.

Glossary (DESIGN.md section 1): B prompts, B' = B x num_videos_per_prompt videos, C latent
channels, F / Hl / Wl latent frames / height / width, L text tokens.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import numpy as np

from pipelines.parallel.plan import ParallelPlan
from pipelines.parallel.token_facts import TokenFacts
from pipelines.pipeline.checked import seed as seeding
from pipelines.pipeline.checked.image_inputs import ImageInputs, check_image_inputs, digest
from pipelines.pipeline.checked.vace_inputs import VACEInputs, check_vace_inputs
from pipelines.pipeline.checked.video_inputs import VideoInputs, check_video_inputs
from pipelines.pipeline.checked.schedule_inputs import check_schedule
from pipelines.pipeline.checked.window_inputs import check_context_windows
from pipelines.pipeline.checked.inputs import (check_flag, check_int, check_number, check_size, embeds_array,
                                               is_real, not_a, round_num_frames, seed_or_latents, texts)
from pipelines.pipeline.checked.model_facts import ModelFacts
from pipelines.wan import schedulers, step_cache as wan_step_cache

GUIDANCE_HINT = " (Wan: 5.0; <= 1 turns CFG off)"


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
  """A generation with every argument checked and resolved (`GenerationRequest.build`).

  Attributes:
    model: the `ModelFacts` it was checked against.
    prompts, negative_prompts: B prompts / B negative prompts (None: given as embeds, or no CFG).
    prompt_embeds, negative_prompt_embeds: float32 numpy [B, L, text_dim] given, or None.
    num_videos_per_prompt: n; videos: B' = B x n.
    height, width, num_frames: pixels and frames (frames rounded to 4k + 1).
    steps: denoising steps.
    timesteps, sigmas: the custom schedule as given (at most one; `flow_schedule`), or None.
    guidance: (scale of expert 1, scale of expert 2); cfg: guidance on (scale > 1).
    scheduler: the scheduler config (solver chosen, flow shift applied).
    seed: the noise seed: an int (video i uses seed + i), a tuple of one seed per video (a server's
      batch: each job's own), or None when `latents` are given (`seed.video_seeds`).
    latents: float32 numpy [B', C, F, Hl, Wl] given, or None.
    latent_shape: [B', C, F, Hl, Wl].
    max_sequence_length: L for encoded prompts.
    plan: where and how it runs (`ParallelPlan`).
    lora_scale: `attention_kwargs["scale"]` or None.
    step_cache: the parsed step-cache spec or None.
    decode: run the VAE (False: latents only).
    image: the image-to-video inputs (`image_inputs.ImageInputs`), None for text-to-video.
    first_frame_latents: float32 numpy [B', C, Fg, Hl, Wl], the normalised VAE latents of the first
      Fg frames, given: a Wan 2.2 TI2V run's first frame (Fg = 1, set by `pipeline.run.ti2v.ti2v_condition`)
      or a context window's overlap with the one before (`pipeline.run.continued`); or None.
    video: the video-to-video input and strength (`video_inputs.VideoInputs`), or None.
    vace: a VACE model's video, mask, reference images and scales (`vace_inputs.VACEInputs`), or
      None (not a VACE model). Its n reference images add n latent frames in front of the video's
      (`latent_shape`), dropped before decoding.
    windows: the context windows (`wan.conditioning.ContextWindows`, latent frames), or None: one clip.
  """
  model: ModelFacts
  prompts: list[str] | None
  negative_prompts: list[str] | None
  prompt_embeds: np.ndarray | None
  negative_prompt_embeds: np.ndarray | None
  num_videos_per_prompt: int
  videos: int
  height: int
  width: int
  num_frames: int
  steps: int
  guidance: tuple[float, float]
  cfg: bool
  scheduler: Any
  seed: int | tuple[int, ...] | None
  latents: np.ndarray | None
  latent_shape: tuple[int, ...]
  max_sequence_length: int
  plan: ParallelPlan
  lora_scale: float | None = None
  step_cache: Any = None
  decode: bool = True
  image: ImageInputs | None = None
  timesteps: tuple[float, ...] | None = None
  sigmas: tuple[float, ...] | None = None
  first_frame_latents: np.ndarray | None = None
  video: VideoInputs | None = None
  vace: VACEInputs | None = None
  windows: Any = None

  @classmethod
  def build(cls, model: ModelFacts, prompt: Any = None, negative_prompt: Any = None, *, height: Any = None,
            width: Any = None, num_frames: Any = None, num_inference_steps: Any = None, guidance_scale: Any = None,
            guidance_scale_2: Any = None, flow_shift: Any = None, seed: Any = None, latents: Any = None,
            max_sequence_length: Any = None, mesh: Any = None, prompt_embeds: Any = None,
            negative_prompt_embeds: Any = None, num_videos_per_prompt: Any = 1, attention_kwargs: Any = None,
            generator: Any = None, step_cache: Any = None, shard_weights: Any = False,
            attention_implementation: Any = "auto", attention_backend: Any = "auto", vae_parallel: Any = True,
            decode: Any = True, attention_exchange: Any = "bf16", image: Any = None, last_image: Any = None,
            image_embeds: Any = None, timesteps: Any = None, sigmas: Any = None, scheduler: Any = None,
            video: Any = None, strength: Any = 0.8, mask: Any = None, reference_images: Any = None,
            conditioning_scale: Any = 1.0, context_frames: Any = None, context_overlap: Any = None,
            context_fuse: Any = None, video_to_video: Any = False) -> GenerationRequest:
    """Checks a call's arguments (`WanPipeline.__call__` documents each) against the model.

    Text inputs follow diffusers' `WanPipeline.check_inputs`: exactly one of `prompt` and
    `prompt_embeds`; at most one of `negative_prompt` and `negative_prompt_embeds`; a missing
    negative is encoded from `negative_prompt` (default "") with the prompts' batch size. Every
    argument is checked for type as well as value (a bool is not an int, a str not a number,
    NaN/inf not a number either), whether or not the call would use it. A size, frame count, step
    count, guidance or context fuse left None is the model's (`ModelFacts.fill`: its folder's
    `generation_defaults.json`, else diffusers' 480 x 832, 81, 50, 5.0, "pyramid"); steps with
    `timesteps` / `sigmas`, their length (`schedulers.custom_sigmas`). A prompt outside a small
    model's world (`GenerationDefaults.prompt_world`) warns.
    `video_to_video` is the pipeline's kind (`WanPipeline.video_to_video`), not a call argument.
    It stays one piece: a linear sequence of checks, one line per argument group, each in its helper.

    Raises:
      ValueError: every bad argument, each message naming the argument, its value and the fix.
    """
    _refuse_generator(generator)
    height, width, num_frames, num_inference_steps, guidance_scale, guidance_scale_2 = model.fill(
        height, width, num_frames, num_inference_steps, guidance_scale, guidance_scale_2,
        custom_schedule=timesteps is not None or sigmas is not None)
    images = _image_inputs(model, image, last_image, image_embeds)
    prompts, negatives, embeds, negative_embeds, batch = _text_inputs(
        model, prompt, negative_prompt, prompt_embeds, negative_prompt_embeds)
    per_prompt = check_int("num_videos_per_prompt", num_videos_per_prompt, hint=" (videos per prompt)")
    num_frames = _size_and_frames(model, height, width, num_frames, context_frames)
    scheduler, steps = check_schedule(model, scheduler, flow_shift, num_inference_steps, timesteps, sigmas)
    from_latents = check_flag("video_to_video", video_to_video) and latents is not None
    vace, source = _video_inputs(model, video, strength, mask, reference_images, conditioning_scale,
                                 num_frames=num_frames, steps=steps, from_latents=from_latents)
    length = check_int("max_sequence_length", model.max_sequence_length if max_sequence_length is None
                       else max_sequence_length, hint=" (Wan uses 512)")
    guidance = _guidance(model, guidance_scale, guidance_scale_2)
    cfg = max(guidance) > 1.0  # the unconditional rows exist when any expert guides (`expert_cfg`)
    _check_text_lengths(embeds, negative_embeds, length, cfg)
    references = 0 if vace is None else len(vace.references)
    shape = model.latent_shape(batch * per_prompt, height, width, num_frames + model.temporal_factor * references)
    seed, noise = seed_or_latents(seed, latents, shape, f"{batch} prompt(s) x {per_prompt} video(s), {num_frames} "
                         f"frames at {height}x{width}")
    decode, lora_scale = check_flag("decode", decode), _lora_scale(attention_kwargs)
    cache_spec = _step_cache(model, step_cache, source)
    plan = ParallelPlan.build(mesh, heads=model.transformer.num_attention_heads, cfg_active=cfg,
                              shard_weights=shard_weights, attention_implementation=attention_implementation,
                              attention_backend=attention_backend, vae_parallel=vae_parallel,
                              attention_exchange=attention_exchange)
    windows = check_context_windows(context_frames, context_overlap, context_fuse, num_frames=num_frames, model=model,
                                    windows_degree=plan.windows, vace=vace is not None, video=source is not None)
    model.warn_outside_world(prompts)  # once the request is valid
    return _check_schedule(cls(
        model=model, prompts=prompts, negative_prompts=negatives if cfg else None, prompt_embeds=embeds,
        negative_prompt_embeds=negative_embeds if cfg else None, num_videos_per_prompt=per_prompt,
        videos=batch * per_prompt, height=int(height), width=int(width), num_frames=num_frames, steps=steps,
        guidance=guidance, cfg=cfg, scheduler=scheduler, seed=seed, latents=noise, latent_shape=shape,
        max_sequence_length=length, plan=plan, lora_scale=lora_scale, step_cache=cache_spec, decode=decode,
        image=images, timesteps=_floats(timesteps), sigmas=_floats(sigmas), video=source, vace=vace,
        windows=windows))

  # --- derived ---

  @property
  def mesh(self) -> Any:
    """The built mesh, or None (one device): `plan.mesh`."""
    return self.plan.mesh

  @property
  def tokens(self) -> int:
    """T, the video tokens of one video."""
    return self.model.tokens(self.latent_shape)

  @property
  def token_facts(self) -> TokenFacts:
    """The model's `token_facts` with L this request's text length (what the planner reads)."""
    return dataclasses.replace(self.model.token_facts, text_tokens=self.max_sequence_length)

  @property
  def clip_frames(self) -> int:
    """The frames one transformer forward sees: a context window's, else the video's."""
    return self.num_frames if self.windows is None else self.windows.video_frames(self.model.temporal_factor)[0]

  @property
  def rows(self) -> int:
    """Rows of one transformer forward: B', or 2 B' under CFG ([cond; uncond])."""
    return self.videos * (2 if self.cfg else 1)

  def expert_cfg(self, expert: int) -> bool:
    """Whether `expert`'s steps run the unconditional rows (DESIGN.md, "Guidance per expert"): its
    scale is above 1, or another expert guides and the rows are split over the CFG axis or a step
    cache holds [cond; uncond] residuals (then mixed at 1); else one pass of B' rows."""
    return self.cfg and (self.guidance[expert] > 1.0 or self.plan.cfg_parallel or self.step_cache is not None)

  def noise(self) -> np.ndarray:
    """The initial latents float32 [B', C, F, Hl, Wl]: as given, or video i from its seed
    (`seed.seeded_noise` of `seed.video_seeds`: seed + i, so a batch equals its prompts run alone)."""
    if self.latents is not None:
      return self.latents
    return seeding.seeded_noise(seeding.video_seeds(self.seed, self.videos), self.latent_shape[1:])

  def schedule(self) -> Any:
    """The host-side schedule of the run (`scheduler.set_timesteps`, the custom one if given); for
    video-to-video its tail from the strength's first step (`video_inputs.VideoInputs.start`)."""
    _, sigmas = schedulers.custom_sigmas(self.steps, self.sigmas, self.timesteps,
                                            self.scheduler.num_train_timesteps)
    schedule = self.scheduler.set_timesteps(self.steps, sigmas=sigmas)
    return schedule if self.video is None else schedule.tail(self.video.start(self.steps))

  @property
  def steps_run(self) -> int:
    """The denoising steps that run: `steps`, or video-to-video's last int(steps x strength)."""
    return self.steps if self.video is None else self.steps - self.video.start(self.steps)

  def experts_per_step(self, timesteps: Any) -> list[int]:
    """The expert of each step: 0 while t >= boundary_ratio * num_train_timesteps, then 1."""
    if self.model.boundary_ratio is None:
      return [0] * len(timesteps)
    boundary = self.model.boundary_ratio * self.scheduler.num_train_timesteps
    return [0 if t >= boundary else 1 for t in timesteps]

  def settings(self) -> dict[str, Any]:
    """The request as the sidecar's `settings` record it (JSON-able; the loop adds what the run
    found: experts per step, steps run, resumed-from step, step-cache skips)."""
    return {"height": self.height, "width": self.width, "num_frames": self.num_frames, "steps": self.steps,
            "cfg": self.cfg, "seed": _listed(self.seed), "max_sequence_length": self.max_sequence_length,
            "prompts": self.prompts, "negative_prompts": self.negative_prompts,
            "guidance_scale": self.guidance[0],
            "guidance_scale_2": self.guidance[1] if self.model.boundary_ratio is not None else None,
            "cfg_per_expert": [self.expert_cfg(e) for e in range(self.model.experts)],
            "scheduler": _scheduler_record(self.scheduler), "boundary_ratio": self.model.boundary_ratio,
            "timesteps": _listed(self.timesteps), "sigmas": _listed(self.sigmas),
            "dtype": self.model.dtype, "quantize": self.model.quantize,
            "explicit_latents": self.latents is not None,
            "num_videos_per_prompt": self.num_videos_per_prompt,
            "prompt_embeds_given": self.prompt_embeds is not None,
            "negative_prompt_embeds_given": self.negative_prompt_embeds is not None,
            "lora_scale": self.lora_scale, **self._input_digests(), **self.plan.describe()}

  def identity(self, fingerprint: str, noise: np.ndarray) -> dict[str, Any]:
    """What a denoising checkpoint must match to be resumed by this request (`pipeline.run.resume`):
    everything that decides the video; not the mesh, the attention path or the decode (the same
    video either way); the fp8 attention exchange (a lossy one) when it is on."""
    return {
        "model": self.model.name, "model_fingerprint": fingerprint,
        "prompts": self.prompts, "negative_prompts": self.negative_prompts,
        "height": self.height, "width": self.width, "num_frames": self.num_frames,
        "num_inference_steps": self.steps, "guidance_scale": list(self.guidance), "cfg": self.cfg,
        "scheduler": _scheduler_record(self.scheduler), "max_sequence_length": self.max_sequence_length,
        "dtype": self.model.dtype, "noise_sha256": seeding.noise_digest(noise),
        "num_videos_per_prompt": self.num_videos_per_prompt, "lora_scale": self.lora_scale,
        "prompt_embeds_sha256": digest(self.prompt_embeds),
        "negative_prompt_embeds_sha256": digest(self.negative_prompt_embeds),
    } | self._input_digests() | ({} if self.step_cache is None else {"step_cache": self.step_cache.identity()}) | (
        {} if self.plan.attention_exchange == "bf16" else {"attention_exchange": self.plan.attention_exchange}) | {
        name: list(given) for name, given in (("timesteps", self.timesteps), ("sigmas", self.sigmas))
        if given is not None}

  def video_settings(self, settings: dict[str, Any], video: int) -> dict[str, Any]:
    """A run's `settings` (`settings()` and what the loop added) as a run of video `video` (0..B'-1)
    alone records them: its prompt and negative prompt (prompt video // n, n videos per prompt), its
    seed (`seed.video_seeds`), one video per prompt; what it shares with the batch as it is."""
    prompt = video // self.num_videos_per_prompt
    own = {"num_videos_per_prompt": 1}
    for name, given in (("prompts", self.prompts), ("negative_prompts", self.negative_prompts)):
      if given is not None:
        own[name] = [given[prompt]]
    if self.seed is not None:
      own["seed"] = seeding.video_seeds(self.seed, self.videos)[video]
    return {**settings, **own}

  def _input_digests(self) -> dict[str, Any]:
    """The input images' and video's digests (image-to-video, TI2V's first frame, video-to-video's
    video and strength; none for text-to-video)."""
    first = {} if self.first_frame_latents is None else {
        "first_frame_latents_sha256": digest(self.first_frame_latents)}
    video = {} if self.video is None else self.video.digests()
    vace = {} if self.vace is None else self.vace.digests()
    windows = {} if self.windows is None else {"context_windows": self.windows.describe()}
    return first | ({} if self.image is None else self.image.digests()) | video | vace | windows


# guidance_scale's: below 0 the mix steers away from the prompt; above 100 (ComfyUI's cap) the mixed
# prediction is over 100x the model's own and the latents leave the range it was trained on (huge
# scales overflow to inf); Wan uses 1 to 7.
GUIDANCE_RANGE = (0.0, 100.0)
# |attention_kwargs["scale"]|: ComfyUI's LoRA strength range (a scale like 1e30 fuses inf weights).
LORA_SCALE_LIMIT = 100.0


# --- the checks, in diffusers' order ------------------------------------------------------------

def _refuse_generator(generator: Any) -> None:
  if generator is not None:
    raise ValueError(f"generator={generator!r} is not supported: noise comes from `seed` (video i of "
                     "the batch uses numpy.random.default_rng(seed + i)), so no torch generator maps "
                     "onto it; for diffusers' exact noise pass it as latents, e.g. latents=torch.randn("
                     "shape, generator=torch.Generator().manual_seed(s)) as diffusers' randn_tensor draws it")


def _image_inputs(model: ModelFacts, image: Any, last_image: Any, image_embeds: Any) -> ImageInputs | None:
  """`image_inputs.check_image_inputs` against the model's kind and transformer."""
  t = model.transformer
  return check_image_inputs(image, last_image, image_embeds, image_model=model.image_to_video,
                            image_dim=t.image_dim, flf2v_positions=t.pos_embed_seq_len is not None,
                            first_frame_only=model.expand_timesteps)


def _video_inputs(model: ModelFacts, video: Any, strength: Any, mask: Any, reference_images: Any,
                  conditioning_scale: Any, *, num_frames: int, steps: int, from_latents: bool
                  ) -> tuple[VACEInputs | None, VideoInputs | None]:
  """(VACE's inputs, video-to-video's, also from latents): the video is VACE's on a VACE model."""
  vace = check_vace_inputs(video, mask, reference_images, conditioning_scale, num_frames=num_frames,
                           vace_layers=model.transformer.vace_layers, temporal_factor=model.temporal_factor)
  source = check_video_inputs(None if vace else video, strength, num_frames=num_frames, steps=steps,
                              temporal_factor=model.temporal_factor,
                              video_model=not (model.image_to_video or model.expand_timesteps),
                              from_latents=from_latents and vace is None)
  return vace, source


def _step_cache(model: ModelFacts, step_cache: Any, source: VideoInputs | None) -> Any:
  """The parsed step-cache spec (`step_cache.parse_step_cache`), or None; none with a video."""
  if source is not None and step_cache is not None:
    raise ValueError(f"step_cache={step_cache!r} with a video: the step cache is calibrated for whole "
                     "schedules; leave it out for video-to-video")
  return wan_step_cache.parse_step_cache(step_cache, model=model.name)


def _text_inputs(model: ModelFacts, prompt: Any, negative_prompt: Any, prompt_embeds: Any,
                 negative_prompt_embeds: Any) -> tuple[Any, Any, Any, Any, int]:
  """(prompts, negatives, embeds, negative embeds, B), as diffusers' `check_inputs` allows them."""
  text_dim = model.transformer.text_dim
  if prompt_embeds is not None:
    prompt_embeds = embeds_array("prompt_embeds", prompt_embeds, text_dim)
  if negative_prompt_embeds is not None:
    negative_prompt_embeds = embeds_array("negative_prompt_embeds", negative_prompt_embeds, text_dim)
  if prompt is not None and prompt_embeds is not None:
    raise ValueError("give either prompt or prompt_embeds, not both (prompt_embeds replace the "
                     "encoded prompt; diffusers refuses both too)")
  if negative_prompt is not None and negative_prompt_embeds is not None:
    raise ValueError("give either negative_prompt or negative_prompt_embeds, not both")
  if prompt is None and prompt_embeds is None:
    raise ValueError("prompt=None and prompt_embeds=None: give a prompt (a str or a list of str) or "
                     "prompt_embeds [B, L, text_dim]")
  prompts = None
  if prompt_embeds is not None:
    batch = prompt_embeds.shape[0]
  else:
    prompts = texts(prompt)
    if not prompts:
      raise ValueError(f"prompt must be a str or a non-empty list of str, got {prompt!r}")
    batch = len(prompts)
  negatives = None
  if negative_prompt_embeds is not None:
    if negative_prompt_embeds.shape[0] != batch:
      raise ValueError(f"negative_prompt_embeds holds {negative_prompt_embeds.shape[0]} prompt(s) but the "
                       f"call has {batch}; give one row per prompt (num_videos_per_prompt repeats them)")
  else:
    negatives = texts("" if negative_prompt is None else negative_prompt, batch)
    if negatives is None or len(negatives) != batch:
      raise ValueError(f"negative_prompt must be a str or a list of {batch} str (one per "
                       f"prompt), got {negative_prompt!r}")
  return prompts, negatives, prompt_embeds, negative_prompt_embeds, batch


def _guidance(model: ModelFacts, guidance_scale: Any, guidance_scale_2: Any) -> tuple[float, float]:
  """(g1, g2): the experts' guidance scales; g2 defaults to g1 and needs two experts."""
  g1 = check_number("guidance_scale", guidance_scale, within=GUIDANCE_RANGE, hint=GUIDANCE_HINT)
  if guidance_scale_2 is None:
    return g1, g1
  g2 = check_number("guidance_scale_2", guidance_scale_2, within=GUIDANCE_RANGE, hint=GUIDANCE_HINT)
  if model.boundary_ratio is None:
    raise ValueError(f"{guidance_scale_2=} is only used by two-expert (Wan 2.2) pipelines; this one "
                     "has one transformer: give one guidance scale")
  return g1, g2


def _check_schedule(request: GenerationRequest) -> GenerationRequest:
  """`request`, once its schedule and solver tables are computed (host, numpy) so that a setting that
  makes them singular or non-finite is refused before anything loads, not in the worker or after
  the weights: the sigmas and timesteps finite and non-increasing, every coefficient finite.

  Raises:
    ValueError: naming flow_shift and num_inference_steps (and the custom schedule, when given).
  """
  what = (f"flow_shift={schedulers.flow_shift(request.scheduler):g} with num_inference_steps={request.steps}"
          + (" and the given timesteps / sigmas" if request.timesteps or request.sigmas else ""))
  try:
    schedule = request.schedule()
  except (ValueError, ArithmeticError, np.linalg.LinAlgError) as e:
    raise ValueError(f"{what} gives no usable schedule ({e}); use a flow_shift in [1, 12] or fewer steps") from e
  sigmas = np.asarray(schedule.sigmas, np.float64)
  if not (np.isfinite(sigmas).all() and np.isfinite(np.asarray(schedule.timesteps, np.float64)).all()
          and (np.diff(sigmas) <= 0).all()):
    raise ValueError(f"{what} gives a schedule that is not finite and decreasing (sigmas {sigmas}); use a "
                     "flow_shift in [1, 12]")
  return request


def _size_and_frames(model: ModelFacts, height: Any, width: Any, num_frames: Any, context_frames: Any) -> int:
  """The size checked (first against the model's reach, `ModelFacts.check_reach`: a huge size is too large,
  not offered the nearest multiple of 16) and num_frames rounded to 4k + 1 (`inputs.round_num_frames`),
  warning when a one-size model is asked for another clip (its windows' length with context windows)."""
  windowed = context_frames is not None and is_real(context_frames)
  model.check_reach(height, width, *((context_frames, "context_frames") if windowed else (num_frames, "num_frames")))
  check_size(height, width, model.spatial_factor, model.transformer.patch_size[1])
  num_frames = round_num_frames(num_frames, model.temporal_factor)
  clip = int(context_frames) if windowed else num_frames
  if (note := model.outside_training(int(height), int(width), clip)) is not None:
    warnings.warn(note, stacklevel=3)
  return num_frames


def _check_text_lengths(embeds: np.ndarray | None, negative_embeds: np.ndarray | None, length: int,
                        cfg: bool) -> None:
  """Under CFG, [cond; uncond] run as one batch (one forward per step), so both need the same L;
  diffusers runs them separately, where differing L (each attended in full, no text mask) works."""
  if not cfg:
    return
  given = {name: e.shape[1] for name, e in (("prompt_embeds", embeds), ("negative_prompt_embeds", negative_embeds))
           if e is not None}
  if len(set(given.values()) | ({length} if len(given) < 2 else set())) > 1:
    what = ", ".join(f"{n} L={l}" for n, l in given.items())
    raise ValueError(f"{what} but classifier-free guidance needs the prompt's and the negative "
                     f"prompt's text states at one length (the encoded one is max_sequence_length="
                     f"{length}); pass max_sequence_length equal to the embeds' L, or "
                     "both embeds with the same L")


def _lora_scale(attention_kwargs: Any) -> float | None:
  """`attention_kwargs["scale"]` (the LoRA scale for the call) or None."""
  if attention_kwargs is None:
    return None
  if not isinstance(attention_kwargs, dict):
    raise ValueError(f"attention_kwargs={attention_kwargs!r} must be None or a dict like "
                     f"{{'scale': 0.8}}{not_a(attention_kwargs)}")
  unknown = [k for k in attention_kwargs if k != "scale"]
  if unknown:
    raise ValueError(f"attention_kwargs={attention_kwargs!r}: keys {unknown!r} are not supported; the "
                     "only key is 'scale' (the LoRA scale; diffusers passes other keys to its "
                     "attention processors)")
  if "scale" not in attention_kwargs:
    return None
  scale = attention_kwargs["scale"]
  if not is_real(scale) or not math.isfinite(scale) or abs(scale) > LORA_SCALE_LIMIT:
    raise ValueError(f"attention_kwargs={attention_kwargs!r}: 'scale' must be a finite number in "
                     f"[-{LORA_SCALE_LIMIT:g}, {LORA_SCALE_LIMIT:g}] (the LoRA scale; 1.0 = as loaded; 0: off)"
                     f"{not_a(scale, is_real(scale))}")
  return float(scale)


def _scheduler_record(config: Any) -> dict[str, Any]:
  return dataclasses.asdict(config) | {"class": type(config).__name__}


def _floats(values: Any) -> tuple[float, ...] | None:
  """A checked custom schedule as a tuple of floats (None stays None)."""
  return None if values is None else tuple(float(v) for v in values)


def _listed(values: Any) -> Any:
  """A tuple as a list (JSON's); anything else as it is."""
  return list(values) if isinstance(values, tuple) else values
