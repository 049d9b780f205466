"""Step caching for the denoise loop: first-block residual cache and MagCache, mesh-uniform.

Glossary (DESIGN.md section 1): B rows of the transformer batch (2 x videos under classifier-free
guidance: cond and uncond rows run in one forward), T video tokens (padded to a multiple of U * R
under a mesh, `SequenceLayout.padded_tokens`), D model width, Z blocks, S denoising steps.

Two methods, each a decision per denoising step on whether to run the transformer's blocks or to
reuse a residual cached at the last step that ran them ("full step"):

- "first-block:THRESH": first-block cache (ParaAttention's "First Block Cache", diffusers
  `hooks/first_block_cache.py` `FirstBlockCacheConfig`, xDiT's FBCache). Block 0 always runs; its
  residual r = x_1 - x_0 (output minus input of block 0) is compared with r_prev, the one of the
  last full step: relative L1 change = mean|r - r_prev| / mean|r_prev| over every valid token of
  every row. Below THRESH (strictly), blocks 1..Z-1 are skipped and their output is x_1 + c, where
  c = x_Z - x_1 was cached at the last full step; otherwise they run and r_prev, c are refreshed
  (r_prev only then, as diffusers). The first step always runs.
- "mag:THRESH[:K][@FILE]": MagCache (Ma et al. 2025, "MagCache: Fast Video Generation with
  Magnitude-Aware Cache", arXiv:2506.09045; diffusers `hooks/mag_cache.py` `MagCacheConfig`).
  A calibration gives per-step magnitude ratios gamma_s = mean over tokens of
  ||R_s|| / ||R_{s-1}|| of the whole-transformer residual R = x_Z - x_0 (`calibrate_ratios`;
  `python -m end_to_end.train.calibrate_cache` recomputes them). After the first `retention` fraction of
  steps (0.2, diffusers' default), each step multiplies an accumulated ratio by gamma_s, adds
  |1 - accumulated ratio| to an accumulated error and counts a consecutive step; while the error
  is below THRESH (strictly) and the count is <= K (default 3, diffusers' `max_skip_steps`) every
  block is skipped and the blocks' output is x_0 + R cached at the last full step; otherwise all
  blocks run, R is refreshed and the accumulators restart. Ratios calibrated for another step count
  are resampled by nearest index (diffusers' `nearest_interp`). Without @FILE the ratios shipped
  for the embedded tiny model are used (`TINY_RATIOS_FILE`); any other model needs @FILE.

Mesh-uniform decision: every statistic is a sum over the whole (sequence-sharded) tensor with the
padded token rows masked out, so under a mesh it is reduced over all devices and every device holds
the same scalar; the skip is a `lax.cond` on that scalar, so every device takes the same branch
(and the collectives inside the blocks stay matched). One decision covers all B rows (cond and
uncond alike). MagCache's decision uses only the carried accumulators and the step's ratio.

The cache state (`FirstBlockState`, `MagState`) is a pytree of arrays carried through the jitted
`pipelines.pipeline.run.step.denoise_step` and donated like the solver state: residuals [B, T, D] in the
model dtype, sequence-sharded under a mesh; scalars replicated. The threshold and the MagCache
settings are arrays in the state, so a new threshold does not recompile the step.

The settings (`StepCacheSpec`, `parse_step_cache`, MagCache's ratios, `summary`) live in
`spec` (the `step_cache` package names them).
"""


from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from attention.mesh import sequence_spec
from pipelines.parallel.plan import ParallelPlan
from pipelines.wan.transformer import model as wan_transformer, padded_tokens
from pipelines.wan.step_cache.spec import (StepCacheSpec, nearest_interp)


# --- the carried state -------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FirstBlockState:
  """First-block cache state (every field an array; carried through `denoise_step`).

  Attributes:
    head_residual: [B, T, D] model dtype, block 0's residual x_1 - x_0 at the last full step.
    tail_residual: [B, T, D] model dtype, x_Z - x_1 at the last full step.
    valid: bool [], a full step has run (False until the first one, and after `reset`).
    threshold: float32 [].
  """
  head_residual: jax.Array
  tail_residual: jax.Array
  valid: jax.Array
  threshold: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MagState:
  """MagCache state (every field an array; carried through `denoise_step`).

  Attributes:
    residual: [B, T, D] model dtype, x_Z - x_0 at the last full step.
    valid: bool [], a full step has run.
    step: int32 [], index of the next denoising step.
    acc_ratio, acc_err: float32 [], accumulated magnitude ratio and error since the last full step.
    acc_steps: int32 [], steps accumulated since the last full step.
    ratios: float32 [S], calibrated ratios resampled to this run's S steps.
    threshold: float32 []; max_skips: int32 [] (K); retention_steps: int32 [], the first steps
      that always run.
  """
  residual: jax.Array
  valid: jax.Array
  step: jax.Array
  acc_ratio: jax.Array
  acc_err: jax.Array
  acc_steps: jax.Array
  ratios: jax.Array
  threshold: jax.Array
  max_skips: jax.Array
  retention_steps: jax.Array


