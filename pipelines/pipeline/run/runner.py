"""One generation run through, stage by stage: resume state, placement, text, compile, the
denoising loop with its hooks, decode, and the result's settings (`Runner`)."""

from __future__ import annotations

import dataclasses
import sys
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.parallel import distributed
from pipelines.pipeline.run import hooks as loop_hooks, resume as resume_state, text as text_states
from pipelines.pipeline.run.call_options import CallOptions
from pipelines.pipeline.run.callback import StepEndCallback
from pipelines.pipeline.run.ahead import CompileAhead
from pipelines.pipeline.run.decoding import lower_decoder
from pipelines.pipeline.run.loop import LoopState, StepHook, denoise
from pipelines.pipeline.run.memory_plan import plan_memory
from pipelines.pipeline.run.precision import matmul_precision
from pipelines.pipeline.checked.request import GenerationRequest
from pipelines.wan import step_cache as wan_step_cache
from pipelines.wan.vae import effective_compile_effort


@dataclasses.dataclass(frozen=True)
class GenerationResult:
  """What `WanPipeline.run` returns.

  Attributes:
    frames: float32 [B, frames, height, width, 3] in [0, 1]; None when run with `decode=False`.
    latents: float32 [B, C, F, Hl, Wl], the final denoised latents (before de-normalisation).
    timings: seconds: "text_encode", "condition" (image-to-video: the images encoded; ~0 for
      text-to-video), "compile" (0 when cached), "denoise" (all steps),
      "denoise_per_step" (mean), "decode" (with any wait for the decoder's compile-ahead),
      "decode_compile_ahead" (the decoder's programs compiled in a background thread from the text
      encoding on, overlapping it, the step's compile and the loop; 0 when not compiled ahead),
      "total".
    settings: the resolved call (`GenerationRequest.settings`) and what the run found: experts per
      step, steps run, the step resumed from, the step cache's skips.
  """
  frames: np.ndarray | None
  latents: np.ndarray
  timings: dict[str, float]
  settings: dict[str, Any]


