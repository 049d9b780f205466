"""The jitted denoise step and the object that keeps its compiled programs.

Glossary (DESIGN.md section 1): B videos, C latent channels, F / Hl / Wl latent frames / height /
width, L text tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from attention.mesh import CFG_AXIS, batch_axis
from pipelines.parallel.plan import ParallelPlan
from pipelines.wan import conditioning, step_cache as wan_step_cache
from pipelines.wan.transformer import TextKV, forward, text_kv


def denoise_step(graphdef: nnx.GraphDef, params: nnx.State, latents: jax.Array, solver: Any,
                 text: jax.Array, guidance: jax.Array, cache: Any = None, condition: Any = None, *,
                 plan: ParallelPlan, cfg: bool, windows: conditioning.ContextWindows | None = None):
  """One denoising step: transformer on [cond; uncond], guidance mix, scheduler step.

  Args:
    graphdef, params: `nnx.split` of a `WanTransformer` (static graph, array state).
    latents: float32 [B, C, F, Hl, Wl] (donated).
    solver: `UniPCState`, `FlowEulerState` or `DPMSolverState` (donated).
    text: this expert's text K/V (`TextKV` [Z, 2B or B, L, N, H], `CompiledSteps.text_kv`: once per
      prompt; Wan 2.1 I2V: with the image's, which replace the condition's image states), or text
      states [2B or B, L, text_dim] (cond rows first; K/V then made in the step).
    guidance: float32 [] scale of this step's expert.
    cache: None (no step cache: the plain transformer forward) or the step-cache state
      (`step_cache.forward.FirstBlockState` / `MagState`; donated). One skip decision covers the cond and
      uncond rows.
    condition: None (text-to-video) or a pytree whose `transformer_inputs(x, timestep, cfg=cfg)`
      gives the transformer's `StepInputs` (latents, timestep, image states, VACE context):
      `ImageConditioning`, TI2V's `TI2VConditioning` (first frame, per-token timesteps) or
      `VACEConditioning`; a new one is a new such class.
    plan: where it runs (static): the mesh, the attention path and backend, weight sharding. With
      CFG=2 the cond rows run on the first half of the devices and the uncond rows on the second,
      each half running the whole USP schedule; the guidance mix then brings the two noise
      predictions together (one exchange of the noise-prediction size per step).
    cfg: classifier-free guidance on (static).
    windows: None (one clip), or the context windows (static; `wan.conditioning.windows`): the
      transformer runs on every window of the video, `plan.windows` at once (`_windowed_noise`),
      and the blended noise prediction goes through the guidance mix and the scheduler as one.

  Returns:
    (latents float32 [B, C, F, Hl, Wl], new solver state, bool [] all latents finite, new cache
    state, cache stats). The flag is one reduction in the same program, so the NaN guard costs no
    extra dispatch. Without a cache the last two are None; with one, the stats are
    {"skipped": bool [], "metric": float32 []} (`step_cache.cached_forward`).

  The math is diffusers' `WanPipeline.__call__` loop body: `noise_pred = uncond + g * (cond - uncond)`,
  then `scheduler.step`.
  """
  model = nnx.merge(graphdef, params)
  x = latents.astype(model.dtype)  # diffusers: latents.to(transformer_dtype)
  inputs = _transformer_inputs(x, solver.timestep(), text, condition, cfg=cfg)
  noise, cache, stats = (_noise_prediction(model, inputs, text, cache, plan) if windows is None else  # model dtype
                         _windowed_noise(model, inputs, text, cache, plan, windows,
                                         outer=2 if cfg and plan.cfg_parallel else 1))
  if cfg and plan.cfg_parallel:
    noise = _cfg_parallel_mix(noise, guidance, plan.mesh)
  elif cfg:
    noise = guidance_mix(*jnp.split(noise, 2, axis=0), guidance)
  new_latents, solver = solver.step(noise, latents)
  # Euler returns the model dtype (as diffusers); fp32 holds those values exactly and keeps one
  # signature for every step.
  new_latents = new_latents.astype(latents.dtype)
  out = (new_latents, solver, jnp.isfinite(new_latents).all())
  if plan.mesh is not None:
    # Pin the carried state to the replicated layout it came in with: otherwise GSPMD may hand it
    # back sharded and the next call of this compiled step rejects its own output.
    out = jax.lax.with_sharding_constraint(out, NamedSharding(plan.mesh, P()))
  if cache is not None:
    cache = wan_step_cache.constrain(cache, plan.mesh)  # residuals sequence-sharded, scalars replicated
  return (*out, cache, stats)


def _noise_prediction(model: Any, inputs: conditioning.StepInputs, text: Any, cache: Any, plan: ParallelPlan
                      ) -> tuple[jax.Array, Any, Any]:
  """(noise prediction in the model dtype, new cache state, cache stats): the plain forward (no
  cache: None, None) or the step cache's (`step_cache.cached_forward`)."""
  control = dict(control_hidden_states=inputs.control, control_hidden_states_scale=inputs.control_scale)
  if cache is None:
    return forward(model, inputs.latents, inputs.timestep, text, plan, inputs.image, **control), None, None
  return wan_step_cache.cached_forward(model, inputs.latents, inputs.timestep, text, cache, plan, inputs.image,
                                       **control)