State = FirstBlockState | MagState


def _shardings(state: State, mesh: Mesh | None) -> State:
  """The layout of a state: [B, T, D] residuals sequence-sharded, the rest replicated."""
  if mesh is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: one, state)
  return jax.tree.map(lambda x: NamedSharding(mesh, sequence_spec(mesh) if x.ndim == 3 else P()), state)


def init_state(spec: StepCacheSpec, *, rows: int, tokens: int, config: Any, dtype: Any, steps: int,
               mesh: Mesh | None) -> State:
  """The cache state before step 0, on the call's devices (also across processes).

  Args:
    spec: the parsed setting.
    rows: B, transformer batch rows (2 x videos under CFG).
    tokens: valid video tokens per row (padded here as the transformer pads them under `mesh`).
    config: the transformer's `WanTransformerConfig` (D).
    dtype: the model dtype (of the residuals).
    steps: S, denoising steps of the run (MagCache's ratios are resampled to it).
    mesh: None or the (cfg, ring, ulysses) mesh.

  Returns:
    `FirstBlockState` or `MagState` with zero residuals and valid False; residuals [B, T, D]
    sequence-sharded under a mesh, everything else replicated.
  """
  padded = padded_tokens(mesh, tokens)
  shape = (rows, padded, config.dim)

  def build():
    zeros = jnp.zeros(shape, dtype)
    threshold = jnp.float32(spec.threshold)
    if spec.method == "first-block":
      return FirstBlockState(head_residual=zeros, tail_residual=zeros, valid=jnp.bool_(False),
                             threshold=threshold)
    return MagState(residual=zeros, valid=jnp.bool_(False), step=jnp.int32(0), acc_ratio=jnp.float32(1),
                    acc_err=jnp.float32(0), acc_steps=jnp.int32(0),
                    ratios=jnp.asarray(nearest_interp(spec.ratios, steps)), threshold=threshold,
                    max_skips=jnp.int32(spec.max_skips),
                    retention_steps=jnp.int32(int(spec.retention * steps + 0.5)))

  abstract = jax.eval_shape(build)
  return jax.jit(build, out_shardings=_shardings(abstract, mesh))()


def for_checkpoint(state: State, *, tokens: int, mesh: Mesh | None) -> State:
  """The state as a denoising checkpoint (`pipelines.pipeline.run.resume.Writer`) takes it: residuals cut to the
  `tokens` valid token rows (the mesh padding differs between meshes; a run may resume on another
  one) and every array replicated over the mesh. A new copy; `state` is unchanged."""
  sharding = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if mesh is None
              else NamedSharding(mesh, P()))
  return _checkpoint_cut(tokens, sharding)(state)


@functools.lru_cache(maxsize=16)
def _checkpoint_cut(tokens: int, sharding: Any) -> Callable[[State], State]:
  """The jitted cut of `for_checkpoint`, one per (tokens, sharding): built once, so saving after
  every step compiles nothing new."""
  def cut(s):
    return jax.tree.map(lambda x: x[:, :tokens] if x.ndim == 3 else x, s)
  return jax.jit(cut, out_shardings=sharding)


