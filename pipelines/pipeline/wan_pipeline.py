"""Wan text-to-video pipeline (diffusers' `WanPipeline`) over a (cfg, ring, ulysses) mesh.

The call's arguments are checked in pipelines/pipeline/inputs.py, the folder read in pipelines/wan/folder.py.

Glossary (DESIGN.md section 1): B videos (prompts), C latent channels, F / Hl / Wl latent frames /
height / width, L text tokens (`max_sequence_length`), N heads, U / R Ulysses / ring degrees.

What one call does, in diffusers' order (diffusers pipelines/wan/pipeline_wan.py, `__call__`):
1. prompts cleaned (`prompt_clean`), tokenised to L, UMT5-encoded; rows past each prompt's true
   length zeroed (diffusers trims to the true length, then pads with zeros). Text states given as
   `prompt_embeds` / `negative_prompt_embeds` are used as they are instead. Each prompt's rows are
   repeated `num_videos_per_prompt` times (B videos = prompts x num_videos_per_prompt);
2. noise [B, C, F, Hl, Wl] float32 drawn on the host (video i from `numpy.random.default_rng(seed
   + i)`), so the same seed gives the same video on every mesh and a batch equals its prompts run
   alone with seeds seed, seed + 1, ...; diffusers' torch `generator` has no counterpart: pass its
   noise as `latents` for exact parity;
3. the scheduler's timesteps on the host; for step k the expert is `transformer` while
   t_k >= boundary_ratio * num_train_timesteps, else `transformer_2` (Wan 2.2 A14B), each with its
   own guidance scale;
4. one jitted program per shape does the transformer forward on [cond; uncond] (classifier-free
   guidance batched: 2B rows, one forward), the guidance mix `uncond + g * (cond - uncond)` in the
   model dtype and the scheduler step; latents and solver state are donated. Both experts share
   the program (same graph, same shapes; the weights and g are arguments). The step also returns
   `isfinite(latents).all()` (one reduction, no extra dispatch); with `nan_guard` (default) a
   non-finite step stops the run with `NonFiniteLatentsError` naming the step. After each step,
   diffusers' `callback_on_step_end` may replace the latents or text states, or stop the loop
   (`pipe._interrupt = True`: the remaining steps are skipped, as diffusers does). With
   `step_cache` the forward may skip blocks on steps whose change is small
   (pipelines/wan/step_cache.py: one mesh-uniform decision per step for all rows); the cache state
   is carried and donated too, and saved in denoising checkpoints;
5. latents de-normalised with the VAE statistics, decoded, mapped to [0, 1] (`output_type="np"`;
   "pil" rounds those to uint8 images, "latent" skips 5 and returns the latents).

Classifier-free guidance is on when `guidance_scale > 1` (diffusers: only the first scale decides).
The negative prompt defaults to "" as in diffusers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import reprlib
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from attention import BACKENDS, IMPLEMENTATIONS, resolve_backend
from attention.mesh import CFG_AXIS, MeshSpec
from pipelines.storage import weights
from pipelines.parallel import distributed
from pipelines.pipeline import resume as resume_state
from pipelines.wan.folder import PipelineIndex
from pipelines.pipeline.inputs import (  # noqa: F401 (OUTPUT_TYPES, check_size, ... re-exported for callers)
    CALLBACK_TENSOR_INPUTS, OUTPUT_TYPES, ResolvedCall, check_flag, check_int, check_number, check_output_type,
    check_size, embeds_array, frames_to_pil, host_array, is_real, noise_array, not_a, resolve_mesh,
    round_num_frames, texts)
from pipelines.pipeline.lora_loading import LoraLoaderMixin
from pipelines.wan import schedulers, tokenizer as tokenization, umt5, vae as wan_vae
from pipelines.wan import step_cache as wan_step_cache
from pipelines.wan.transformer import (WanTransformer, forward, init_transformer, large_leaf_shardings,
                                      weight_shardings)
from pipelines.wan.transformer_config import WanTransformerConfig
from pipelines.wan.transformer_loading import load_transformer
from pipelines.wan.tiny import TINY_DEFAULT_FOLDER, TINY_SCHEDULER, TINY_SEED, TINY_TRANSFORMER  # noqa: F401 (re-exported)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class NonFiniteLatentsError(FloatingPointError):
  """The latents became NaN or inf during denoising; the run stopped before decoding."""

# --- settings and their checks (cheap; run before any compute) -----------------------------------

@dataclasses.dataclass(frozen=True)
class GenerationResult:
  """What `WanPipeline.run` returns.

  Attributes:
    frames: float32 [B, frames, height, width, 3] in [0, 1]; None when run with `decode=False`.
    latents: float32 [B, C, F, Hl, Wl], the final denoised latents (before de-normalisation).
    timings: seconds: "text_encode", "compile" (0 when cached), "denoise" (all steps),
      "denoise_per_step" (mean), "decode", "total".
    settings: the resolved call (sizes after rounding, steps, guidance, shift, seed, mesh, dtype).
  """
  frames: np.ndarray | None
  latents: np.ndarray
  timings: dict[str, float]
  settings: dict[str, Any]


# --- the jitted denoise step -----------------------------------------------------------------------

TRACE_COUNT = {"denoise_step": 0}  # incremented at trace time; tests assert one trace per shape


def denoise_step(graphdef: nnx.GraphDef, params: nnx.State, latents: jax.Array, solver: Any,
                  text: jax.Array, guidance: jax.Array, cache: Any = None, *, mesh: Mesh | None,
                  cfg: bool, attention_implementation: str = "auto", gather_weights: bool = False,
                  attention_backend: str = "auto"):
  """One denoising step: transformer on [cond; uncond], guidance mix, scheduler step.

  Args:
    graphdef, params: `nnx.split` of a `WanTransformer` (static graph, array state).
    latents: float32 [B, C, F, Hl, Wl] (donated).
    solver: `UniPCState` or `FlowEulerState` (donated).
    text: [2B, L, text_dim] (cond rows, then uncond rows) under CFG, else [B, L, text_dim].
    guidance: float32 [] scale of this step's expert.
    mesh: None or the (cfg, ring, ulysses) mesh (static). With a cfg axis of size 2 the cond rows
      run on its first half of the devices and the uncond rows on the second, each half running
      the whole USP schedule; the guidance mix then brings the two noise predictions together
      (one exchange of the noise-prediction size per step).
    cfg: classifier-free guidance on (static).
    attention_implementation: "auto" | "lse" | "fixed_m" for the transformer (static).
    attention_backend: "auto" | "xla" | "pallas": the attention kernels (static).
    gather_weights: the block weights are sharded over the mesh (`transformer.weight_shardings`)
      and gathered one layer at a time in the layer scan (static).
    cache: None (no step cache: the plain transformer forward) or the step-cache state
      (`step_cache.FirstBlockState` / `MagState`, from `step_cache.init_state` or the previous
      step; donated). One skip decision covers the cond and uncond rows.

  Returns:
    (latents float32 [B, C, F, Hl, Wl], new solver state, bool [] all latents finite, new cache
    state, cache stats). The flag is one reduction in the same program, so the NaN guard costs no
    extra dispatch. Without a cache the last two are None; with one, the stats are
    {"skipped": bool [], "metric": float32 []} (`step_cache.cached_forward`).
  """
  TRACE_COUNT["denoise_step"] += 1
  model = nnx.merge(graphdef, params)
  x = latents.astype(model.dtype)  # diffusers: latents.to(transformer_dtype)
  if cfg:
    x = jnp.concatenate([x, x], axis=0)
  timestep = jnp.broadcast_to(solver.timestep(), (x.shape[0],))
  stats = None
  if cache is None:
    noise = forward(model, x, timestep, text, mesh=mesh, attention_implementation=attention_implementation,
                    gather_weights=gather_weights, attention_backend=attention_backend)  # model dtype
  else:
    noise, cache, stats = wan_step_cache.cached_forward(
        model, x, timestep, text, cache, mesh=mesh, attention_implementation=attention_implementation,
        gather_weights=gather_weights, attention_backend=attention_backend)
  if cfg and mesh is not None and MeshSpec.of(mesh).cfg == 2:
    noise = _cfg_parallel_mix(noise, guidance, mesh)
  elif cfg:
    noise = _guidance_mix(*jnp.split(noise, 2, axis=0), guidance)
  new_latents, solver = solver.step(noise, latents)
  # Euler returns the model dtype (as diffusers); fp32 holds those values exactly and keeps one
  # signature for every step.
  new_latents = new_latents.astype(latents.dtype)
  out = (new_latents, solver, jnp.isfinite(new_latents).all())
  if mesh is not None:
    # Pin the carried state to the replicated layout it came in with: otherwise GSPMD may hand it
    # back sharded and the next call of this compiled step rejects its own output.
    out = jax.lax.with_sharding_constraint(out, NamedSharding(mesh, P()))
  if cache is not None:
    cache = wan_step_cache.constrain(cache, mesh)  # residuals sequence-sharded, scalars replicated
  return (*out, cache, stats)


def _guidance_mix(cond: jax.Array, uncond: jax.Array, guidance: jax.Array) -> jax.Array:
  """uncond + g * (cond - uncond), as diffusers: torch's scalar * tensor computes in fp32
  ("opmath") and rounds once to the tensor dtype."""
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
    return _guidance_mix(jnp.where(first, half, other), jnp.where(first, other, half), g)

  noise = jax.lax.with_sharding_constraint(noise, NamedSharding(mesh, P(CFG_AXIS)))
  return jax.shard_map(body, mesh=mesh, in_specs=(P(CFG_AXIS), P()), out_specs=P(),
                       check_vma=False)(noise, guidance)


# Compiled steps by (graph, mesh, cfg, abstract arguments): pipelines with the same architecture
# (both experts of Wan 2.2, or two loads of one folder) share one executable per shape.
_COMPILED_STEPS: dict[Any, Any] = {}
_denoise_step_jit = jax.jit(denoise_step, static_argnums=0,
                            static_argnames=("mesh", "cfg", "attention_implementation", "gather_weights",
                                             "attention_backend"),
                            donate_argnames=("latents", "solver", "cache"))


@jax.jit
def _masked_text(embeds: jax.Array, mask: jax.Array) -> jax.Array:
  """[B, L, D] embeddings with rows past each prompt's true length zeroed (mask int [B, L])."""
  return jnp.where(mask[..., None] > 0, embeds, jnp.zeros((), embeds.dtype))