def _windowed_noise(model: Any, inputs: conditioning.StepInputs, text: Any, cache: Any, plan: ParallelPlan,
                    windows: conditioning.ContextWindows, *, outer: int) -> tuple[jax.Array, Any, Any]:
  """(the whole video's noise prediction [R', C, F, Hl, Wl] in the model dtype, new cache state,
  cache stats) from its context windows:
  a scan over rounds of G = `plan.windows` windows, each round one forward of [outer x G x inner]
  rows (every (cfg, windows) device group one window's), then `conditioning.blend` (one all-reduce
  over the windows axis when G > 1). With a step cache, one skip decision covers every window
  (`step_cache.cached_windows`), its statistics over the windows, not the last round's padding copies.

  Args:
    inputs: the whole video's `StepInputs` (rows [R'], frames F).
    cache: None, or the step cache's state over every round's rows.
    outer: 2 when the guidance halves run on separate device groups (CFG=2), else 1.
  """
  groups = plan.windows
  starts, _ = windows.rounds(groups)
  text = conditioning.tile_text(text, groups, outer)

  def window_inputs(starts_G):
    x = conditioning.window_inputs(inputs, starts_G, windows.length, outer)
    return dict(latents=x.latents, timestep=x.timestep, encoder_hidden_states=text,
                encoder_hidden_states_image=x.image)

  def finish(noise):
    if groups > 1:  # each group keeps its window's rows (no gather of every window's to every device)
      noise = jax.lax.with_sharding_constraint(noise, NamedSharding(plan.mesh, P(batch_axis(plan.mesh))))
    return noise

  if cache is not None:
    real = conditioning.real_rows(windows, groups, outer, inputs.latents.shape[0])  # padding copies count in no stat
    noise, cache, stats = wan_step_cache.cached_windows(model, cache, jnp.asarray(starts), real, window_inputs, plan,
                                                        finish)
  else:
    def body(carry, starts_G):
      x = window_inputs(starts_G)
      return carry, finish(forward(model, x["latents"], x["timestep"], text, plan, x["encoder_hidden_states_image"]))

    _, noise = jax.lax.scan(body, None, jnp.asarray(starts))
    stats = None
  return conditioning.blend(noise, windows, groups, outer, plan.mesh if groups > 1 else None), cache, stats


def _transformer_inputs(x: jax.Array, timestep: jax.Array, text: Any, condition: Any, *, cfg: bool
                        ) -> conditioning.StepInputs:
  """The `StepInputs` the transformer sees (latents [B or 2B, ...], timestep [B or 2B] or per token,
  image states, VACE context): x doubled to [cond; uncond] under CFG, then the condition's inputs;
  no image states when the text K/V hold the image's (computed once before the loop)."""
  if cfg:
    x = jnp.concatenate([x, x], axis=0)
  timestep = jnp.broadcast_to(timestep, (x.shape[0],))
  if condition is None:
    return conditioning.StepInputs(x, timestep)
  inputs = condition.transformer_inputs(x, timestep, cfg=cfg)
  return inputs._replace(image=None) if isinstance(text, TextKV) and text.has_image else inputs


def guidance_mix(cond: jax.Array, uncond: jax.Array, guidance: jax.Array) -> jax.Array:
  """uncond + g * (cond - uncond), as diffusers: torch's scalar * tensor computes in fp32
  ("opmath") and rounds once to the tensor dtype.

  Args:
    cond, uncond: [B, C, F, Hl, Wl] noise predictions in the model dtype.
    guidance: float32 [].
  """
  return uncond + (guidance * (cond - uncond).astype(jnp.float32)).astype(cond.dtype)


def _cfg_parallel_mix(noise: jax.Array, guidance: jax.Array, mesh: Mesh) -> jax.Array:
  """The guidance mix when the cond rows live on the cfg axis' first half of the devices and the
  uncond rows on its second: each device swaps its half of the noise prediction with its partner
  in the other half (one collective-permute over "cfg" of the noise-prediction size) and both
  compute the same mix, replicated.

  Args:
    noise: [2B, C, F, Hl, Wl] (cond rows, then uncond rows), batch split over "cfg".
    guidance: float32 [].

  Returns:
    [B, C, F, Hl, Wl] in noise's dtype, replicated over the mesh.
  """
  def body(half, g):
    other = jax.lax.ppermute(half, CFG_AXIS, [(0, 1), (1, 0)])
    first = jax.lax.axis_index(CFG_AXIS) == 0
    return guidance_mix(jnp.where(first, half, other), jnp.where(first, other, half), g)

  noise = jax.lax.with_sharding_constraint(noise, NamedSharding(mesh, P(CFG_AXIS)))
  return jax.shard_map(body, mesh=mesh, in_specs=(P(CFG_AXIS), P()), out_specs=P(),
                       check_vma=False)(noise, guidance)