def checkpoint_template(state: State, *, tokens: int) -> State:
  """Shapes and dtypes (`jax.ShapeDtypeStruct`) of `for_checkpoint(state)`, for
  `Checkpoint.restore`."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0], tokens, *x.shape[2:]) if x.ndim == 3
                                                     else x.shape, x.dtype), state)


def place(host_state: State, like: State) -> State:
  """A state of host (numpy) arrays as `for_checkpoint` wrote it, put on `like`'s devices with
  `like`'s shapes (residuals zero-padded to its padded token count: padded rows never reach the
  output, the statistics or a valid key) and shardings, also across processes (each fills its own
  devices from its own copy)."""
  def put(host, leaf):
    host = np.asarray(host)
    if host.ndim == 3:
      host = np.pad(host, ((0, 0), (0, leaf.shape[1] - host.shape[1]), (0, 0)))
    return jax.make_array_from_callback(host.shape, leaf.sharding, lambda index: host[index])
  return jax.tree.map(put, host_state, like)


def constrain(state: State, mesh: Mesh | None) -> State:
  """Pins a state returned by the jitted step to the layout `init_state` gave it (a no-op without a
  mesh), so that the compiled step accepts its own output on the next call."""
  if mesh is None:
    return state
  return jax.lax.with_sharding_constraint(state, _shardings(state, mesh))


def reset(state: State) -> State:
  """The state with no full step behind it (valid False, MagCache accumulators restarted; the step
  counter kept): for an expert switch (Wan 2.2), whose residuals the other expert cannot reuse.
  Keeps every array's sharding."""
  def fn(s):
    s = dataclasses.replace(s, valid=jnp.zeros_like(s.valid))
    if isinstance(s, MagState):
      s = dataclasses.replace(s, acc_ratio=jnp.ones_like(s.acc_ratio), acc_err=jnp.zeros_like(s.acc_err),
                              acc_steps=jnp.zeros_like(s.acc_steps))
    return s
  return jax.jit(fn, out_shardings=jax.tree.map(lambda x: x.sharding, state))(state)


# --- the cached forward --------------------------------------------------------------------------------

def _valid_sum(x_BTD: jax.Array, tokens: int, rows_B: Any = None) -> jax.Array:
  """float32 [] sum of x over the counted rows (`rows_B`: bool [B]; None: every row) and the first
  `tokens` (valid) token rows; under a mesh a global reduction (every device gets the same value)."""
  valid = (jnp.arange(x_BTD.shape[1]) < tokens)[None, :, None]
  if rows_B is not None:
    valid = valid & jnp.asarray(rows_B, bool)[:, None, None]
  return jnp.sum(jnp.where(valid, x_BTD.astype(jnp.float32), 0.0))


def l1_parts(r_BTD: jax.Array, prev_BTD: jax.Array, tokens: int, rows_B: Any = None) -> jax.Array:
  """float32 [2]: (sum|r - prev|, sum|prev|) over the valid tokens of the counted rows (`rows_B`:
  bool [B], e.g. not a context window's padding copy; None: every row), the two sums of
  `relative_change` (summed over several forwards for one decision over all of them)."""
  prev = prev_BTD.astype(jnp.float32)
  return jnp.stack([_valid_sum(jnp.abs(r_BTD.astype(jnp.float32) - prev), tokens, rows_B),
                    _valid_sum(jnp.abs(prev), tokens, rows_B)])


def relative_change(num: jax.Array, den: jax.Array) -> jax.Array:
  """float32 [] mean|r - prev| / mean|prev| from `l1_parts`' sums (diffusers'
  `FBCHeadBlockHook._should_compute_remaining_blocks`); +inf when prev is all zero."""
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.inf)


def _magnitude_parts(r_BTD: jax.Array, prev_BTD: jax.Array, tokens: int, rows_B: Any = None) -> jax.Array:
  """float32 [2]: (sum, count) over the valid tokens of the counted rows (`rows_B` as `l1_parts`') of
  ||r_t|| / (||prev_t|| + 1e-8), norms over D; sum / count is their mean (diffusers'
  `MagCacheBlockHook._perform_calibration_step`), and sums over several forwards give one mean."""
  norm = jnp.linalg.norm(r_BTD.astype(jnp.float32), axis=-1, keepdims=True)
  prev = jnp.linalg.norm(prev_BTD.astype(jnp.float32), axis=-1, keepdims=True)
  rows = r_BTD.shape[0] if rows_B is None else jnp.sum(jnp.asarray(rows_B, jnp.float32))
  return jnp.stack([_valid_sum(norm / (prev + 1e-8), tokens, rows_B), jnp.asarray(rows * tokens, jnp.float32)])