_encode_jit = jax.jit(umt5.encode, static_argnames="config")


@jax.jit
def _to_unit_range(video: jax.Array) -> jax.Array:
  """[-1, 1] -> [0, 1] as diffusers' `VaeImageProcessor.denormalize`, in the video dtype, then fp32."""
  return jnp.clip(video * 0.5 + 0.5, 0, 1).astype(jnp.float32)


def _placement_key(mesh: Mesh | None, shard_weights: bool) -> Any:
  """Identifies where `WanPipeline._place` put the weights (None: the first device)."""
  return None if mesh is None else (tuple(d.id for d in mesh.devices.flat), tuple(mesh.shape.items()),
                                    bool(shard_weights))


class WanPipeline(LoraLoaderMixin):
  """Text-to-video Wan (2.1 T2V, or 2.2 T2V A14B with two experts), sequence-parallel transformer.

  Build with `from_pretrained(folder)` or `tiny()`; call with prompts (see `__call__`). LoRAs:
  `load_lora_weights`, `set_lora_scale`, `fuse_lora` / `unfuse_lora` (`pipelines.wan.lora`).

  Attributes:
    transformer_config: config shared by both experts.
    boundary_ratio: None (one expert) or the Wan 2.2 switch ratio.
    scheduler_config: `UniPCConfig` or `FlowEulerConfig`.
    dtype: transformer / text encoder dtype; the VAE runs in `vae.dtype`.
    name: where the weights came from (folder path or "tiny").
    max_sequence_length: the default text length L of calls (`tokenizer.text_length` of the
      tokenizer's `model_max_length`: 512 for Wan's tokenizers, the length a model was trained
      with when its folder's tokenizer says less, e.g. 64 for end_to_end.train_tiny's models).
  """

  def __init__(self, *, tokenizer: Any, text_encoder: tuple[umt5.UMT5Config, umt5.Params],
               transformers: Sequence[WanTransformer], vae: wan_vae.WanVAE,
               scheduler_config: schedulers.SchedulerConfig, boundary_ratio: float | None = None,
               name: str = ""):
    if len(transformers) not in (1, 2) or (len(transformers) == 2) != (boundary_ratio is not None):
      raise ValueError(f"need one transformer, or two with a boundary_ratio; got {len(transformers)=} "
                       f"{boundary_ratio=}")
    configs = {t.config for t in transformers}
    if len(configs) != 1:
      raise ValueError(f"both experts must share one config, got {configs}")
    self.transformer_config = transformers[0].config
    self.text_encoder_config, self._text_params = text_encoder
    if self.text_encoder_config.d_model != self.transformer_config.text_dim:
      raise ValueError(f"text encoder d_model={self.text_encoder_config.d_model} != transformer "
                       f"text_dim={self.transformer_config.text_dim}")
    if vae.config.z_dim != self.transformer_config.in_channels:
      raise ValueError(f"VAE z_dim={vae.config.z_dim} != transformer in_channels="
                       f"{self.transformer_config.in_channels}")
    self.tokenizer = tokenizer
    self.max_sequence_length = tokenization.text_length(getattr(tokenizer, "model_max_length", None))
    self.vae = vae
    self.scheduler_config = scheduler_config
    self.boundary_ratio = boundary_ratio
    self.name = name
    self.dtype = transformers[0].dtype
    split = [nnx.split(t) for t in transformers]
    self._graphdef = split[0][0]
    self._experts = [state for _, state in split]  # placed on the call's devices by `_place`
    self._placement: Any = "unplaced"

  # --- construction ---

  @classmethod
  def from_pretrained(cls, folder: str, dtype: str = "float32", vae_dtype: str = "float32", *,
                      mesh: Mesh | MeshSpec | str | None = None, shard_weights: bool = False,
                      progress: bool | None = None) -> WanPipeline:
    """Loads a diffusers-format Wan folder (safetensors only).

    The weight files are memory-mapped and each weight is laid out, cast and placed on its devices
    in one copy, straight from the mapping (`distributed.put_host_leaves`): host memory beyond the
    placed weights is one tensor at a time, and a sharded weight is never assembled whole.

    Args:
      folder: holds model_index.json, transformer/ (+ transformer_2/ and `boundary_ratio` in
        model_index.json for Wan 2.2 A14B), text_encoder/, tokenizer/, vae/, scheduler/.
      dtype: "float32" or "bfloat16": transformer(s) and text encoder (diffusers' `torch_dtype`).
      vae_dtype: the VAE's dtype; float32 by default as Wan's reference code and diffusers' Wan
        examples run it.
      mesh: the mesh the pipeline will be called on (as `__call__`'s `mesh`): the transformer
        weights go straight to their places on it (replicated, or split with `shard_weights`, as
        `__call__` would place them), and with `shard_weights` the text encoder's large weights
        too. None: the first device (a call on a mesh then moves them once).
      shard_weights: with `mesh`, FSDP-style weight sharding (see `__call__`).
      progress: progress bars while loading (None: for large folders only).

    Raises:
      ValueError: an unknown dtype, or a mesh that does not fit the devices or heads.
      weights.CheckpointError: see `PipelineIndex.read`, `PipelineIndex.check_weights` (every
        weight file's header, before any tensor is read) and the component loaders.
      tokenizer.TokenizerNotFoundError: no tokenizer/ folder.
    """
    model_dtype, vae_dt = _dtype(dtype), _dtype(vae_dtype)
    index = PipelineIndex.read(folder)
    config = index.transformer
    built, spec = (None, MeshSpec()) if mesh is None and not shard_weights else resolve_mesh(
        mesh, heads=config.num_attention_heads, shard_weights=shard_weights)
    index.check_weights()  # a truncated last file fails now, not after loading the others
    scheduler_config = schedulers.scheduler_config_from_dict(
        weights.read_json(os.path.join(folder, "scheduler", "scheduler_config.json"),
                             "the scheduler/ folder needs scheduler_config.json"))
    names = ["transformer"] + (["transformer_2"] if index.boundary_ratio is not None else [])
    if index.has_transformer_2 and index.boundary_ratio is None:
      warnings.warn(f"{folder!r} has transformer_2/ but no boundary_ratio: diffusers never runs it; "
                    "it is not loaded", stacklevel=2)
    experts = [load_transformer(os.path.join(folder, n), model_dtype, mesh=built,
                                shard_weights=spec.shard_weights, progress=progress) for n in names]
    text_shardings = (None if built is None or not spec.shard_weights
                      else functools.partial(large_leaf_shardings, mesh=built))
    text_encoder = umt5.load_umt5(os.path.join(folder, "text_encoder"), dtype=model_dtype,
                                  shardings=text_shardings, progress=progress)
    pipe = cls(tokenizer=tokenization.load_tokenizer(folder), text_encoder=text_encoder,
               transformers=experts, vae=wan_vae.load_vae(os.path.join(folder, "vae"), dtype=vae_dt,
                                                          progress=progress),
               scheduler_config=scheduler_config, boundary_ratio=index.boundary_ratio,
               name=os.path.abspath(folder))
    if built is not None:  # already where a call on this mesh wants them
      pipe._placement = _placement_key(built, spec.shard_weights)
      pipe._text_mesh = built if spec.shard_weights else None
    return pipe

  @classmethod
  def tiny(cls, dtype: str = "float32", *, random: bool = False) -> WanPipeline:
    """The embedded default (no download, no files outside the package).

    Args:
      dtype: "float32" or "bfloat16" (transformer and text encoder; the VAE stays fp32).
      random: False (default): the trained tiny model shipped in `TINY_DEFAULT_FOLDER` (a
        diffusers-format folder written by `python -m end_to_end.train_tiny`; it draws the shapes
        world of `end_to_end.synthetic_world`, e.g. "a red square moving right", at 64x64 x 17
        frames, the size it was trained at; 4 layers, patch 2). True: random weights from
        a fixed seed, `TINY_TRANSFORMER` (8 heads x 16, 2 layers, patch 2), UMT5
        `umt5.PRESETS["tiny"]`, VAE `vae.VAE_PRESETS["tiny"]`, UniPC with flow shift 3: noise-like
        videos, every code path, fastest compiles (what most tests use).

    Both use the ByT5 byte tokenizer and the tiny UMT5 at seed `TINY_SEED`.
    """
    if not random:
      pipe = cls.from_pretrained(TINY_DEFAULT_FOLDER, dtype=dtype)
      pipe.name = "tiny"
      return pipe
    model_dtype = _dtype(dtype)
    te_config = umt5.PRESETS["tiny"]
    return cls(
        tokenizer=tokenization.default_tokenizer(),
        text_encoder=(te_config, umt5.init_umt5_params(te_config, TINY_SEED, dtype=model_dtype)),
        transformers=[init_transformer(TINY_TRANSFORMER, TINY_SEED, model_dtype)],
        vae=wan_vae.init_vae(wan_vae.VAE_PRESETS["tiny"], jax.random.key(TINY_SEED)),
        scheduler_config=TINY_SCHEDULER, name="tiny")

  # --- helpers ---

  @property
  def num_experts(self) -> int:
    return len(self._experts)

  @property
  def _experts(self) -> list[nnx.State]:
    """The experts' weights (nnx states). Assigning new values (a fused LoRA) bumps
    `_weights_version`, so `fingerprint` is recomputed; `_place` only moves them."""
    return self._expert_states

  @_experts.setter
  def _experts(self, states: list[nnx.State]) -> None:
    self._expert_states = list(states)
    self._weights_version = getattr(self, "_weights_version", 0) + 1

  def _place(self, mesh: Mesh | None, shard_weights: bool = False) -> None:
    """Puts the experts' weights on the call's devices: replicated over the mesh (DESIGN.md 2), or
    with `shard_weights` the block weights split over all its devices
    (`transformer.weight_shardings`) and the text encoder's large weights too
    (`transformer.large_leaf_shardings`; otherwise it stays on one device, where it runs)."""
    key = _placement_key(mesh, shard_weights)
    if self._placement == key:
      return
    self._expert_states = [distributed.put_sharded(state, weight_shardings(state, mesh, shard_weights))
                           for state in self._experts]
    if shard_weights and mesh is not None:
      self._text_params = distributed.put_sharded(self._text_params,
                                                   large_leaf_shardings(self._text_params, mesh))
      self._text_mesh = mesh
    elif getattr(self, "_text_mesh", None) is not None:  # back to one device
      one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      self._text_params = jax.device_put(self._text_params, one)
      self._text_mesh = None
    self._placement = key

  def _compiled_step(self, params, latents, solver, text, guidance, cache=None, *, mesh: Mesh | None,
                     cfg: bool, attention_implementation: str = "auto", gather_weights: bool = False,
                     attention_backend: str = "auto", on_compile: Callable[[], None] | None = None):
    """The compiled `denoise_step` for these shapes, dtypes and shardings (compiled once each;
    `on_compile()` is called just before a compile). `cache`: None or a step-cache state."""
    args = (params, latents, solver, text, guidance, cache)
    leaves, treedef = jax.tree.flatten(args)
    key = (self._graphdef, mesh, cfg, attention_implementation, attention_backend, gather_weights, treedef,
           tuple((x.shape, x.dtype, x.sharding) for x in leaves))
    if key not in _COMPILED_STEPS:
      if on_compile is not None:
        on_compile()
      _COMPILED_STEPS[key] = _denoise_step_jit.lower(
          self._graphdef, *args, mesh=mesh, cfg=cfg, attention_implementation=attention_implementation,
          gather_weights=gather_weights, attention_backend=attention_backend).compile()
    return _COMPILED_STEPS[key]

  def encode_prompts(self, prompts: Sequence[str], max_sequence_length: int) -> jax.Array:
    """Cleaned, tokenised and UMT5-encoded prompts, zero past each true length.

    Returns:
      [len(prompts), L, text_dim] in the model dtype (diffusers casts to the transformer dtype).
    """
    ids, mask = tokenization.tokenize(self.tokenizer, [tokenization.prompt_clean(p) for p in prompts],
                                      max_sequence_length)
    text_mesh = getattr(self, "_text_mesh", None)
    if text_mesh is not None:  # sharded text encoder weights (`_place` with shard_weights)
      ids, mask = distributed.put_replicated((np.asarray(ids), np.asarray(mask)), NamedSharding(text_mesh, P()))
    else:
      ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    embeds = _encode_jit(self._text_params, ids, mask, config=self.text_encoder_config)
    return _masked_text(embeds, mask).astype(self.dtype)

  def latent_shape(self, batch: int, height: int, width: int, num_frames: int) -> tuple[int, ...]:
    """[B, C, F, Hl, Wl] for a video of `num_frames` (4k+1) x height x width."""
    cfg = self.vae.config
    return (batch, self.transformer_config.in_channels, (num_frames - 1) // cfg.temporal_factor + 1,
            height // cfg.spatial_factor, width // cfg.spatial_factor)

  def check_inputs(self, prompt, negative_prompt, *, height: int, width: int, num_frames: int,
                   num_inference_steps: int, guidance_scale: float, guidance_scale_2: float | None,
                   flow_shift: float | None, seed: int | None, latents, max_sequence_length: int | None,
                   mesh, progress: bool = True, on_step: Callable[[int, float], None] | None = None,
                   attention_implementation: str = "auto", nan_guard: bool = True,
                   decode: bool = True, prompt_embeds: Any = None, negative_prompt_embeds: Any = None,
                   num_videos_per_prompt: int = 1, callback_on_step_end: Callable | None = None,
                   callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
                   attention_kwargs: dict[str, Any] | None = None, generator: Any = None,
                   step_cache: Any = None, shard_weights: bool = False,
                   attention_backend: str = "auto") -> ResolvedCall:
    """Validates a call and resolves it (no compute); `__call__` and `run` document the arguments.

    Every argument is checked for type as well as value (a bool is not an int, a str not a number,
    NaN/inf not a number either), whether or not the call would use it (e.g. `negative_prompt`
    without CFG).

    Text inputs follow diffusers' `WanPipeline.check_inputs`: exactly one of `prompt` and
    `prompt_embeds`; at most one of `negative_prompt` and `negative_prompt_embeds`; a missing
    negative is encoded from `negative_prompt` (default "") with the prompts' batch size.

    Returns:
      a `pipelines.pipeline.inputs.ResolvedCall` (its docstring lists the fields).

    Raises:
      ValueError: every bad argument, each message naming the argument, its value and the fix.
    """
    if generator is not None:
      raise ValueError(f"generator={generator!r} is not supported: noise comes from `seed` (video i of "
                       "the batch uses numpy.random.default_rng(seed + i)), so no torch generator maps "
                       "onto it; for diffusers' exact noise pass it as latents, e.g. latents=torch.randn("
                       "shape, generator=torch.Generator().manual_seed(s)) as diffusers' randn_tensor draws it")
    text_dim = self.transformer_config.text_dim
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
    if prompt_embeds is not None:
      prompts, batch = None, prompt_embeds.shape[0]
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
    per_prompt = check_int("num_videos_per_prompt", num_videos_per_prompt, hint=" (videos per prompt)")
    check_size(height, width, self.vae.config.spatial_factor * self.transformer_config.patch_size[1])
    num_frames = round_num_frames(num_frames, self.vae.config.temporal_factor)
    steps = check_int("num_inference_steps", num_inference_steps, hint="; e.g. 50")
    if max_sequence_length is None:
      max_sequence_length = self.max_sequence_length
    max_sequence_length = check_int("max_sequence_length", max_sequence_length, hint=" (Wan uses 512)")
    guidance_hint = " (Wan: 5.0; <= 1 turns CFG off)"
    g1 = check_number("guidance_scale", guidance_scale, hint=guidance_hint)
    if guidance_scale_2 is not None:
      g2 = check_number("guidance_scale_2", guidance_scale_2, hint=guidance_hint)
      if self.boundary_ratio is None:
        raise ValueError(f"{guidance_scale_2=} is only used by two-expert (Wan 2.2) pipelines; this one "
                         "has one transformer: leave it None")
    else:
      g2 = g1
    cfg = g1 > 1.0
    scheduler_config = self.scheduler_config
    if flow_shift is not None:
      shift = check_number("flow_shift", flow_shift, positive=True, hint=" (Wan: 3.0 at 480p, 5.0 at 720p)")
      field = "flow_shift" if isinstance(scheduler_config, schedulers.UniPCConfig) else "shift"
      scheduler_config = dataclasses.replace(scheduler_config, **{field: shift})
    if seed is not None:
      seed = check_int("seed", seed, minimum=0, hint=" (video i uses seed + i); or None for a random one")
    if cfg:
      # [cond; uncond] run as one batch (one forward per step), so both need the same L; diffusers
      # runs them separately, where differing L (each attended in full, no text mask) also works.
      lengths = [("prompt_embeds", None if prompt_embeds is None else prompt_embeds.shape[1]),
                 ("negative_prompt_embeds",
                  None if negative_prompt_embeds is None else negative_prompt_embeds.shape[1])]
      given = {n: l for n, l in lengths if l is not None}
      if len(set(given.values()) | ({max_sequence_length} if len(given) < 2 else set())) > 1:
        what = ", ".join(f"{n} L={l}" for n, l in given.items())
        raise ValueError(f"{what} but classifier-free guidance needs the prompt's and the negative "
                         f"prompt's text states at one length (the encoded one is max_sequence_length="
                         f"{max_sequence_length}); pass max_sequence_length equal to the embeds' L, or "
                         "both embeds with the same L")
    shape = self.latent_shape(batch * per_prompt, height, width, num_frames)
    if latents is not None:
      latents = noise_array(latents)
      if seed is not None:
        raise ValueError(f"give either seed ({seed=}) or latents, not both")
      if latents.shape != shape:
        raise ValueError(f"latents.shape={latents.shape} must be [B, C, F, Hl, Wl]={shape} for "
                         f"{batch} prompt(s) x {per_prompt} video(s), {num_frames} frames at {height}x{width}")
      if not np.isfinite(latents).all():
        raise ValueError(f"latents hold {int((~np.isfinite(latents)).sum())} NaN/inf values; pass "
                         "finite noise (or a seed)")
    elif seed is None:
      if jax.process_count() > 1:
        raise ValueError("a multi-process run needs an explicit seed (or latents) so that every "
                         "process draws the same noise; pass seed=...")
      seed = int(np.random.SeedSequence().entropy % (2 ** 31))
    if not isinstance(attention_implementation, str) or attention_implementation not in IMPLEMENTATIONS:
      raise ValueError(f"unknown {attention_implementation=}; expected one of {IMPLEMENTATIONS}")
    if not isinstance(attention_backend, str) or attention_backend not in BACKENDS:
      raise ValueError(f"unknown {attention_backend=}; expected one of {BACKENDS}")
    if on_step is not None and not callable(on_step):
      raise ValueError(f"on_step={on_step!r} must be None or a callable on_step(step, seconds)"
                       f"{not_a(on_step)}")
    for name, flag in (("progress", progress), ("nan_guard", nan_guard), ("decode", decode)):
      check_flag(name, flag)
    if callback_on_step_end is not None and not callable(callback_on_step_end):
      raise ValueError(f"callback_on_step_end={callback_on_step_end!r} must be None or a callable "
                       f"callback(pipe, step_index, timestep, callback_kwargs) -> dict{not_a(callback_on_step_end)}")
    tensor_inputs = callback_on_step_end_tensor_inputs
    if (not isinstance(tensor_inputs, (list, tuple))
        or any(not isinstance(k, str) or k not in CALLBACK_TENSOR_INPUTS for k in tensor_inputs)):
      bad = (tensor_inputs if not isinstance(tensor_inputs, (list, tuple))
             else [k for k in tensor_inputs if not isinstance(k, str) or k not in CALLBACK_TENSOR_INPUTS])
      raise ValueError(f"callback_on_step_end_tensor_inputs={tensor_inputs!r} must be a list of names "
                       f"from {list(CALLBACK_TENSOR_INPUTS)}; not allowed: {bad!r}")
    lora_scale = None
    if attention_kwargs is not None:
      if not isinstance(attention_kwargs, dict):
        raise ValueError(f"attention_kwargs={attention_kwargs!r} must be None or a dict like "
                         f"{{'scale': 0.8}}{not_a(attention_kwargs)}")
      unknown = [k for k in attention_kwargs if k != "scale"]
      if unknown:
        raise ValueError(f"attention_kwargs={attention_kwargs!r}: keys {unknown!r} are not supported; the "
                         "only key is 'scale' (the LoRA scale; diffusers passes other keys to its "
                         "attention processors)")
      if "scale" in attention_kwargs:
        scale = attention_kwargs["scale"]
        if not is_real(scale) or not math.isfinite(scale):
          raise ValueError(f"attention_kwargs={attention_kwargs!r}: 'scale' must be a finite number (the "
                           f"LoRA scale; 1.0 = as loaded){not_a(scale, is_real(scale))}")
        lora_scale = float(scale)
    cache_spec = wan_step_cache.parse_step_cache(step_cache, model=self.name)
    check_flag("shard_weights", shard_weights)
    mesh, mesh_spec = resolve_mesh(mesh, heads=self.transformer_config.num_attention_heads, cfg_active=cfg,
                                   shard_weights=shard_weights)
    return ResolvedCall(mesh_spec=mesh_spec, prompts=prompts, negative_prompts=negatives if cfg else None,
                prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds if cfg else None,
                num_videos_per_prompt=per_prompt, videos=batch * per_prompt, height=int(height),
                width=int(width), num_frames=num_frames, steps=steps, guidance=(g1, g2), cfg=cfg,
                scheduler=scheduler_config, seed=None if latents is not None else seed,
                latents=latents, latent_shape=shape, max_sequence_length=max_sequence_length,
                mesh=mesh, callback=callback_on_step_end, callback_tensor_inputs=list(tensor_inputs),
                lora_scale=lora_scale, step_cache=cache_spec)

  # --- the call ---

  def __call__(self, prompt: str | Sequence[str] | None = None,
               negative_prompt: str | Sequence[str] | None = None, height: int = 480, width: int = 832,
               num_frames: int = 81, num_inference_steps: int = 50, guidance_scale: float = 5.0,
               seed: int | None = None, latents: Any = None, max_sequence_length: int | None = None,
               mesh: Mesh | str | None = None, *, guidance_scale_2: float | None = None,
               flow_shift: float | None = None, progress: bool = True, nan_guard: bool = True,
               prompt_embeds: Any = None, negative_prompt_embeds: Any = None,
               num_videos_per_prompt: int = 1, output_type: str = "np",
               callback_on_step_end: Callable[[Any, int, Any, dict[str, Any]], dict[str, Any]] | None = None,
               callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
               attention_kwargs: dict[str, Any] | None = None, generator: Any = None,
               checkpoint_dir: str | None = None, checkpoint_every: int = 1, resume: bool = False,
               keep_checkpoint: bool = False, step_cache: Any = None, shard_weights: bool = False,
               vae_parallel: bool = True, attention_backend: str = "auto") -> Any:
    """Generates videos; diffusers `WanPipeline.__call__(...).frames` with the same argument names.

    Args:
      prompt: one prompt or a list (B prompts); None when `prompt_embeds` is given.
      negative_prompt: str or list of B str; default "" (used only with guidance_scale > 1).
      height, width: multiples of 16.
      num_frames: 4k + 1; other counts become num_frames // 4 * 4 + 1 (16 -> 17, 10 -> 9) with a
        warning, as diffusers does.
      num_inference_steps: scheduler steps.
      guidance_scale: CFG scale (of `transformer`, the high-noise expert, for Wan 2.2); <= 1 turns
        the unconditional pass off.
      seed: noise seed: video i of the B x num_videos_per_prompt batch (prompt-major: prompt p's
        video j is row p * num_videos_per_prompt + j) uses numpy.random.default_rng(seed + i); None
        draws one (reported in `run(...).settings`).
      latents: explicit float32 noise [B x num_videos_per_prompt, C, F, Hl, Wl] (diffusers'
        `latents`) instead of a seed.
      max_sequence_length: L, text tokens (prompts truncated / zero-padded to it), as diffusers;
        None: the pipeline's `max_sequence_length` (512, as diffusers, unless the folder's
        tokenizer says a shorter `model_max_length`: the length the model was trained with).
        Embeds given as `prompt_embeds` keep their own L.
      mesh: None (one device), a spec string ("U=2,R=2"; "CFG=2,U=2,R=2" runs the cond and uncond
        halves of the batch on the two halves of the devices), an `attention.MeshSpec`, or a built
        (cfg, ring, ulysses) `jax.sharding.Mesh` (`MeshSpec(...).build()`).
      guidance_scale_2: the low-noise expert's scale (two-expert pipelines); default guidance_scale.
      flow_shift: overrides the scheduler config's shift.
      progress: on stderr, one line as text encoding, compiling and decoding start and a tqdm bar
        over the denoising steps (as diffusers' bar); False for silence.
      nan_guard: stop with `NonFiniteLatentsError` at the first step whose latents hold NaN/inf.
      prompt_embeds: precomputed text states [B, L, text_dim] (numpy, JAX or CPU torch; e.g.
        diffusers' `encode_prompt(...)[0]`, zero past each prompt's length) used as given (cast to
        the model dtype) instead of encoding `prompt`, which must then be None.
      negative_prompt_embeds: [B, L, text_dim] likewise for the unconditional pass; without it the
        negative prompt (default "") is encoded. Under CFG both must have the same L (cond and
        uncond run as one batch here; see `check_inputs`).
      num_videos_per_prompt: videos per prompt: each prompt's (and negative prompt's) text states
        are repeated that many times, prompt-major, as diffusers' `encode_prompt`. Given embeds are
        repeated too (diffusers' Wan pipeline repeats only those it encodes, so there a batch of
        given embeds with num_videos_per_prompt > 1 does not run).
      output_type: "np" (default): float32 [B', frames, height, width, 3] in [0, 1]; "latent": the
        final latents float32 [B', C, F, Hl, Wl], not decoded (diffusers returns them likewise,
        before de-normalisation); "pil": B' lists of `frames` RGB `PIL.Image`s (diffusers'
        rounding, `frames_to_pil`). B' = B x num_videos_per_prompt.
      callback_on_step_end: diffusers' `callback(pipe, step_index, timestep, callback_kwargs) ->
        dict`, called after each denoising step with this pipeline, the step index k, the step's
        timestep (numpy scalar, `schedule.timesteps[k]`) and a dict of the tensors named in
        `callback_on_step_end_tensor_inputs`, as JAX arrays replicated over the mesh: "latents"
        float32 [B', C, F, Hl, Wl] (a copy, safe to keep: the next step donates the pipeline's
        own buffer), "prompt_embeds" [B', L, text_dim] and "negative_prompt_embeds" (None without
        CFG) in the model dtype. In the dict it returns, "latents" / "prompt_embeds" /
        "negative_prompt_embeds" replace the pipeline's (any array type; same shape, finite, else
        ValueError; put back replicated); other keys are ignored, as diffusers does. To stop early,
        set `pipe._interrupt = True` in the callback (diffusers' `interrupt`): the remaining steps
        are skipped (no compute, no callback) and the latents reached so far are still decoded.
        In a multi-process run every process calls it and must return the same values.
      callback_on_step_end_tensor_inputs: names from `CALLBACK_TENSOR_INPUTS`; default
        ["latents"] as diffusers.
      attention_kwargs: None or {"scale": s}: the LoRA scale for this call only (diffusers scales
        its PEFT LoRA layers by s during the call). With no LoRA loaded it does nothing, silently,
        as diffusers with PEFT; otherwise `self._set_lora_scale(s)` (when the pipeline has that
        hook) is called before the denoising loop and `self._set_lora_scale(1.0)` after it. Other
        keys raise ValueError (diffusers passes them to attention processors, which Wan has none
        of here).
      generator: not supported (ValueError): noise comes from `seed`, not from torch generators.
        For diffusers' exact noise, draw it as diffusers' `randn_tensor` does, e.g.
        `torch.randn(shape, generator=torch.Generator().manual_seed(s))`, and pass it as `latents`.
      checkpoint_dir, checkpoint_every, resume, keep_checkpoint: resumable denoising (not in
        diffusers): the state is saved to `checkpoint_dir` every `checkpoint_every` steps, and
        `resume=True` continues a saved run there; see `run`.
      step_cache: None (off), "first-block:THRESH" (first-block residual cache, e.g.
        "first-block:0.05") or "mag:THRESH[:K][@RATIOS.json]" (MagCache; without a file, the
        tiny model's shipped calibration), or a `step_cache.StepCacheSpec` (not in diffusers,
        whose pipelines take these as hooks): steps whose change measure stays below THRESH reuse
        a cached residual instead of running the transformer's blocks
        (pipelines/wan/step_cache.py). The skipped steps are in `run(...).settings`.
      shard_weights: split the transformer's block weights over all devices of the mesh (FSDP /
        ZeRO-3: each layer's weights are all-gathered inside the layer scan), so a model too big to
        replicate on every device fits; same video. Needs a mesh.
      vae_parallel: with a mesh, decode on all of its devices, the latents split along height
        (`vae.decode_parallel`; the same video up to fp32 rounding); False decodes on one device.
        Without a mesh the decode is on one device either way.
      attention_backend: "auto" (the Pallas kernels of `attention/kernels.py` on TPU and GPU, XLA
        loops elsewhere), "xla" or "pallas" (on CPU: Pallas interpret mode, slow, for checks). Not
        in diffusers; same video either way.

    Returns:
      as `output_type`: float32 numpy [B', frames, height, width, 3] in [0, 1] ("np"), float32
      numpy [B', C, F, Hl, Wl] ("latent"), or a list of B' lists of PIL images ("pil").

    Raises:
      ValueError: see `check_inputs` and `output_type` (raised before any compute); a callback's
        return value that is not a dict or holds a replacement of the wrong shape or non-finite.
      NonFiniteLatentsError: see `nan_guard`.
    """
    check_output_type(output_type)
    if output_type == "pil":
      import PIL.Image  # noqa: F401  (fails now, not after the run, if pillow is missing)
    result = self.run(prompt, negative_prompt, height, width, num_frames, num_inference_steps,
                      guidance_scale, seed, latents, max_sequence_length, mesh,
                      guidance_scale_2=guidance_scale_2, flow_shift=flow_shift, progress=progress,
                      nan_guard=nan_guard, decode=output_type != "latent", prompt_embeds=prompt_embeds,
                      negative_prompt_embeds=negative_prompt_embeds,
                      num_videos_per_prompt=num_videos_per_prompt,
                      callback_on_step_end=callback_on_step_end,
                      callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
                      attention_kwargs=attention_kwargs, generator=generator,
                      checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume,
                      keep_checkpoint=keep_checkpoint, step_cache=step_cache, shard_weights=shard_weights,
                      vae_parallel=vae_parallel, attention_backend=attention_backend)
    if output_type == "latent":
      return result.latents
    return frames_to_pil(result.frames) if output_type == "pil" else result.frames

  @property
  def interrupt(self) -> bool:
    """diffusers' `interrupt`: set `pipe._interrupt = True` (e.g. in `callback_on_step_end`) to skip
    the remaining denoising steps of the current call; reset to False as each call starts."""
    return getattr(self, "_interrupt", False)

  @property
  def num_timesteps(self) -> int | None:
    """diffusers' `num_timesteps`: the current (or last) call's number of denoising steps."""
    return getattr(self, "_num_timesteps", None)

  @property
  def current_timestep(self) -> Any:
    """diffusers' `current_timestep`: the step's timestep during denoising, None outside it."""
    return getattr(self, "_current_timestep", None)

  def run(self, prompt=None, negative_prompt=None, height: int = 480, width: int = 832, num_frames: int = 81,
          num_inference_steps: int = 50, guidance_scale: float = 5.0, seed: int | None = None,
          latents: Any = None, max_sequence_length: int | None = None, mesh: Mesh | str | None = None, *,
          guidance_scale_2: float | None = None, flow_shift: float | None = None,
          progress: bool = True, on_step: Callable[[int, float], None] | None = None,
          attention_implementation: str = "auto", nan_guard: bool = True,
          decode: bool = True, prompt_embeds: Any = None, negative_prompt_embeds: Any = None,
          num_videos_per_prompt: int = 1, callback_on_step_end: Callable | None = None,
          callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
          attention_kwargs: dict[str, Any] | None = None, generator: Any = None,
          checkpoint_dir: str | None = None, checkpoint_every: int = 1, resume: bool = False,
          keep_checkpoint: bool = False, step_cache: Any = None,
          shard_weights: bool = False, vae_parallel: bool = True,
          attention_backend: str = "auto") -> GenerationResult:
    """`__call__` returning frames with timings and the resolved settings (`GenerationResult`).

    The diffusers-named arguments (`prompt_embeds`, `num_videos_per_prompt`,
    `callback_on_step_end`, `attention_kwargs`, ...) mean what `__call__` says; `output_type` is
    `__call__`'s (here `decode=False` gives the latents only).

    `on_step(k, seconds)` is called after each denoising step. `attention_implementation`
    ("auto" | "lse" | "fixed_m") picks the transformer's attention path and `attention_backend`
    ("auto" | "xla" | "pallas", see `__call__`) its kernels (both part of the compiled step's
    cache key; "auto" is resolved for the mesh's platform and recorded in `settings`). `nan_guard` (default on) stops the run with `NonFiniteLatentsError` after
    the first step whose latents hold NaN/inf, instead of decoding garbage; the check is a flag the
    compiled step returns anyway, so turning it off saves only a scalar read per step.
    `decode=False` skips the VAE (`frames` is None): for the processes of a multi-process run
    that do not write the video. `step_cache` (see `__call__`) is recorded in
    `settings["step_cache"]` with the skipped steps (`step_cache.summary`; None when off); the
    cache restarts at an expert switch, and its state is part of a denoising checkpoint (so a
    resumed cached run gives the uninterrupted cached run's video).

    Multi-process runs (`pipelines.parallel.distributed.initialize` first, then the same call with the
    same seed on every process): the mesh must span all processes' devices; inputs become global
    arrays built from each process's identical host copy; every process returns the result.

    `vae_parallel` (default True) decodes on every device of the call's mesh, the latents split
    along height (`vae.decode_parallel`: the VAE's activations, cache and time spread over the
    devices; the same video up to fp32 rounding); False, or no mesh, decodes on one device.

    Resumable denoising (`pipelines.pipeline.resume`): with `checkpoint_dir`, the denoising state (latents,
    solver state, step, and the run's identity: settings, noise digest, model fingerprint) is
    written atomically to `checkpoint_dir/denoise_state.safetensors` after every
    `checkpoint_every`-th step and after the last, off the critical path (device copy, then host
    copy and write on a thread while the next step runs; process 0 only). `resume=True` continues
    from the checkpoint there: every setting that decides the video must match it (the mesh need
    not), and the video equals the uninterrupted run's. Without `resume`, a checkpoint already in
    `checkpoint_dir` is an error (it is never overwritten silently). After a run that did every
    step the checkpoint is removed unless `keep_checkpoint` (a run stopped early by a callback's
    `_interrupt` keeps it, so it can be resumed).

    Raises:
      ValueError: see `check_inputs` (raised before any compute).
      resume_state.ResumeError (pipelines.pipeline.resume): `resume` without a checkpoint, a checkpoint of another run (naming each
        difference), or one in the way of a new run; raised before any denoising.
      NonFiniteLatentsError: latents became NaN/inf (with `nan_guard`), naming the step.
    """
    if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
      raise ValueError(f"checkpoint_dir={checkpoint_dir!r} must be None or a folder path{not_a(checkpoint_dir)}")
    checkpoint_every = check_int("checkpoint_every", checkpoint_every, hint=" (steps between checkpoints)")
    for name, flag in (("resume", resume), ("keep_checkpoint", keep_checkpoint), ("vae_parallel", vae_parallel)):
      check_flag(name, flag)
    if resume and checkpoint_dir is None:
      raise ValueError("resume=True needs checkpoint_dir (the folder holding the checkpoint)")
    s = self.check_inputs(prompt, negative_prompt, height=height, width=width, num_frames=num_frames,
                          num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                          guidance_scale_2=guidance_scale_2, flow_shift=flow_shift, seed=seed,
                          latents=latents, max_sequence_length=max_sequence_length, mesh=mesh,
                          progress=progress, on_step=on_step, attention_implementation=attention_implementation,
                          nan_guard=nan_guard, decode=decode, prompt_embeds=prompt_embeds,
                          negative_prompt_embeds=negative_prompt_embeds,
                          num_videos_per_prompt=num_videos_per_prompt,
                          callback_on_step_end=callback_on_step_end,
                          callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
                          attention_kwargs=attention_kwargs, generator=generator, step_cache=step_cache,
                          shard_weights=shard_weights, attention_backend=attention_backend)
    mesh = s.mesh
    attention_backend = resolve_backend(attention_backend, jax.default_backend() if mesh is None
                                        else mesh.devices.flat[0].platform)
    self._interrupt = False  # diffusers: reset as each call starts; a callback may set it
    self._num_timesteps = s.steps
    timings: dict[str, float] = {}
    start_all = time.perf_counter()

    def stage(text: str) -> None:  # with `progress`: one line on stderr as a stage starts
      if progress:
        print(text, file=sys.stderr, flush=True)

    latents = s.latents
    if latents is None:
      latents = np.concatenate([np.random.default_rng(s.seed + i).standard_normal((1, *s.latent_shape[1:]),
                                                                                      np.float32)
                                for i in range(s.videos)])
    schedule = s.scheduler.set_timesteps(s.steps)
    solver = schedule.init_state(latents.shape, jnp.float32)
    first_step, writer, restored = 0, None, None
    if checkpoint_dir is not None:
      checkpoint_dir = os.fspath(checkpoint_dir)
      identity = self._run_identity(s, latents, attention_implementation)
      saved = resume_state.read(checkpoint_dir)
      if resume:
        if saved is None:
          raise resume_state.ResumeError(f"resume=True but {checkpoint_dir!r} holds no denoising checkpoint "
                                   f"({resume_state.STATE_FILE}); run without resume to start over")
        differences = saved.differences(identity)
        if differences:
          raise resume_state.ResumeError(f"the checkpoint in {checkpoint_dir!r} is from another run; "
                                   + "; ".join(differences))
        latents, solver = saved.restore("latents", latents), saved.restore("solver", solver)
        first_step, restored = saved.step, saved
        stage(f"resume: {first_step} of {s.steps} steps done (checkpoint in {checkpoint_dir})")
      elif saved is not None:
        raise resume_state.ResumeError(f"{checkpoint_dir!r} already holds a denoising checkpoint (step "
                                 f"{saved.step}); pass resume=True (generate --resume) to continue it, "
                                 "or remove it to start over")
      writer = resume_state.Writer(checkpoint_dir, identity, enabled=distributed.is_main_process())

    mesh_spec = s.mesh_spec
    self._place(mesh, mesh_spec.shard_weights)  # before text encoding: its weights may be sharded too
    start = time.perf_counter()
    texts = (s.prompts or []) + (s.negative_prompts or [])
    stage(f"text encode: {len(texts)} prompt(s) x {s.max_sequence_length} tokens" if texts
          else "text encode: none (text states given)")
    text = jax.block_until_ready(self._text_states(s))
    timings["text_encode"] = time.perf_counter() - start
    replicated = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if mesh is None
                  else NamedSharding(mesh, P()))
    latents, solver, text = distributed.put_replicated((latents, solver, text), replicated)

    boundary = (None if self.boundary_ratio is None
                else self.boundary_ratio * s.scheduler.num_train_timesteps)
    experts = [0 if boundary is None or t >= boundary else 1 for t in schedule.timesteps]
    guidance = [distributed.put_replicated(np.float32(s.guidance[e]), replicated) for e in experts]
    cache = None
    tokens = math.prod(n // p for n, p in zip(s.latent_shape[2:], self.transformer_config.patch_size))
    if s.step_cache is not None:
      cache = wan_step_cache.init_state(
          s.step_cache, rows=s.videos * (2 if s.cfg else 1), tokens=tokens,
          config=self.transformer_config, dtype=self.dtype, steps=s.steps, mesh=mesh)
      if restored is not None:
        cache = wan_step_cache.place(restored.restore(
            "step_cache", wan_step_cache.checkpoint_template(cache, tokens=tokens)), cache)

    start = time.perf_counter()
    compiling = (f"compile: the denoise step ({tokens} tokens, {self.transformer_config.num_layers} "
                 f"layers, mesh {mesh_spec}{', weights sharded' if mesh_spec.shard_weights else ''})")
    step = self._compiled_step(self._experts[experts[0]], latents, solver, text, guidance[0], cache, mesh=mesh,
                               cfg=s.cfg, attention_implementation=attention_implementation,
                               attention_backend=attention_backend,
                               gather_weights=mesh_spec.shard_weights, on_compile=lambda: stage(compiling))
    timings["compile"] = time.perf_counter() - start

    step_times = []
    cache_stats = []  # (step, stats) per step run, read after the loop (no extra sync)
    bar = None
    if progress:
      from tqdm.auto import tqdm
      bar = tqdm(total=s.steps, initial=first_step, desc="denoise", unit="step")
    set_lora_scale = (getattr(self, "_set_lora_scale", None)
                      if s.lora_scale not in (None, 1.0) else None)
    if set_lora_scale is not None:  # the LoRA scale of attention_kwargs, for this call only
      set_lora_scale(s.lora_scale)
      self._place(mesh, mesh_spec.shard_weights)
    try:
      for k, expert in enumerate(experts):
        if k < first_step:  # done before the checkpoint this run resumes from
          continue
        if self._interrupt:  # diffusers: the remaining steps are skipped; the latents still decode
          continue
        self._current_timestep = schedule.timesteps[k]
        start = time.perf_counter()
        if cache is not None and k and expert != experts[k - 1]:
          cache = wan_step_cache.reset(cache)
        latents, solver, finite, cache, stats = step(self._experts[expert], latents, solver, text,
                                                     guidance[k], cache)
        if cache is not None:
          cache_stats.append((k, stats))
        jax.block_until_ready(latents)
        if nan_guard and not bool(distributed.to_host(finite)):
          raise NonFiniteLatentsError(
              f"latents hold NaN/inf after denoising step {k + 1}/{s.steps} (timestep "
              f"{float(schedule.timesteps[k]):.1f}, expert {expert}); stopped before decoding, "
              "nothing was written. Usual causes: NaN/inf in the weights, or overflow in bfloat16 "
              "(try dtype='float32'); nan_guard=False (generate --no-nan-guard) lets it finish anyway")
        if writer is not None and ((k + 1) % checkpoint_every == 0 or k + 1 == len(experts)):
          state = {"latents": latents, "solver": solver}
          if cache is not None:
            state["step_cache"] = wan_step_cache.for_checkpoint(cache, tokens=tokens, mesh=mesh)
          writer.save(k + 1, state)
        step_times.append(time.perf_counter() - start)
        if s.callback is not None:
          latents, text = self._step_end_callback(s, k, schedule.timesteps[k], latents, text, replicated)
        if bar is not None:
          bar.update(1)
        if on_step is not None:
          on_step(k, step_times[-1])
    finally:
      self._current_timestep = None
      if bar is not None:
        bar.close()
      if writer is not None:
        writer.close()  # the last state is on disk before anything else can fail
      if set_lora_scale is not None:
        set_lora_scale(1.0)
    timings["denoise"] = float(sum(step_times))
    timings["denoise_per_step"] = float(np.mean(step_times)) if step_times else 0.0

    start = time.perf_counter()
    latents = distributed.to_host(latents)
    if decode:
      stage(f"decode: {s.videos} video(s) of {s.num_frames} frames {s.width}x{s.height} (VAE)")
    frames = self.decode(latents, mesh=mesh if vae_parallel else None) if decode else None
    timings["decode"] = time.perf_counter() - start
    timings["total"] = time.perf_counter() - start_all
    settings = {k: getattr(s, k) for k in ("height", "width", "num_frames", "steps", "cfg", "seed",
                                  "max_sequence_length")}
    settings.update(
        prompts=s.prompts, negative_prompts=s.negative_prompts, guidance_scale=s.guidance[0],
        guidance_scale_2=s.guidance[1] if self.boundary_ratio is not None else None,
        scheduler=dataclasses.asdict(s.scheduler) | {"class": type(s.scheduler).__name__},
        experts_per_step=experts, boundary_ratio=self.boundary_ratio, dtype=jnp.dtype(self.dtype).name,
        mesh=None if mesh is None else mesh_spec.describe(),
        explicit_latents=s.latents is not None, attention_implementation=attention_implementation,
        attention_backend=attention_backend,
        resumed_from_step=first_step if resume else None,
        num_videos_per_prompt=s.num_videos_per_prompt, prompt_embeds_given=s.prompt_embeds is not None,
        negative_prompt_embeds_given=s.negative_prompt_embeds is not None, steps_run=len(step_times),
        lora_scale=s.lora_scale, vae_parallel=bool(vae_parallel and mesh is not None),
        step_cache=None if cache is None else wan_step_cache.summary(
            s.step_cache, [(k, bool(distributed.to_host(c["skipped"])),
                               float(distributed.to_host(c["metric"]))) for k, c in cache_stats],
            num_layers=self.transformer_config.num_layers))
    if (checkpoint_dir is not None and not keep_checkpoint and not self._interrupt
        and distributed.is_main_process()):
      resume_state.remove(checkpoint_dir)  # kept when a callback stopped the run early
    return GenerationResult(frames=frames, latents=latents, timings=timings, settings=settings)

  def _text_states(self, s: ResolvedCall) -> jax.Array:
    """The denoiser's text input for a resolved call (`check_inputs`): [B', L, text_dim], or under
    CFG [2 B', L, text_dim] (cond rows, then uncond rows), in the model dtype; B' = B x
    num_videos_per_prompt. Given embeds are used as they are (cast to the model dtype, as
    diffusers' `.to(transformer_dtype)`); the rest are encoded; then each prompt's row is repeated
    num_videos_per_prompt times in place (diffusers' `repeat(1, n, 1).view(B * n, L, -1)`)."""
    texts = (s.prompts or []) + (s.negative_prompts or [])
    encoded = self.encode_prompts(texts, s.max_sequence_length) if texts else None
    parts, used = [], 0
    for given, names in ((s.prompt_embeds, s.prompts),
                         (s.negative_prompt_embeds, s.negative_prompts)):
      if given is not None:
        parts.append(jnp.asarray(given).astype(self.dtype))
      elif names is not None:
        parts.append(encoded[used:used + len(names)])
        used += len(names)
    per_prompt = s.num_videos_per_prompt
    return jnp.concatenate([part if per_prompt == 1 else jnp.repeat(part, per_prompt, axis=0)
                            for part in parts])

  def _step_end_callback(self, s: ResolvedCall, k: int, timestep: Any, latents: jax.Array,
                         text: jax.Array, sharding: Any) -> tuple[jax.Array, jax.Array]:
    """Calls the call's `callback_on_step_end` after step k (diffusers' contract; `__call__`
    documents it) and returns (latents, text) with the callback's replacements put on `sharding`.

    Raises:
      ValueError: the callback returned something other than a dict, or a replacement that is not a
        real array of the current shape, or holds NaN/inf.
    """
    videos = s.videos
    available = {"latents": lambda: jnp.copy(latents),  # a copy: the next step donates `latents`
                 "prompt_embeds": lambda: text[:videos],
                 "negative_prompt_embeds": lambda: text[videos:] if s.cfg else None}
    given = {name: available[name]() for name in s.callback_tensor_inputs}
    out = s.callback(self, k, timestep, dict(given))
    if not isinstance(out, dict):
      raise ValueError(f"callback_on_step_end returned {reprlib.repr(out)} after step {k}; it must return "
                       "a dict (diffusers' contract): its callback_kwargs, replacements, or {} for none")

    def replacement(name: str, shape: tuple[int, ...]) -> np.ndarray | None:
      value = out.get(name)
      if value is None or value is given.get(name):
        return None
      array = host_array(value)
      if array is None or array.shape != shape or not np.isfinite(array).all():
        what = ("not an array of real numbers" if array is None else f"shape {array.shape}"
                if array.shape != shape else f"{int((~np.isfinite(array)).sum())} NaN/inf values")
        raise ValueError(f"callback_on_step_end returned {name} ({what}) after step {k}; a replacement "
                         f"must be a finite array of the current shape {shape}")
      return array

    new_latents = replacement("latents", tuple(latents.shape))
    if new_latents is not None:
      latents = distributed.put_replicated(new_latents.astype(np.float32), sharding)
    rows = (videos, *text.shape[1:])
    cond = replacement("prompt_embeds", rows)
    uncond = replacement("negative_prompt_embeds", rows) if s.cfg else None
    if cond is not None or uncond is not None:
      host = distributed.to_host(text).copy()
      for part, start in ((cond, 0), (uncond, videos)):
        if part is not None:
          host[start:start + videos] = np.asarray(jnp.asarray(part).astype(text.dtype))
      text = distributed.put_replicated(host, sharding)
    return latents, text

  def fingerprint(self) -> str:
    """SHA-256 (hex) of this pipeline's model: configs, dtypes and sampled values of every weight
    (`resume.model_fingerprint`); computed again only after the weights change (a LoRA fused)."""
    cached = getattr(self, "_fingerprint", None)
    if cached is None or cached[0] != self._weights_version:
      config = {"transformer": dataclasses.asdict(self.transformer_config),
                "text_encoder": dataclasses.asdict(self.text_encoder_config),
                "vae": dataclasses.asdict(self.vae.config), "dtype": jnp.dtype(self.dtype).name,
                "vae_dtype": jnp.dtype(self.vae.dtype).name, "boundary_ratio": self.boundary_ratio}
      trees = {f"transformer{i or ''}": state for i, state in enumerate(self._experts)}
      trees.update(text_encoder=self._text_params, vae=self.vae)
      self._fingerprint = (self._weights_version, resume_state.model_fingerprint(trees, config))
    return self._fingerprint[1]

  def _run_identity(self, s: ResolvedCall, noise: np.ndarray, attention_implementation: str) -> dict[str, Any]:
    """What a denoising checkpoint must match to be resumed by this call (`pipelines.pipeline.resume`)."""
    del attention_implementation  # a numerics choice: either path gives the same video
    return {
        "model": self.name, "model_fingerprint": self.fingerprint(),
        "prompts": s.prompts, "negative_prompts": s.negative_prompts,
        "height": s.height, "width": s.width, "num_frames": s.num_frames,
        "num_inference_steps": s.steps, "guidance_scale": list(s.guidance), "cfg": s.cfg,
        "scheduler": dataclasses.asdict(s.scheduler) | {"class": type(s.scheduler).__name__},
        "max_sequence_length": s.max_sequence_length, "dtype": jnp.dtype(self.dtype).name,
        "noise_sha256": resume_state.noise_digest(noise),
        "num_videos_per_prompt": s.num_videos_per_prompt, "lora_scale": s.lora_scale,
        "prompt_embeds_sha256": _digest(s.prompt_embeds),
        "negative_prompt_embeds_sha256": _digest(s.negative_prompt_embeds),
    } | ({} if s.step_cache is None else {"step_cache": s.step_cache.identity()})

  def decode(self, latents: np.ndarray, mesh: Mesh | None = None) -> np.ndarray:
    """Diffusion latents float32 [B, C, F, Hl, Wl] -> float32 numpy [B, frames, H, W, 3] in [0, 1].

    One video at a time (the VAE treats videos independently): the decoder compiles once per
    spatial size whatever B, and only one video's activations are live. With a `mesh`, each video
    is decoded split along height over the mesh's devices (`vae.decode_parallel`; in a
    multi-process run, this process's devices), each time chunk copied to the host as it is done.
    """
    videos = []
    height = latents.shape[3] * self.vae.config.spatial_factor
    if mesh is not None and wan_vae.row_mesh(mesh).size == 1:
      mesh = None  # one device either way: the unsplit programs
    for one in np.asarray(latents)[:, None]:
      z = wan_vae.denormalize_latents(self.vae.config, jnp.asarray(one).astype(self.vae.dtype))
      if mesh is None:
        videos.append(np.asarray(_to_unit_range(wan_vae.decode(self.vae, z, video_layout="BFHWC"))))
        continue
      vae = self._placed_vae(mesh)
      chunks = [np.asarray(_to_unit_range(c))[:, :, :height] for c in wan_vae.decode_parallel_chunks(vae, z, mesh)]
      videos.append(np.concatenate(chunks, axis=1))
    return np.concatenate(videos)

  def _placed_vae(self, mesh: Mesh) -> wan_vae.WanVAE:
    """The VAE's weights replicated over the decode's devices, placed once per device set."""
    rows = wan_vae.row_mesh(mesh)
    key = tuple(d.id for d in rows.devices.flat)
    key = (id(self.vae), key)
    if getattr(self, "_vae_placement", (None,))[0] != key:
      self._vae_placement = (key, jax.device_put(self.vae, NamedSharding(rows, P())))
    return self._vae_placement[1]


def _digest(array: Any) -> str | None:
  """SHA-256 (hex) of a host array's shape, dtype and bytes; None for None."""
  if array is None:
    return None
  import hashlib
  host = np.ascontiguousarray(np.asarray(array))
  return hashlib.sha256(f"{host.shape}{host.dtype}".encode() + host.tobytes()).hexdigest()


def _dtype(name: str) -> jnp.dtype:
  if name not in DTYPES:
    raise ValueError(f"dtype={name!r} is not supported; use one of {sorted(DTYPES)}")
  return DTYPES[name]