class Runner:
  """Runs one `GenerationRequest` on a pipeline (`WanPipeline.generate` makes one per call)."""

  def __init__(self, pipe: Any, request: GenerationRequest, options: CallOptions):
    self.pipe, self.request, self.options = pipe, request, options
    self.timings: dict[str, float] = {}
    self.restored: resume_state.Checkpoint | None = None
    self.writer: resume_state.Writer | None = None
    self.cache_stats = loop_hooks.StepCacheStats()
    self.guidance: dict[int, jax.Array] = {}  # expert -> its scale, placed by `_compile`
    self.programs: dict[int, Any] = {}  # expert -> its compiled step (`_compile`)
    self._text_kv_of: tuple[Any, ...] | None = None  # (expert, weights, text, condition, their TextKV)
    self._decoder_ahead: CompileAhead | None = None
    self.memory: Any = None  # the call's `MemoryPlan` (`_initial_state`)

  def stage(self, text: str) -> None:
    """One line on stderr as a stage starts (when progress is on)."""
    if self.options.progress:
      print(text, file=sys.stderr, flush=True)

  def _enter(self, name: str) -> None:
    """Stage `name` (its `timings` key) starts: `CallOptions.on_stage`."""
    if self.options.on_stage is not None:
      self.options.on_stage(name)

  def run(self) -> Any:
    """The whole generation, under the pipeline dtype's matmul precision (`precision.matmul_precision`:
    float32 weights, full fp32 products on TPU too; the VAE stages under the VAE's); returns a
    `GenerationResult`."""
    with matmul_precision(self.pipe.dtype):
      return self._run()

  def _run(self) -> Any:
    start = time.perf_counter()
    try:
      state = self._initial_state()
      self._compile(state)
      self._enter("denoise")
      denoise(state, self._step, self._hooks(), interrupted=lambda: self.pipe.interrupt)
    except BaseException:  # a failing run does not wait for the decoder's compile (the process's exit does)
      self._decoder_ahead = None
      raise
    self.timings["denoise"] = float(sum(state.step_times))
    self.timings["denoise_per_step"] = float(np.mean(state.step_times)) if state.step_times else 0.0
    frames, latents = self._decode(state)
    self.timings["total"] = time.perf_counter() - start
    resume = self.options.resume
    if (resume is not None and not resume.keep and not self.pipe.interrupt
        and distributed.is_main_process()):
      resume_state.remove(resume.checkpoint_dir)  # kept when a callback stopped the run early
    return _result(frames, latents, self.timings, self._settings(state))

  def _initial_state(self) -> LoopState:
    """Noise, schedule, solver (or the resumed state), weights placed, text encoded, all replicated."""
    r, plan = self.request, self.request.plan
    noise = r.noise()
    self._check_processes_agree(noise)
    schedule = r.schedule()
    state = LoopState(timesteps=schedule.timesteps, experts=r.experts_per_step(schedule.timesteps),
                      latents=noise, solver=schedule.init_state(noise.shape, jnp.float32), text=None)
    self._resume(state, noise)
    self.pipe.weights.place(plan)  # before text encoding: its weights may be sharded too
    decoder = self._lower_decoder(noise.shape)  # lowered once: analysed by the plan, compiled ahead
    self.memory = plan_memory(self.pipe, r, self.pipe.memory_placement, decoder)
    if self.memory.budget is not None or self.memory.forced:
      self.stage(self.memory.line())
    self._decoder_ahead = self._compile_decoder_ahead(decoder)
    self._enter("text_encode")
    start = time.perf_counter()
    texts = (r.prompts or []) + (r.negative_prompts or [])
    self.stage(f"text encode: {len(texts)} prompt(s) x {r.max_sequence_length} tokens" if texts
               else "text encode: none (text states given)")
    text = jax.block_until_ready(self._encode_text())
    self.timings["text_encode"] = time.perf_counter() - start
    self.pipe.weights.restore_vae()  # back after a call that stopped before its decode
    condition = self._condition()
    if self.restored is None:  # video-to-video: the encoded video, noised (a resumed run has its latents)
      state.latents = self._start_latents(noise, schedule.sigmas[0])
    state.latents, state.solver, state.text, state.condition = distributed.put_replicated(
        (state.latents, state.solver, text, condition), plan.replicated)
    state.cache = self._cache()
    if not self.memory.vae_at_denoise:  # the inputs are encoded: the VAE leaves until the decode
      self.pipe.weights.drop_vae()
    return state

  def _encode_text(self) -> Any:
    """The text states (`text_states.text_states`) with the text encoder where the memory plan puts
    it: resident on the device; else only for prompts not encoded before (`pipe.text_cache`), on the
    device (uploaded, dropped after, the transformer off the device meanwhile where the plan says) or
    on the host CPU."""
    r, weights, memory = self.request, self.pipe.weights, self.memory
    if memory.placement == "resident":
      return text_states.text_states(r, self.pipe.encode_prompts, self.pipe.dtype)
    cache = self.pipe.text_cache
    texts = (r.prompts or []) + (r.negative_prompts or [])
    if cache.missing(texts, r.max_sequence_length):
      if not memory.transformer_at_encode:
        weights.drop_experts(range(len(weights.experts)))
      if not memory.vae_at_encode:  # back before the inputs' encode (`_initial_state`)
        weights.drop_vae()
      weights.text_params_on("host" if memory.placement == "encoder-on-host" else "device")
      cache.fill(texts, r.max_sequence_length, self.pipe.encode_prompts)
      weights.drop_text()
    text = text_states.text_states(r, cache.get, self.pipe.dtype)
    return jax.device_put(text, r.plan.replicated)

  def _experts_for(self, expert: int) -> None:
    """`expert`'s weights on the device before its steps (the plan's swapped experts: the other
    one leaves first)."""
    weights = self.pipe.weights
    if self.memory.experts_swapped:
      self._text_kv_of = None
      weights.drop_experts([e for e in range(len(weights.experts)) if e != expert])
      weights.restore_experts([expert])
    else:
      weights.restore_experts(range(len(weights.experts)))

  def _condition(self) -> Any:
    """The step's conditioning beyond the text (`pipe.conditioning(request)`: None for text-to-video;
    for image-to-video the encoded images), timed as "condition"; a VAE stage, so under the VAE
    dtype's matmul precision (`precision.matmul_precision`)."""
    self._enter("condition")
    start = time.perf_counter()
    with matmul_precision(self.pipe.vae.dtype):
      condition = self.pipe.conditioning(self.request, self.stage)
    self.timings["condition"] = time.perf_counter() - start
    return condition

  def _start_latents(self, noise: np.ndarray, sigma: np.float32) -> np.ndarray:
    """`pipe.initial_latents` (the noise, or video-to-video's noised video), timed as "video_encode";
    under the VAE dtype's matmul precision, as `_condition`."""
    start = time.perf_counter()
    with matmul_precision(self.pipe.vae.dtype):
      latents = self.pipe.initial_latents(self.request, noise, sigma, self.stage)
    if latents is not noise:
      self.timings["video_encode"] = time.perf_counter() - start
    return latents

  def _check_processes_agree(self, noise: np.ndarray) -> None:
    """In a multi-process run, every process holds the same model (weights, LoRAs, configs: the
    fingerprint), the same request and noise, and the same given text states (one small
    collective), so no process joins with a stale copy of a file.

    Raises:
      ValueError: naming the processes that differ from process 0 and what differs.
    """
    if jax.process_count() == 1:
      return
    distributed.check_same_settings(
        self._identity(noise),
        what="hold other weights, LoRAs or inputs",
        fix="give every process the same files (a stale copy on one host changes the video)")

  def _identity(self, noise: np.ndarray) -> dict[str, Any]:
    """The request's identity with the model's fingerprint and, when LoRAs are loaded, each
    adapter's name, expert, weight, active flag, layer count and file SHA-256, and the LoRA scale
    and fused flag (a changed LoRA file, weight or set of active adapters is another run)."""
    identity = self.request.identity(self.pipe.fingerprint(), noise)
    info = self.pipe.lora_info()
    if info["adapters"]:
      keep = ("name", "transformer", "weight", "active", "layers", "sha256")
      identity["lora"] = {"scale": info["scale"], "fused": info["fused"],
                          "adapters": [{k: a[k] for k in keep} for a in info["adapters"]]}
    return identity

  def _resume(self, state: LoopState, noise: np.ndarray) -> None:
    """With a `ResumeConfig`: the saved state restored into `state` (resume) or a refusal of a
    checkpoint in the way, and the writer for this run.

    Raises:
      resume.ResumeError: resume without a checkpoint, a checkpoint of another run (naming each
        difference), or a checkpoint in the way of a new run.
    """
    config = self.options.resume
    if config is None:
      return
    identity = self._identity(noise)
    saved = resume_state.read(config.checkpoint_dir)
    if config.resume:
      if saved is None:
        raise resume_state.ResumeError(f"resume=True but {config.checkpoint_dir!r} holds no denoising "
                                       f"checkpoint ({resume_state.STATE_FILE}); run without resume to start over")
      differences = saved.differences(identity)
      if differences:
        raise resume_state.ResumeError(f"the checkpoint in {config.checkpoint_dir!r} is from another run; "
                                       + "; ".join(differences))
      state.latents, state.solver = saved.restore("latents", state.latents), saved.restore("solver", state.solver)
      state.first_step, self.restored = saved.step, saved
      self.stage(f"resume: {saved.step} of {self.request.steps} steps done (checkpoint in {config.checkpoint_dir})")
    elif saved is not None:
      raise resume_state.ResumeError(f"{config.checkpoint_dir!r} already holds a denoising checkpoint (step "
                                     f"{saved.step}); pass resume=True (generate --resume) to continue it, "
                                     "or remove it to start over")
    self.writer = resume_state.Writer(config.checkpoint_dir, identity, enabled=distributed.is_main_process())

  def _cache(self) -> Any:
    """The step cache's initial (or resumed) state, or None without a cache."""
    r, pipe = self.request, self.pipe
    if r.step_cache is None:
      return None
    rows, tokens = cache_rows_tokens(r)
    cache = wan_step_cache.init_state(r.step_cache, rows=rows, tokens=tokens, config=pipe.transformer_config,
                                      dtype=pipe.dtype, steps=r.steps, mesh=r.plan.mesh)
    if self.restored is not None:
      template = wan_step_cache.checkpoint_template(cache, tokens=tokens)
      cache = wan_step_cache.place(self.restored.restore("step_cache", template), cache)
      self.cache_stats.restore(self.restored.arrays.get(loop_hooks.StepCacheStats.CHECKPOINT_KEY))
    return cache

  def _compile(self, state: LoopState) -> None:
    """The compiled step of each expert for this run's shapes (compiled now if new; timed as
    "compile"): one program, or two where one expert runs without its unconditional rows."""
    r, pipe, plan = self.request, self.pipe, self.request.plan
    self._enter("compile")
    start = time.perf_counter()
    compiling = (f"compile: the denoise step ({r.tokens} tokens, {pipe.transformer_config.num_layers} "
                 f"layers, mesh {plan.spec}{', weights sharded' if plan.shard_weights else ''})")
    experts = list(dict.fromkeys(state.experts))
    if experts:
      self._experts_for(experts[0])
    # Each expert's guidance scale float32 [], placed once for the whole loop.
    self.guidance = {e: distributed.put_replicated(np.float32(r.guidance[e]), plan.replicated) for e in experts}
    kinds: dict[bool, int] = {}  # experts of one kind share the program (same shapes): its first expert
    for e in experts:
      kinds.setdefault(r.expert_cfg(e), e)
    compiled = {}
    # The loop's first expert last, so that the text K/V held after compiling is the one step 0 needs.
    for cfg, e in sorted(kinds.items(), key=lambda kind: kind[1] == experts[0]):
      compiled[cfg] = pipe.compiled_steps.get(pipe.weights.experts[e], state.latents, state.solver,
                                              self._text(e, state), self.guidance[e], state.cache,
                                              state.condition, plan=plan, cfg=cfg, windows=r.windows,
                                              on_compile=lambda: self.stage(compiling))
    self.programs = {e: compiled[r.expert_cfg(e)] for e in experts}
    self.timings["compile"] = time.perf_counter() - start

  def _step(self, state: LoopState) -> Any:
    """Step k: the step cache restarts at an expert switch; the expert's program runs on its
    weights (read at each step: a LoRA scale hook may have re-fused them)."""
    k, expert = state.step, state.experts[state.step]
    if k and expert != state.experts[k - 1]:
      if state.cache is not None:
        state.cache = wan_step_cache.reset(state.cache)
      self._experts_for(expert)
    return self.programs[expert](self.pipe.weights.experts[expert], state.latents, state.solver,
                                 self._text(expert, state), self.guidance[expert], state.cache, state.condition)

  def _text(self, expert: int, state: LoopState) -> Any:
    """What the step takes as text: the `TextKV` of `expert`'s weights for the text states (and,
    Wan 2.1 I2V / FLF2V, the condition's image states), computed once and reused while the expert,
    its weights (a LoRA scale re-fuses them), the text states (a callback may replace them) and the
    condition stay the same; only the latest is kept (Wan 2.2's high-noise expert does not come
    back). With `text_kv_once=False`, the text states themselves."""
    text, condition, r = state.text, state.condition, self.request
    cfg = r.expert_cfg(expert)
    rows = text if cfg or not r.cfg else text[:r.videos]  # an expert without guidance: the cond rows
    if not self.options.text_kv_once:
      return rows
    params = self.pipe.weights.experts[expert]
    held = self._text_kv_of
    if (held is None or held[0] != expert or held[1] is not params or held[2] is not text
        or held[3] is not condition):
      image = None if condition is None else condition.image_states(cfg=cfg)
      kv = self.pipe.compiled_steps.text_kv(params, rows, image, plan=r.plan)
      self._text_kv_of = held = (expert, params, text, condition, kv)
    return held[4]

  def _hooks(self) -> list[StepHook]:
    """The loop's hooks, in order: timestep, LoRA scale, step-cache stats, NaN guard, resume writer,
    diffusers' callback, progress bar, on_step, then the caller's."""
    r, o, pipe = self.request, self.options, self.pipe
    hooks: list[StepHook] = [loop_hooks.CurrentTimestep(pipe)]
    if r.lora_scale not in (None, 1.0):
      hooks.append(loop_hooks.CallLoraScale(pipe, r.lora_scale))
    hooks.append(self.cache_stats)
    if o.nan_guard:
      hooks.append(loop_hooks.NanGuard())
    if self.writer is not None:
      hooks.append(loop_hooks.CheckpointSaver(self.writer, o.resume.every, tokens=cache_rows_tokens(r)[1],
                                              mesh=r.plan.mesh, cache_stats=self.cache_stats))
    if o.callback is not None:
      hooks.append(StepEndCallback(pipe, o.callback, o.callback_tensor_inputs, videos=r.videos, cfg=r.cfg,
                                   sharding=r.plan.replicated))
    if o.progress:
      hooks.append(loop_hooks.ProgressBar())
    if o.on_step is not None:
      hooks.append(loop_hooks.OnStep(o.on_step))
    return hooks + list(o.hooks)

  def _lower_decoder(self, latents_shape: tuple[int, ...]) -> dict[str, Any] | None:
    """The whole-frame decoder's programs for latents of `latents_shape` [B, C, F, Hl, Wl], lowered
    here (the caller's thread-local JAX settings apply) to be compiled ahead
    (`CallOptions.decode_compile_ahead`); None when not decoding, with the option off, or when the
    lowering fails (warned; the decode compiles them)."""
    r, o = self.request, self.options
    ahead = o.decode_compile_ahead if o.decode_compile_ahead is not None else jax.default_backend() != "cpu"
    if not (r.decode and ahead):
      return None
    try:
      return lower_decoder(self.pipe.weights, latents_shape, r.plan.decode_mesh, compile_effort=o.decode_compile_effort)
    except Exception as e:  # noqa: BLE001 -- the decode lowers them again and raises there
      warnings.warn(f"the VAE decoder's programs could not be lowered ahead ({type(e).__name__}: {e}); "
                    "they compile at the decode", RuntimeWarning, stacklevel=2)
      return None

  def _compile_decoder_ahead(self, lowered: dict[str, Any] | None) -> CompileAhead | None:
    """`_lower_decoder`'s programs compiled in a background thread while the text is encoded, the
    step compiled and the loop run (at once where the memory plan's analysis compiled them); None
    without them or where the plan decodes otherwise (in bands, or streamed)."""
    if lowered is None or self.memory.decode_band_rows or self.memory.decode_streamed:
      return None
    return CompileAhead(lambda: [program.compile() for program in lowered.values()],
                        on_start=lambda: self._enter("decode_compile_ahead"), name="decoder-compile")

  def _join_decoder_ahead(self) -> None:
    """Waits for the decoder's compile-ahead (if any); its seconds are "decode_compile_ahead"."""
    ahead, self._decoder_ahead = self._decoder_ahead, None
    self.timings["decode_compile_ahead"] = ahead.join() if ahead is not None else 0.0

  def _decode(self, state: LoopState) -> tuple[np.ndarray | None, np.ndarray]:
    """(frames or None, host latents); timed as "decode"."""
    r = self.request
    self._enter("decode")
    start = time.perf_counter()
    self._join_decoder_ahead()
    latents = state.latents
    if state.condition is not None:  # TI2V: the image's latents replace the first frame once more
      latents = state.condition.final_latents(latents)
    latents = distributed.to_host(latents)
    frames = None
    if r.decode:
      if not self.memory.transformer_at_decode:
        self._text_kv_of = None
        self.pipe.weights.drop_experts(range(len(self.pipe.weights.experts)))
      self.pipe.weights.restore_vae()
      bands = self.memory.decode_band_rows
      self.stage(f"decode: {r.videos} video(s) of {r.num_frames} frames {r.width}x{r.height} (VAE"
                 + (f", in bands of {bands} latent rows)" if bands else ")"))
      frames = self.pipe.decode(latents, mesh=r.plan.decode_mesh, compile_effort=self.options.decode_compile_effort,
                                band_rows=bands, streamed=self.memory.decode_streamed)
    self.timings["decode"] = time.perf_counter() - start
    return frames, latents

  def _settings(self, state: LoopState) -> dict[str, Any]:
    r = self.request
    cache = None
    if r.step_cache is not None:
      cache = wan_step_cache.summary(r.step_cache, self.cache_stats.record(),
                                     num_layers=self.pipe.transformer_config.num_layers)
    resume = self.options.resume
    return {**r.settings(), "experts_per_step": state.experts,
            "resumed_from_step": state.first_step if resume is not None and resume.resume else None,
            "steps_run": len(state.step_times), "step_cache": cache, "memory_plan": self.memory.line(),
            "vae_dtype": jax.numpy.dtype(self.pipe.vae.dtype).name,
            "decode_compile_effort": effective_compile_effort(self.options.decode_compile_effort,
                                                               jax.default_backend())}


def cache_rows_tokens(r: GenerationRequest) -> tuple[int, int]:
  """(rows, tokens) of the step cache's residuals: one forward's (`r.rows`, `r.tokens`), or with
  context windows every round's windows' rows and one window's tokens (`step_cache.cached_windows`)."""
  if r.windows is None:
    return r.rows, r.tokens
  starts, _ = r.windows.rounds(r.plan.windows)
  window = (*r.latent_shape[:2], r.windows.length, *r.latent_shape[3:])
  return starts.size * r.rows, r.model.tokens(window)


def _result(frames: Any, latents: Any, timings: dict[str, float], settings: dict[str, Any]) -> Any:
  return GenerationResult(frames=frames, latents=latents, timings=timings, settings=settings)
