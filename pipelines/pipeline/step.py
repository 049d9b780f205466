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

from attention.mesh import CFG_AXIS
from pipelines.parallel.plan import ParallelPlan
from pipelines.wan import step_cache as wan_step_cache, ti2v
from pipelines.wan.transformer import forward


def denoise_step(graphdef: nnx.GraphDef, params: nnx.State, latents: jax.Array, solver: Any,
                 text: jax.Array, guidance: jax.Array, cache: Any = None, condition: jax.Array | None = None,
                 *, plan: ParallelPlan, cfg: bool, expand_timesteps: bool = False):
  """One denoising step: transformer on [cond; uncond], guidance mix, scheduler step.

  Args:
    graphdef, params: `nnx.split` of a `WanTransformer` (static graph, array state).
    latents: float32 [B, C, F, Hl, Wl] (donated).
    solver: `UniPCState` or `FlowEulerState` (donated).
    text: [2B, L, text_dim] (cond rows, then uncond rows) under CFG, else [B, L, text_dim].
    guidance: float32 [] scale of this step's expert.
    cache: None (no step cache: the plain transformer forward) or the step-cache state
      (`step_cache.FirstBlockState` / `MagState`; donated). One skip decision covers the cond and
      uncond rows.
    plan: where it runs (static): the mesh, the attention path and backend, weight sharding. With
      CFG=2 the cond rows run on the first half of the devices and the uncond rows on the second,
      each half running the whole USP schedule; the guidance mix then brings the two noise
      predictions together (one exchange of the noise-prediction size per step).
    cfg: classifier-free guidance on (static).
    condition: None, or (TI2V image-to-video) float32 [B, C, 1, Hl, Wl] the normalised image
      latents, the first frame of the transformer's input.
    expand_timesteps: (static) one timestep per token (TI2V): 0 on the first frame's tokens with a
      `condition`, else t (`wan.ti2v.per_token_timesteps`).

  Returns:
    (latents float32 [B, C, F, Hl, Wl], new solver state, bool [] all latents finite, new cache
    state, cache stats). The flag is one reduction in the same program, so the NaN guard costs no
    extra dispatch. Without a cache the last two are None; with one, the stats are
    {"skipped": bool [], "metric": float32 []} (`step_cache.cached_forward`).

  The math is diffusers' `WanPipeline.__call__` loop body: `noise_pred = uncond + g * (cond -
  uncond)`, then `scheduler.step`.
  """
  model = nnx.merge(graphdef, params)
  x, timestep = _transformer_inputs(model, latents, solver, condition, cfg, expand_timesteps)
  stats = None
  if cache is None:
    noise = forward(model, x, timestep, text, plan)  # model dtype
  else:
    noise, cache, stats = wan_step_cache.cached_forward(model, x, timestep, text, cache, plan)
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


def _transformer_inputs(model: Any, latents: jax.Array, solver: Any, condition: jax.Array | None, cfg: bool,
                        expand_timesteps: bool) -> tuple[jax.Array, jax.Array]:
  """(latents [B or 2B, C, F, Hl, Wl] in the model dtype, timestep [B or 2B] or per token [.., T])."""
  x = ti2v.model_input(latents, condition).astype(model.dtype)  # diffusers: .to(transformer_dtype)
  if cfg:
    x = jnp.concatenate([x, x], axis=0)
  timestep = jnp.broadcast_to(solver.timestep(), (x.shape[0],))
  if expand_timesteps:
    timestep = ti2v.per_token_timesteps(timestep, x.shape, model.config.patch_size, image=condition is not None)
  return x, timestep


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


_denoise_step_jit = jax.jit(denoise_step, static_argnums=0, static_argnames=("plan", "cfg", "expand_timesteps"),
                            donate_argnames=("latents", "solver", "cache"))


class CompiledSteps:
  """The compiled denoise steps of one pipeline, one per (plan, guidance on, argument shapes,
  dtypes and shardings); both experts of a Wan 2.2 pipeline share them (same graph, same shapes:
  the weights are arguments).

  Attributes:
    traces: how many step programs this object has traced and compiled (tests assert one per
      shape: a repeated call compiles nothing).
  """

  def __init__(self, graphdef: nnx.GraphDef):
    self.graphdef = graphdef
    self.traces = 0
    self._programs: dict[Any, Any] = {}

  def get(self, params: nnx.State, latents: jax.Array, solver: Any, text: jax.Array, guidance: jax.Array,
          cache: Any, condition: jax.Array | None = None, *, plan: ParallelPlan, cfg: bool,
          expand_timesteps: bool = False, on_compile: Callable[[], None] | None = None) -> Any:
    """The compiled `denoise_step` for these arguments (compiled on the first request; `on_compile()`
    is called just before a compile). Call it as `program(params, latents, solver, text, guidance,
    cache, condition)` (`condition` may be left out when None)."""
    args = (params, latents, solver, text, guidance, cache, condition)
    leaves, treedef = jax.tree.flatten(args)
    key = (plan, cfg, expand_timesteps, treedef, tuple((x.shape, x.dtype, x.sharding) for x in leaves))
    if key not in self._programs:
      if on_compile is not None:
        on_compile()
      self.traces += 1
      self._programs[key] = _denoise_step_jit.lower(self.graphdef, *args, plan=plan, cfg=cfg,
                                                    expand_timesteps=expand_timesteps).compile()
    return self._programs[key]

  def programs(self) -> list[Any]:
    """The compiled programs, oldest first (e.g. to read one's HLO with `as_text()`)."""
    return list(self._programs.values())

  def clear(self) -> None:
    """Forgets every compiled program (the next call compiles again)."""
    self._programs.clear()