def text_kv_states(graphdef: nnx.GraphDef, params: nnx.State, text: jax.Array, image: jax.Array | None = None,
                   *, plan: ParallelPlan) -> TextKV:
  """The text's (and image's) cross-attention K/V of every block for these weights (`transformer.text_kv`).

  Args:
    graphdef, params: `nnx.split` of a `WanTransformer`.
    text: [B or 2B, L, text_dim] text states (the step's rows).
    image: the step's CLIP image states ([B or 2B, J, I]; FLF2V two rows a video; the condition's
      `image_states(cfg=...)`) for Wan 2.1 I2V / FLF2V, else None.
    plan: where it runs (static).

  Returns:
    `TextKV` [Z, B or 2B, L, N, H] (and the image's [Z, B or 2B, P, N, H]) in the model dtype, laid
    out as the step reads it.
  """
  return text_kv(nnx.merge(graphdef, params), text, plan, image)


_denoise_step_jit = jax.jit(denoise_step, static_argnums=0, static_argnames=("plan", "cfg", "windows"),
                            donate_argnames=("latents", "solver", "cache"))
_text_kv_jit = jax.jit(text_kv_states, static_argnums=0, static_argnames=("plan",))


class CompiledSteps:
  """The compiled denoise steps of one pipeline, one per (plan, guidance on, argument shapes,
  dtypes and shardings, JAX's matmul precision in effect: `jax.default_matmul_precision(...)` is
  part of what a program computes); both experts of a Wan 2.2 pipeline share them (same graph,
  same shapes: the weights are arguments).

  Attributes:
    traces: how many step programs this object has traced and compiled (tests assert one per
      shape: a repeated call compiles nothing).
  """

  def __init__(self, graphdef: nnx.GraphDef):
    self.graphdef = graphdef
    self.traces = 0
    self._programs: dict[Any, Any] = {}
    self._shapes: dict[Any, Any] = {}  # program key -> (plan, latents' shape)
    self._temp_bytes: dict[Any, int | None] = {}  # program key -> its temporaries, once asked (`temp_bytes`)

  def get(self, params: nnx.State, latents: jax.Array, solver: Any, text: jax.Array, guidance: jax.Array,
          cache: Any, condition: Any = None, *, plan: ParallelPlan, cfg: bool,
          windows: conditioning.ContextWindows | None = None, on_compile: Callable[[], None] | None = None) -> Any:
    """The compiled `denoise_step` for these arguments (compiled on the first request; `on_compile()`
    is called just before a compile). Call it as `program(params, latents, solver, text, guidance,
    cache, condition)`."""
    args = (params, latents, solver, text, guidance, cache, condition)
    leaves, treedef = jax.tree.flatten(args)
    key = (plan, cfg, windows, treedef, tuple((x.shape, x.dtype, x.sharding) for x in leaves),
           jax.config.jax_default_matmul_precision)  # the caller's thread's, as jit's own cache keys it
    if key not in self._programs:
      if on_compile is not None:
        on_compile()
      self.traces += 1
      program = _denoise_step_jit.lower(self.graphdef, *args, plan=plan, cfg=cfg, windows=windows).compile()
      self._programs[key] = program
      self._shapes[key] = (plan, tuple(latents.shape))
    return self._programs[key]

  def temp_bytes(self, plan: ParallelPlan, latent_shape: tuple[int, ...]) -> int | None:
    """XLA's temporaries per device (`memory_analysis().temp_size_in_bytes`) of the largest step this
    object compiled for `plan` and latents of `latent_shape`, or None when none is compiled yet.
    Analysed when first asked (not at every compile), then kept."""
    shape_key = (plan, tuple(latent_shape))
    for key, program in self._programs.items():
      if self._shapes.get(key) == shape_key and key not in self._temp_bytes:
        analysis = program.memory_analysis()
        self._temp_bytes[key] = None if analysis is None else int(analysis.temp_size_in_bytes)
    found = [b for key, b in self._temp_bytes.items() if self._shapes.get(key) == shape_key and b is not None]
    return max(found) if found else None

  def text_kv(self, params: nnx.State, text: jax.Array, image: jax.Array | None = None, *,
              plan: ParallelPlan) -> TextKV:
    """`text_kv_states` for these weights, text and image states (compiled once per shape and plan)."""
    return _text_kv_jit(self.graphdef, params, text, image, plan=plan)

  def programs(self) -> list[Any]:
    """The compiled programs, oldest first (e.g. to read one's HLO with `as_text()`)."""
    return list(self._programs.values())

  def clear(self) -> None:
    """Forgets every compiled program (the next call compiles again)."""
    self._programs.clear()
    self._shapes.clear()
    self._temp_bytes.clear()
