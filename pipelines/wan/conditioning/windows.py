"""Context windows: a video longer than the model's trained clip, denoised as overlapping clips.

At every step the latent frames are covered by overlapping windows of `length` latent frames; each
window is one transformer forward that sees its frames as a clip of that length (its own RoPE
positions, its own per-token timesteps for TI2V, its slice of an image condition's channels: the
first window holds the first frame); the windows' noise predictions are blended where they overlap
and the scheduler steps once on the whole latent video.

Or, with `fuse` "continue", the windows run one after another, each given the frames it shares
with the one before (`ContextWindows.continued`; `pipeline.run.continued` runs them).

The blend is ComfyUI's `WanContextWindowsManual` with its defaults (comfy/context_windows.py:
`create_weights_pyramid`, `combine_context_window_results`); the layout takes as many windows as
its `create_windows_static_standard` (windows every `length - overlap` frames, the last moved back
flush with the end) but spreads them evenly, so no two windows overlap by more than the rest
(ComfyUI's last two can share all but one frame); "pyramid" weights a window's frames 1, 2, ..., peak, ..., 2, 1 and "flat" all 1; each frame's
prediction is the weighted sum over the windows holding it divided by the sum of their weights.

Windows run in rounds of G at once (G = the mesh's windows degree W, 1 without one): round r holds
windows r*G .. r*G + G-1, the last round padded with copies of the last window of weight 0 (and
counted in no statistic over the rounds: `real_rows` marks their rows). The rows
of a round's forward are [outer, G, inner x B]: outer = 2 when the guidance halves sit on separate
devices (CFG=2), so that every (cfg, windows) device group holds one window's rows.

Glossary (DESIGN.md section 1): B videos, R' rows (B or 2B under guidance), C / C' latent / input
channels, F / Hl / Wl latent frames / height / width, T tokens, Lw window frames, G windows a round.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from attention.mesh import CFG_AXIS, WINDOWS_AXIS
from pipelines.wan.conditioning.inputs import StepInputs
from pipelines.wan.transformer import TokenTimesteps

BLENDS = ("pyramid", "flat")
FUSES = (*BLENDS, "continue")


@dataclasses.dataclass(frozen=True)
class ContextWindows:
  """The windows of one video, in latent frames (frozen, hashable: a static argument of the step).

  Attributes:
    frames: F, the video's latent frames.
    length: Lw, a window's latent frames (< F).
    overlap: latent frames two neighbouring windows share at least (< Lw).
    fuse: "pyramid" | "flat", the blend weights of windows run at every step; or "continue":
      windows run one after another, each a whole denoising of its frames with the frames it
      shares with the windows before given (`continued`).
  """
  frames: int
  length: int
  overlap: int
  fuse: str = "pyramid"

  @property
  def starts(self) -> tuple[int, ...]:
    """Each window's first latent frame: n = ceil((F - Lw) / (Lw - overlap)) + 1 windows (as
    many as ComfyUI's layout), the first at 0, the last at F - Lw, evenly spaced between."""
    span = self.frames - self.length
    n = -(-span // (self.length - self.overlap)) + 1
    return tuple((k * span + (n - 1) // 2) // (n - 1) for k in range(n))

  def continued(self) -> tuple[tuple[int, int], ...]:
    """(start, given) of each window when windows continue (`fuse` "continue"): the windows of
    `starts`, run in order; window k's first `given` latent frames, those the windows before it
    produced (start[k-1] + Lw - start[k] >= overlap; 0 for the first), are given clean, as a TI2V
    model's first frame is (per-token timestep 0, `conditioning.ti2v`), and it denoises the rest.
    Source: the autoregressive extension of SkyReels-V2's diffusion forcing and FramePack, with the
    given frames at timestep 0 as Wan 2.2 TI2V conditions its first frame."""
    starts = self.starts
    return tuple((s, 0 if k == 0 else starts[k - 1] + self.length - s) for k, s in enumerate(starts))

  def weights(self) -> np.ndarray:
    """float32 [Lw]: a window's blend weight of each of its frames.

    Raises:
      ValueError: windows that continue (`fuse` "continue"), which are not blended."""
    if self.fuse not in BLENDS:
      raise ValueError(f"fuse={self.fuse!r}: these windows are not blended (pipeline.continued runs them)")
    if self.fuse == "flat":
      return np.ones(self.length, np.float32)
    peak = (self.length + 1) // 2
    rising = np.arange(1, peak + 1, dtype=np.float32)
    return np.concatenate([rising, rising[: self.length - peak][::-1]])

  def counts(self) -> np.ndarray:
    """float32 [F]: each frame's sum of weights over the windows holding it (> 0 everywhere)."""
    counts = np.zeros(self.frames, np.float32)
    for start in self.starts:
      counts[start:start + self.length] += self.weights()
    return counts

  def rounds(self, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """(int32 [rounds, G] starts, float32 [rounds, G, Lw] each window's share of each of its frames'
    blend, weight / counts: a frame's shares over its windows sum to 1, a padding copy's are 0)."""
    n = len(self.starts)
    total = math.ceil(n / groups) * groups
    starts = np.asarray(self.starts + (self.starts[-1],) * (total - n), np.int32)
    counts = self.counts()
    shares = np.stack([self.weights() / counts[s:s + self.length] * (k < n) for k, s in enumerate(starts)])
    return starts.reshape(-1, groups), shares.astype(np.float32).reshape(-1, groups, self.length)

  def video_frames(self, temporal_factor: int = 4) -> tuple[int, int]:
    """(a window's video frames, the overlap in video frames): the call's `context_frames` and
    `context_overlap` these latent frames came from."""
    return (self.length - 1) * temporal_factor + 1, self.overlap * temporal_factor

  def describe(self) -> dict[str, Any]:
    """For sidecars and the resume identity: latent frames, overlap, fuse and the starts."""
    return {"latent_length": self.length, "latent_overlap": self.overlap, "fuse": self.fuse,
            "starts": list(self.starts)}


# --- one round's rows ----------------------------------------------------------------------------

def tile_rows(x: jax.Array, groups: int, outer: int, axis: int = 0) -> jax.Array:
  """Rows [.., R', ..] on `axis` as a round's [.., outer x G x inner, ..]: each window's copy."""
  shape = x.shape
  x = x.reshape(*shape[:axis], outer, -1, *shape[axis + 1:])
  x = jnp.broadcast_to(jnp.expand_dims(x, axis + 1), (*x.shape[:axis + 1], groups, *x.shape[axis + 1:]))
  return x.reshape(*shape[:axis], -1, *shape[axis + 1:])


def real_rows(windows: ContextWindows, groups: int, outer: int, rows: int) -> np.ndarray:
  """bool [rounds, outer x G x inner]: which rows of each round's forward are a window's (True) and
  which a padding copy's (False: the last round's copies of the last window, `ContextWindows.rounds`),
  so that statistics over the rounds (the step cache's) count every window once, on every mesh.

  Args:
    groups: G, windows a round; outer: 2 when the guidance halves sit on separate devices, else 1;
    rows: R', one window's rows (inner = R' / outer).

  Raises:
    ValueError: rows not a multiple of outer.
  """
  if rows % outer:
    raise ValueError(f"{rows=} must be a multiple of {outer=}")
  n = len(windows.starts)
  real_RG = (np.arange(math.ceil(n / groups) * groups) < n).reshape(-1, groups)
  return np.broadcast_to(real_RG[:, None, :, None], (real_RG.shape[0], outer, groups, rows // outer)).reshape(
      real_RG.shape[0], -1)


def window_rows(x: jax.Array, starts_G: jax.Array, length: int, outer: int, axis: int) -> jax.Array:
  """Rows [R', ..] with frames on `axis` as a round's [outer x G x inner, .., Lw, ..]: window g's
  frames starts_G[g] .. + Lw of every row (int32 [G], traced)."""
  x = x.reshape(outer, -1, *x.shape[1:])
  parts = [jax.lax.dynamic_slice_in_dim(x, starts_G[g], length, axis=axis + 1) for g in range(starts_G.shape[0])]
  stacked = jnp.stack(parts, axis=1)
  return stacked.reshape(-1, *stacked.shape[3:])


def window_inputs(inputs: StepInputs, starts_G: jax.Array, length: int, outer: int) -> StepInputs:
  """A round's `StepInputs`: the latents' (and per-token timesteps') window frames, every other
  per-row input copied per window (`inputs`: the whole video's, rows [R', ...])."""
  groups = starts_G.shape[0]
  frames = inputs.latents.shape[2]
  timestep = inputs.timestep
  if isinstance(timestep, TokenTimesteps):  # the levels per row, the index per token
    timestep = TokenTimesteps(tile_rows(timestep.levels, groups, outer),
                              _window_tokens(timestep.index, frames, starts_G, length, outer))
  elif timestep.ndim == 2:  # per token
    timestep = _window_tokens(timestep, frames, starts_G, length, outer)
  else:
    timestep = tile_rows(timestep, groups, outer)
  image = None if inputs.image is None else tile_rows(inputs.image, groups, outer)
  return StepInputs(window_rows(inputs.latents, starts_G, length, outer, axis=2), timestep, image)


def _window_tokens(per_token: jax.Array, frames: int, starts_G: jax.Array, length: int, outer: int) -> jax.Array:
  """A per-token array [R', T] (tokens frame-major) as a round's rows: each window's frames' tokens."""
  per_frame = per_token.reshape(per_token.shape[0], frames, -1)
  return window_rows(per_frame, starts_G, length, outer, axis=1).reshape(-1, length * per_frame.shape[2])


def tile_text(text: Any, groups: int, outer: int) -> Any:
  """The text's rows per window: text states [R', L, D] or every array of a `TextKV` ([Z, R', ...])."""
  return jax.tree.map(lambda a: tile_rows(a, groups, outer, axis=0 if a.ndim == 3 else 1), text)


# --- the blend -----------------------------------------------------------------------------------

def blend(noise: jax.Array, windows: ContextWindows, groups: int, outer: int, mesh: Mesh | None) -> jax.Array:
  """The video's noise prediction from every round's: each frame the share-weighted sum over its
  windows (`ContextWindows.rounds`), in float32, rounded once to noise's dtype.

  Args:
    noise: [rounds, outer x G x inner, C, Lw, Hl, Wl] in the model dtype.
    mesh: with a windows axis (G = W > 1), each (cfg, windows) device group adds its own windows and
      one all-reduce over "windows" sums the groups' (one collective a step); else None.

  Returns:
    [R', C, F, Hl, Wl] in noise's dtype, rows in the step's order ([cond; uncond]).
  """
  starts, shares = windows.rounds(groups)
  if mesh is None or groups == 1:
    local = noise.reshape(noise.shape[0], outer, groups, -1, *noise.shape[2:])
    out = jnp.stack([_accumulate(local[:, o, 0], starts[:, 0], shares[:, 0], windows.frames) for o in range(outer)])
    return out.reshape(-1, *out.shape[2:]).astype(noise.dtype)

  def body(local):
    g = jax.lax.axis_index(WINDOWS_AXIS)
    summed = _accumulate(local, jnp.asarray(starts)[:, g], jnp.asarray(shares)[:, g], windows.frames)
    return jax.lax.psum(summed, WINDOWS_AXIS).astype(noise.dtype)

  return jax.shard_map(body, mesh=mesh, in_specs=P(None, (CFG_AXIS, WINDOWS_AXIS)), out_specs=P(CFG_AXIS),
                       check_vma=False)(noise)


def _accumulate(noise: jax.Array, starts: Any, shares: Any, frames: int) -> jax.Array:
  """float32 [rows, C, F, Hl, Wl]: sum over rounds r of shares[r] x noise[r] placed at starts[r]
  (noise [rounds, rows, C, Lw, Hl, Wl]; starts int [rounds], shares float32 [rounds, Lw])."""
  rounds, rows, channels, length, height, width = noise.shape
  acc = jnp.zeros((rows, channels, frames, height, width), jnp.float32)
  for r in range(rounds):
    share = jnp.asarray(shares[r], jnp.float32)[:, None, None]
    part = jax.lax.dynamic_slice_in_dim(acc, starts[r], length, axis=2) + share * noise[r].astype(jnp.float32)
    acc = jax.lax.dynamic_update_slice_in_dim(acc, part, starts[r], axis=2)
  return acc