def cached_forward(model: wan_transformer.WanTransformer, latents: jax.Array, timestep: jax.Array,
                   encoder_hidden_states: jax.Array, state: State,
                   plan: ParallelPlan | None = None, encoder_hidden_states_image: jax.Array | None = None, *,
                   control_hidden_states: jax.Array | None = None,
                   control_hidden_states_scale: jax.Array | None = None
                   ) -> tuple[jax.Array, State, dict[str, jax.Array]]:
  """`transformer.forward` with a step cache. Jit-friendly; the skip is one mesh-uniform `lax.cond`.

  Args:
    model, latents, timestep, encoder_hidden_states, plan, encoder_hidden_states_image,
      control_hidden_states, control_hidden_states_scale: as `transformer.forward` (latents [B, C,
      F, Hl, Wl], timestep [B], text [B, L, text_dim]; plan None: one device; image states for Wan
      2.1 I2V / FLF2V, else None; a VACE transformer's context and scales, else None).
    state: this step's `FirstBlockState` or `MagState` (from `init_state` or the previous step).

  Returns:
    (noise [B, C_out, F, Hl, Wl] in the model dtype, the next state, stats) with stats
    {"skipped": bool [] (blocks skipped this step), "metric": float32 []}: first-block, the
    relative L1 change of block 0's residual (+inf before the first full step); MagCache, the
    measured magnitude ratio ||R_s|| / ||R_prev|| on a full step (1 on the first, NaN when skipped).

  Raises:
    ValueError: as `transformer.forward`; TypeError for a state of another kind.
  """
  if not isinstance(state, (FirstBlockState, MagState)):
    raise TypeError(f"state must be a FirstBlockState or MagState, got {type(state).__name__}")
  x0_BTD, context = wan_transformer.embed(model, latents, timestep, encoder_hidden_states, plan,
                                         encoder_hidden_states_image, control_hidden_states=control_hidden_states,
                                         control_hidden_states_scale=control_hidden_states_scale)
  if isinstance(state, FirstBlockState):
    xz_BTD, state, stats = _first_block_step(model, x0_BTD, context, state)
  else:
    xz_BTD, state, stats = _mag_step(model, x0_BTD, context, state)
  return wan_transformer.unembed(model, xz_BTD, context), state, stats


def _first_block_step(model: wan_transformer.WanTransformer, x0_BTD: jax.Array,
                      context: wan_transformer.ForwardContext,
                      state: FirstBlockState) -> tuple[jax.Array, FirstBlockState, dict[str, jax.Array]]:
  """First-block cache around the blocks: x0 [B, T_padded, D] (from `embed`) -> (x_Z, next state,
  stats); block 0 always runs, blocks 1..Z-1 are skipped when its residual barely changed."""
  x1_BTD, head_BTD = first_block_head(model, x0_BTD, context)
  change = relative_change(*l1_parts(head_BTD, state.head_residual, context.layout.tokens))
  skip = state.valid & (change < state.threshold)
  xz_BTD, head_BTD, tail_BTD = first_block_rest(model, skip, x1_BTD, head_BTD, state.head_residual,
                                                state.tail_residual, context)
  state = dataclasses.replace(state, head_residual=head_BTD, tail_residual=tail_BTD,
                              valid=jnp.ones_like(state.valid))
  return xz_BTD, state, {"skipped": skip, "metric": change}


def first_block_head(model: wan_transformer.WanTransformer, x0_BTD: jax.Array,
                     context: wan_transformer.ForwardContext) -> tuple[jax.Array, jax.Array]:
  """(x_1 [B, T_padded, D], block 0's residual x_1 - x_0 in the model dtype): block 0 run."""
  x1_BTD = wan_transformer.run_blocks(model, x0_BTD, context, 0, 1)
  return x1_BTD, (x1_BTD.astype(jnp.float32) - x0_BTD.astype(jnp.float32)).astype(model.dtype)


