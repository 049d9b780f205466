"""The step cache over a long video's context windows (`wan.conditioning.windows`): one skip
decision per denoising step for every window, each window's residuals its own.

Glossary (DESIGN.md section 1): R rounds of the windowed step (`ContextWindows.rounds`), G windows
a round (the mesh's W), B rows of one round's forward (G x the rows of one window's: [cond; uncond]
rows under CFG), T one window's video tokens (padded as `embed` pads them), D model width.

A round's rows of a padding copy (the last round's copies of the last window when G does not divide
the windows, `conditioning.real_rows`) run and keep their residuals like any other, but no statistic
counts them: the blend weighs them 0, and the skip statistics sum over the real windows' rows only,
so every mesh (any G) makes the one device's decisions from the same windows.

The state is the one-clip state (`forward.FirstBlockState` / `MagState`, from `init_state` with
rows R x B and tokens T): round r's residuals are rows [r B, (r + 1) B). Its checkpoint, resume and
reset are the one-clip state's.

- MagCache decides from its carried accumulators and the step's calibrated ratio only, so the one
  decision (`forward.mag_decision`) is made before the windows run; the measured ratio (a stat,
  not an input of later decisions) is the mean over every token of every real window (the rounds'
  sums over their counts, `forward.mag_rest`).
- First-block cache compares block 0's residual of every window with the one of the last full
  step: a first scan over the rounds runs block 0 and sums `forward.l1_parts`, then one decision
  on the relative change over all real windows (the one-clip statistic, over more tokens); the second
  scan runs block 0 again (Z-1 more blocks, or the cached tail) rather than holding every
  window's x_1 (one more [R B, T, D] array) between the scans.

With one window as long as the video, both equal `forward.cached_forward` bit for bit (test).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pipelines.parallel.plan import ParallelPlan
from pipelines.wan.transformer import model as wan_transformer
from pipelines.wan.step_cache.forward import (FirstBlockState, MagState, first_block_head, first_block_rest,
                                              l1_parts, mag_decision, mag_next, mag_rest, relative_change)


def cached_windows(model: wan_transformer.WanTransformer, state: FirstBlockState | MagState, starts_RG: jax.Array,
                   real_RB: Any, window_inputs: Callable[[jax.Array], dict[str, Any]], plan: ParallelPlan | None,
                   finish: Callable[[jax.Array], jax.Array] = lambda noise: noise
                   ) -> tuple[jax.Array, FirstBlockState | MagState, dict[str, jax.Array]]:
  """Every round's noise prediction with the step cache: `cached_forward` over context windows.

  Args:
    model: the transformer.
    state: this step's state, residuals [R x B, T, D] (module docstring).
    starts_RG: int32 [R, G], each round's windows' first latent frames.
    real_RB: bool [R, B], the rows of each round's forward that belong to a window, False for a
      padding copy's (`conditioning.real_rows`): those count in no statistic.
    window_inputs: starts_G -> `embed`'s keyword arguments for that round's windows (latents
      [B, C, Lw, Hl, Wl], timestep, encoder_hidden_states, encoder_hidden_states_image, the VACE
      control ones).
    plan: where it runs (None: one device).
    finish: applied to each round's noise prediction (e.g. a sharding constraint).

  Returns:
    (noise [R, B, C_out, Lw, Hl, Wl] in the model dtype, the next state, stats as `cached_forward`'s,
    over the real windows' rows).

  Raises:
    TypeError: a state of another kind.
    ValueError: real_RB not [R, B] for the state's R x B rows.
  """
  if not isinstance(state, (FirstBlockState, MagState)):
    raise TypeError(f"state must be a FirstBlockState or MagState, got {type(state).__name__}")
  real_RB = jnp.asarray(real_RB, bool)
  rows = (state.residual if isinstance(state, MagState) else state.head_residual).shape[0] // starts_RG.shape[0]
  if real_RB.shape != (starts_RG.shape[0], rows):
    raise ValueError(f"real_RB {real_RB.shape} must be [R, B] = [{starts_RG.shape[0]}, {rows}]")
  rounds = Rounds(model, starts_RG, real_RB, window_inputs, plan, finish)
  if isinstance(state, MagState):
    return _mag_windows(rounds, state)
  return _first_block_windows(rounds, state)


@dataclasses.dataclass(frozen=True)
class Rounds:
  """One step's rounds of windows (`cached_windows`' arguments) and their residuals' row split."""
  model: wan_transformer.WanTransformer
  starts_RG: jax.Array
  real_RB: jax.Array
  window_inputs: Callable[[jax.Array], dict[str, Any]]
  plan: ParallelPlan | None
  finish: Callable[[jax.Array], jax.Array]

  def split(self, x_BTD: jax.Array) -> jax.Array:
    """[R x B, T, D] -> [R, B, T, D]."""
    rounds = self.starts_RG.shape[0]
    return x_BTD.reshape(rounds, x_BTD.shape[0] // rounds, *x_BTD.shape[1:])

  def embedded(self, starts_G: jax.Array):
    """(x_0 [B, T_padded, D], its `ForwardContext`) of a round's windows."""
    return wan_transformer.embed(self.model, plan=self.plan, **self.window_inputs(starts_G))

  def noise(self, xz_BTD: jax.Array, context: wan_transformer.ForwardContext) -> jax.Array:
    return self.finish(wan_transformer.unembed(self.model, xz_BTD, context))


def _merged(x_RBTD: jax.Array) -> jax.Array:
  return x_RBTD.reshape(-1, *x_RBTD.shape[2:])


def _mag_windows(rounds: Rounds, state: MagState):
  """MagCache: the decision first (it reads no activations), then every round with it."""
  decision = mag_decision(state)

  def body(_, xs):
    starts_G, real_B, residual_BTD = xs
    x0_BTD, context = rounds.embedded(starts_G)
    xz_BTD, residual_BTD, parts = mag_rest(rounds.model, decision["skip"], state.valid, x0_BTD, residual_BTD,
                                           context, real_B)
    return None, (rounds.noise(xz_BTD, context), residual_BTD, parts)

  _, (noise, residual, parts) = jax.lax.scan(body, None, (rounds.starts_RG, rounds.real_RB,
                                                          rounds.split(state.residual)))
  parts = jnp.sum(parts, axis=0)
  return (noise, *mag_next(state, decision, _merged(residual), parts[0] / parts[1]))


def _first_block_windows(rounds: Rounds, state: FirstBlockState):
  """First-block cache: block 0 of every round and one decision on the summed change, then every
  round again with it (block 0 recomputed, module docstring)."""
  model = rounds.model

  def head(parts, xs):
    starts_G, real_B, prev_head_BTD = xs
    x0_BTD, context = rounds.embedded(starts_G)
    _, head_BTD = first_block_head(model, x0_BTD, context)
    return parts + l1_parts(head_BTD, prev_head_BTD, context.layout.tokens, real_B), None

  parts, _ = jax.lax.scan(head, jnp.zeros(2, jnp.float32),
                          (rounds.starts_RG, rounds.real_RB, rounds.split(state.head_residual)))
  change = relative_change(parts[0], parts[1])
  skip = state.valid & (change < state.threshold)

  def body(_, xs):
    starts_G, prev_head_BTD, tail_BTD = xs
    x0_BTD, context = rounds.embedded(starts_G)
    x1_BTD, head_BTD = first_block_head(model, x0_BTD, context)
    xz_BTD, head_BTD, tail_BTD = first_block_rest(model, skip, x1_BTD, head_BTD, prev_head_BTD, tail_BTD, context)
    return None, (rounds.noise(xz_BTD, context), head_BTD, tail_BTD)

  _, (noise, head_res, tail_res) = jax.lax.scan(
      body, None, (rounds.starts_RG, rounds.split(state.head_residual), rounds.split(state.tail_residual)))
  state = dataclasses.replace(state, head_residual=_merged(head_res), tail_residual=_merged(tail_res),
                              valid=jnp.ones_like(state.valid))
  return noise, state, {"skipped": skip, "metric": change}