def first_block_rest(model: wan_transformer.WanTransformer, skip: jax.Array, x1_BTD: jax.Array, head_BTD: jax.Array,
                     prev_head_BTD: jax.Array, tail_BTD: jax.Array, context: wan_transformer.ForwardContext
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(x_Z, head residual kept, tail residual kept): blocks 1..Z-1 run (the residuals refreshed) or,
  where `skip` (bool [], mesh-uniform), x_1 + the cached tail (the residuals as they were)."""
  dtype, f32, layers = model.dtype, jnp.float32, model.config.num_layers

  def full(x1_BTD, head_BTD, prev_head_BTD, tail_BTD):
    del prev_head_BTD, tail_BTD
    if layers == 1:
      xz_BTD = x1_BTD
    else:
      xz_BTD = wan_transformer.run_blocks(model, x1_BTD, context, 1, layers)
    tail_BTD = (xz_BTD.astype(f32) - x1_BTD.astype(f32)).astype(dtype)
    return xz_BTD, head_BTD, context.layout.constrain(tail_BTD)

  def cached(x1_BTD, head_BTD, prev_head_BTD, tail_BTD):
    del head_BTD
    xz_BTD = (x1_BTD.astype(f32) + tail_BTD.astype(f32)).astype(dtype)
    return context.layout.constrain(xz_BTD), prev_head_BTD, tail_BTD

  return jax.lax.cond(skip, cached, full, x1_BTD, head_BTD, prev_head_BTD, tail_BTD)


def _mag_step(model: wan_transformer.WanTransformer, x0_BTD: jax.Array, context: wan_transformer.ForwardContext,
              state: MagState) -> tuple[jax.Array, MagState, dict[str, jax.Array]]:
  """MagCache around the blocks: x0 [B, T_padded, D] (from `embed`) -> (x_Z, next state, stats);
  every block is skipped while the accumulated error stays under the threshold."""
  decision = mag_decision(state)
  xz_BTD, residual_BTD, parts = mag_rest(model, decision["skip"], state.valid, x0_BTD, state.residual, context)
  return (xz_BTD, *mag_next(state, decision, residual_BTD, parts[0] / parts[1]))


def mag_decision(state: MagState) -> dict[str, jax.Array]:
  """This step's skip (bool [], from the carried accumulators and the step's ratio only) and the
  accumulators it would carry on: {"skip", "active", "acc_ratio", "acc_err", "acc_steps"}."""
  ratio = state.ratios[jnp.minimum(state.step, state.ratios.shape[0] - 1)]
  active = state.step >= state.retention_steps  # diffusers: accumulate only past the retention steps
  acc_ratio = state.acc_ratio * ratio
  acc_steps = state.acc_steps + 1
  acc_err = state.acc_err + jnp.abs(1.0 - acc_ratio)
  skip = state.valid & active & (acc_err < state.threshold) & (acc_steps <= state.max_skips)
  return {"skip": skip, "active": active, "acc_ratio": acc_ratio, "acc_err": acc_err, "acc_steps": acc_steps}


def mag_rest(model: wan_transformer.WanTransformer, skip: jax.Array, valid: jax.Array, x0_BTD: jax.Array,
             residual_BTD: jax.Array, context: wan_transformer.ForwardContext, rows_B: Any = None
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(x_Z, the residual kept, float32 [2] the measured magnitude ratio's (sum, count) over the
  counted rows (`rows_B` as `l1_parts`')): every block run (the residual refreshed; (1, 1) before
  the first full step) or, where `skip`, x_0 + the cached residual ((NaN, 1)). The ratio is sum / count."""
  tokens, dtype, f32 = context.layout.tokens, model.dtype, jnp.float32

  def full(x0_BTD, residual_BTD):
    xz_BTD = wan_transformer.run_blocks(model, x0_BTD, context)
    new_BTD = context.layout.constrain((xz_BTD.astype(f32) - x0_BTD.astype(f32)).astype(dtype))
    parts = jnp.where(valid, _magnitude_parts(new_BTD, residual_BTD, tokens, rows_B), jnp.ones(2, f32))
    return xz_BTD, new_BTD, parts

  def cached(x0_BTD, residual_BTD):
    xz_BTD = (x0_BTD.astype(f32) + residual_BTD.astype(f32)).astype(dtype)
    return context.layout.constrain(xz_BTD), residual_BTD, jnp.array([jnp.nan, 1.0], f32)

  return jax.lax.cond(skip, cached, full, x0_BTD, residual_BTD)


def mag_next(state: MagState, decision: dict[str, jax.Array], residual_BTD: jax.Array, measured: jax.Array
             ) -> tuple[MagState, dict[str, jax.Array]]:
  """(the next state, stats) after a step that `decision` skipped or ran: a full step past the
  retention steps restarts the accumulators."""
  skip, f32 = decision["skip"], jnp.float32
  restart = decision["active"] & ~skip

  def carried(name, start):
    return jnp.where(skip, decision[name], jnp.where(restart, start, getattr(state, name)))

  state = dataclasses.replace(
      state, residual=residual_BTD, valid=jnp.ones_like(state.valid), step=state.step + 1,
      acc_ratio=carried("acc_ratio", 1.0).astype(f32), acc_err=carried("acc_err", 0.0).astype(f32),
      acc_steps=carried("acc_steps", 0).astype(jnp.int32))
  return state, {"skipped": skip, "metric": measured.astype(f32)}
