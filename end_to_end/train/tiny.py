"""Trains the tiny Wan on the synthetic shapes world (`end_to_end.train.synthetic_world`).

    python -m end_to_end.train.tiny --out DIR [--seed S] [--minutes M]

With the product's own model code (pipelines/wan/*):
1. the VAE (`AutoencoderKLWan` topology, `TINY_TRAINED_VAE`) as an autoencoder: MSE between the
   clip and the decoded encoder mean (plus Gaussian noise on the latent, so the decoder tolerates a
   diffusion model's imprecise latents, and a small L2 on the latent to bound its scale), on random
   48x48 crops of 5-frame windows, then of whole 17-frame clips (`VAE_PHASES`; convolutions are
   translation-equivariant, so crops teach the full frame at about half the cost);
2. a dataset of clips at the tiny preset's size (17 x 64 x 64) encoded with it; the per-channel
   latent mean / std become the VAE config's `latents_mean` / `latents_std` (what WanPipeline
   normalises with);
3. the transformer (`TINY_TRAINED_TRANSFORMER`) with the flow-matching objective the flow schedulers
   assume (schedulers.py; diffusers `FlowMatchEulerDiscreteScheduler` / UniPC flow sigmas):
   x_t = (1 - sigma) x0 + sigma noise, timestep = 1000 sigma, target noise - x0; sigma drawn as
   the sampler visits it (u ~ U(0, 1), then the flow shift 3: sigma = 3u / (1 + 2u)); text through
   the real path (ByT5 bytes -> the tiny UMT5 at its seeded random weights, frozen -> zero past the
   prompt's length, `MAX_SEQUENCE_LENGTH` = 64 tokens, what generation must use); the prompt replaced by "" with probability 0.1
   (classifier-free dropout: the empty prompt is what the pipeline's negative prompt encodes).
   AdamW (optax), cosine learning rate, batch 32, the residual branches' output projections
   zero-initialised (`zero_residual_outputs`); an EMA of the weights is what is shipped.

Writes into DIR: model/ (a diffusers-format folder with its `GENERATION_DEFAULTS`), loss.png (both loss curves),
samples.png (sampled frames, a row per prompt), report.json (settings, times, losses, each sample's verdict).

The time budget (--minutes, default 55) is split: VAE 25 % (--vae-fraction), dataset encoding as measured,
transformer the rest minus a reserve for sampling. On a 2-core CPU the default finishes in about
--minutes minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from end_to_end.train import run_report, synthetic_world as world
from pipelines.wan import schedulers, vae as wan_vae
from pipelines.wan.encoders import UMT5_PRESETS, UMT5Config, UMT5Params, default_tokenizer, init_umt5_params
from pipelines.parallel.plan import ParallelPlan
from pipelines.wan.pretrained import GenerationDefaults, PromptWorld
from pipelines.wan.transformer import forward, init_transformer, WanTransformerConfig
from pipelines.storage.video_io import write_json

# The trained tiny model's architecture. Patch (1, 2, 2) at 17 x 64 x 64 -> latents 5 x 8 x 8 -> 80
# tokens (measured, 2 CPU cores: batch 32 in 0.42 s, 4x the samples per second of 128 x 128's 320
# tokens, and the VAE and the encoding cost 1/4).
# 8 heads, so every Ulysses degree in {1, 2, 4, 8} divides N.
TINY_TRAINED_TRANSFORMER = WanTransformerConfig(
    patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=16, text_dim=32, ffn_dim=512, num_layers=4)
# Wan 2.1 VAE topology (4 levels: 8x spatial, 4x temporal), 4 channels at full resolution and 32 at 1/8 (measured on
# a fixed batch of crops, 100 steps: MSE 0.09 against 0.15-0.18 for 8 channels at every level, at half the step
# time); latents_mean / latents_std are replaced by the measured statistics.
TINY_TRAINED_VAE = wan_vae.WanVAEConfig(base_dim=4, dim_mult=(1, 4, 8, 8), num_res_blocks=1,
                                        latents_mean=(0.0,) * 16, latents_std=(1.0,) * 16)
TEXT_SEED = 0  # the frozen text encoder: UMT5_PRESETS["tiny"] at this seed (= pipeline.TINY_SEED)
SCHEDULER = schedulers.UniPCConfig(flow_shift=3.0)
# The folder's generation_defaults.json (what a call leaves out): the size trained at, the acceptance's 8 steps and
# guidance 2, windows that continue, the world's prompts (one outside them warns).
GENERATION_DEFAULTS = GenerationDefaults(
    height=world.HEIGHT, width=world.WIDTH, num_frames=world.FRAMES, num_inference_steps=8, guidance_scale=2.0,
    context_fuse="continue", fps=16.0, source="end_to_end/train/tiny.py GENERATION_DEFAULTS", prompt_world=PromptWorld(
        "a {colour} {shape} {motion}", (("colour", tuple(world.COLOURS)), ("shape", world.SHAPES),
                                        ("motion", tuple(world.DIRECTIONS)))))
# Text tokens per prompt, in training and in generation (the tiny default's max_sequence_length):
# the longest grammar prompt is 32 bytes + EOS. Wan's cross-attention has no mask, so the zero
# padding is attended to: at 512 tokens the ~30 real ones get a small share of each query's
# softmax and the step costs 2x more (measured, batch 8, 320 video tokens, 2 CPU cores under a
# load of ~5: 2.2 s at 512 vs 1.04 s at 64).
MAX_SEQUENCE_LENGTH = 64
CFG_DROPOUT = 0.1
VAE_CROP, VAE_FRAMES = 48, 5
# VAE training phases (frames, crop side, share of the VAE's time): short windows first (cheap
# steps learn shapes and colours), then whole 17-frame clips, so that the causal time cache the
# later chunks of a full clip go through (encode: 4 frames a chunk; decode: a latent frame a chunk)
# is trained as inference uses it.
VAE_PHASES = ((5, 48, 0.5), (17, 48, 0.5))
OBJECT_WEIGHT = 4.0  # reconstruction loss weight of pixels that differ from the background


def log(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- VAE -------------------------------------------------------------------------------------------

def autoencode(params, config: wan_vae.WanVAEConfig, x_BFHWC: jax.Array, noise_BFHWC: jax.Array | None):
  """Encoder mean -> (+ noise) -> decoder, chunked in time as `vae.encode` / `vae.decode` do.

  Args:
    x_BFHWC: float32 [B, 1 + 4k, H, W, 3] in [-1, 1].
    noise_BFHWC: None or float32 [B, 1 + k, H/8, W/8, z_dim] added to the latent mean.

  Returns:
    (reconstruction [B, 1 + 4k, H, W, 3] in [-1, 1], latent mean [B, 1 + k, H/8, W/8, z_dim]).
  """
  vae = wan_vae.WanVAE(config, params)
  h, cache = wan_vae.encode_chunk(vae, None, x_BFHWC[:, :1])
  chunks = [h]
  for start in range(1, x_BFHWC.shape[1], wan_vae.ENCODER_CHUNK):
    h, cache = wan_vae.encode_chunk(vae, cache, x_BFHWC[:, start:start + wan_vae.ENCODER_CHUNK])
    chunks.append(h)
  z = jnp.concatenate(chunks, axis=1)[..., :config.z_dim]
  zn = z if noise_BFHWC is None else z + noise_BFHWC
  y, cache = wan_vae.decode_chunk(vae, None, zn[:, :1])
  frames = [y]
  for i in range(1, zn.shape[1]):
    y, cache = wan_vae.decode_chunk(vae, cache, zn[:, i:i + 1])
    frames.append(y)
  return jnp.concatenate(frames, axis=1), z


def vae_crops(rng: np.random.Generator, batch: int, frames: int = VAE_FRAMES, crop: int = VAE_CROP
              ) -> np.ndarray:
  """float32 [batch, frames, crop, crop, 3] in [-1, 1]: windows of random clips, cropped around the
  shape (70 %) or anywhere (30 %)."""
  out = np.empty((batch, frames, crop, crop, 3), np.float32)
  H, W, F = world.HEIGHT, world.WIDTH, world.FRAMES
  for b in range(batch):
    scene = world.random_scene(rng)
    start = int(rng.integers(0, F - frames + 1))
    clip = world.render(scene, only=range(start, start + frames))
    if rng.random() < 0.7:
      cx, cy = scene.centre(start + frames // 2)
      x0 = int(cx * W - crop / 2 + rng.uniform(-crop / 3, crop / 3))
      y0 = int(cy * H - crop / 2 + rng.uniform(-crop / 3, crop / 3))
    else:
      x0, y0 = (int(rng.integers(0, n - crop + 1)) for n in (W, H))
    x0, y0 = (int(np.clip(v, 0, n - crop)) for v, n in ((x0, W), (y0, H)))
    out[b] = clip[:, y0:y0 + crop, x0:x0 + crop] * 2 - 1
  return out


def optimizer_step(opt, loss_fn, has_aux: bool = False):
  """A jitted `step(params, state, *batch, rate) -> (params, state, loss)` of `opt` (a chain whose
  second element is `optax.inject_hyperparams`) on `loss_fn(params, *batch)`, the learning rate
  set from the host each step; with `has_aux`, `loss_fn` returns (loss, aux) and so does the step."""
  @jax.jit
  def step(params, state, *args):
    *batch, rate = args
    inject = state[1]
    state = (state[0], inject._replace(hyperparams={**inject.hyperparams, "learning_rate": rate}))
    loss, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, *batch)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss
  return step


def object_weights(x_BFHWC: jax.Array, weight: float = OBJECT_WEIGHT) -> jax.Array:
  """float32 [B, F, H, W, 1] reconstruction loss weights of a clip in [-1, 1]: 1 + `weight`
  where a pixel differs from the world's background by > 0.2 in some channel, else 1. The shapes
  cover a few % of the pixels: weighting them up keeps their colour from losing to the
  background's share of a plain MSE."""
  background = jnp.asarray(world.BACKGROUND, jnp.float32) * 2 - 1
  return 1 + weight * (jnp.max(jnp.abs(x_BFHWC - background), axis=-1, keepdims=True) > 0.2)


def train_vae(seed: int, seconds: float, batch: int = 4, lr: float = 3e-3, latent_noise: float = 0.1,
              latent_l2: float = 1e-3, phases=VAE_PHASES
              ) -> tuple[wan_vae.WanVAE, list[tuple[int, float]]]:
  """Trains `TINY_TRAINED_VAE` for about `seconds`; returns it and the (step, loss) history.

  `phases`: (frames, crop, share of `seconds`) in turn; the learning rate follows the elapsed time
  (a 50-step warm-up, then a cosine to lr / 10 at `seconds`)."""
  config = TINY_TRAINED_VAE
  vae = wan_vae.init_vae(config, jax.random.key(seed))
  # Residual branches (each ResBlock's second conv, the mid-block attention's output projection)
  # start at zero, so every block starts as the identity (the usual zero-init of residual nets;
  # measured: fixed-batch reconstruction MSE 0.152 vs 0.168 after 100 steps).
  vae = wan_vae.WanVAE(config, {k: jnp.zeros_like(v) if (".conv2." in k or "attentions.0.proj" in k) else v
                                for k, v in vae.params.items()})
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adam)(learning_rate=lr))
  state = opt.init(vae.params)

  def loss_fn(params, x, noise):
    y, z = autoencode(params, config, x, noise)
    w = object_weights(x)
    return jnp.mean(w * jnp.square(y - x)) / jnp.mean(w) + latent_l2 * jnp.mean(jnp.square(z))

  step = optimizer_step(opt, loss_fn)
  rng = np.random.default_rng(seed)
  params, history, start, k = vae.params, [], time.perf_counter(), 0
  end = 0.0
  for frames, crop, share in phases:
    end += share * seconds
    latent_shape = (batch, 1 + (frames - 1) // 4, crop // 8, crop // 8, config.z_dim)
    log(f"vae phase: {frames} frames, {crop}x{crop} crops, until {end:.0f} s")
    while time.perf_counter() - start < end:
      frac = min((time.perf_counter() - start) / seconds, 1.0)
      rate = lr * min(1.0, (k + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
      x = vae_crops(rng, batch, frames, crop)
      noise = latent_noise * rng.standard_normal(latent_shape).astype(np.float32)
      params, state, loss = step(params, state, x, noise, np.float32(rate))
      history.append((k, float(loss)))
      if k % 50 == 0:
        log(f"vae step {k}: loss {history[-1][1]:.5f} ({time.perf_counter() - start:.0f} s)")
      k += 1
  return wan_vae.WanVAE(config, params), history


def encode_dataset(vae: wan_vae.WanVAE, rng: np.random.Generator, count: int, batch: int = 4
                   ) -> tuple[np.ndarray, list[str]]:
  """`count` random clips (`world.FRAMES` x `world.HEIGHT` x `world.WIDTH`), encoded: (VAE-space latent means float32
  [count, 16, 5, 8, 8], prompts)."""
  latents, prompts = [], []
  for first in range(0, count, batch):
    scenes = [world.random_scene(rng) for _ in range(min(batch, count - first))]
    clips = np.stack([world.render(s) for s in scenes]) * 2 - 1  # [b, F, H, W, 3]
    mean = wan_vae.encode(vae, jnp.asarray(clips.transpose(0, 4, 1, 2, 3))).mean
    latents.append(np.asarray(mean))
    prompts += [s.prompt for s in scenes]
  return np.concatenate(latents), prompts


# --- text ------------------------------------------------------------------------------------------

def text_encoder() -> tuple[UMT5Config, UMT5Params]:
  config = UMT5_PRESETS["tiny"]
  return config, init_umt5_params(config, TEXT_SEED)


def encode_texts(encoder, prompts: list[str]) -> np.ndarray:
  """float32 [len(prompts), MAX_SEQUENCE_LENGTH, 32]: what `WanPipeline.encode_prompts` gives."""
  from pipelines.pipeline.run.text import encode_prompts
  config, params = encoder
  return np.asarray(encode_prompts(default_tokenizer(), config, params, prompts,
                                   MAX_SEQUENCE_LENGTH, jnp.float32), np.float32)


# --- transformer -----------------------------------------------------------------------------------

def training_sigmas(u: np.ndarray, shift: float = SCHEDULER.flow_shift) -> np.ndarray:
  """Noise levels for training, distributed as the sampler visits them: u ~ U(0, 1) mapped by the
  flow shift as `UniPCConfig.set_timesteps` maps its uniform grid (sigma = s u / (1 + (s - 1) u))."""
  return (shift * u / (1 + (shift - 1) * u)).astype(np.float32)


def flow_pair(x0, noise, sigma):
  """The flow-matching training pair at noise level sigma ([B], broadcast over [B, C, F, Hl, Wl]):
  (x_t = (1 - sigma) x0 + sigma noise, target velocity noise - x0). The flow samplers
  (schedulers.py) step with x0 = x_t - sigma * v, which this target makes exact; the model sees the
  timestep 1000 sigma."""
  s = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
  return (1 - s) * x0 + s * noise, noise - x0


def given_first_frame(x0, xt, sigma, given, patch_size):
  """TI2V and continuation rows: row b's first `given[b]` latent frames ([B], 0, 1, 2, ...: a
  first frame, or a context window's overlap with the window before) are the clean x0's and their
  tokens' timestep is 0 (diffusers' `expand_timesteps` mask, widened to several frames as
  `pipelines/wan/conditioning/ti2v.py` gives them); -> (x_t [B, C, F, Hl, Wl], timestep float32
  [B, F Hl Wl / (ph pw)] in (f, h, w) token order, loss weight [B, 1, F, 1, 1]: 0 on given frames)."""
  keep = (jnp.arange(x0.shape[2])[None] < given[:, None]).astype(jnp.float32)  # [B, F]
  xt = jnp.where(keep[:, None, :, None, None] > 0, x0, xt)
  tokens = (x0.shape[3] // patch_size[1]) * (x0.shape[4] // patch_size[2])
  timestep = jnp.repeat((1 - keep) * sigma[:, None] * 1000.0, tokens, axis=1)
  return xt, timestep, (1 - keep)[:, None, :, None, None]


# Kernels zeroed at the start of training: every residual branch's output projection (self- and
# cross-attention; feed-forward and final: both named proj_out).
ZERO_INIT = ("['attn1']['to_out']['kernel']", "['attn2']['to_out']['kernel']", "['proj_out']['kernel']")


def zero_residual_outputs(params):
  """The transformer's parameters with the `ZERO_INIT` kernels zeroed: each block starts as the
  identity and the model's prediction as its bias (DiT's adaLN-Zero idea, Peebles & Xie 2023, sec.
  3.2, reached here through the output projections because Wan's gates are a table plus the time
  projection); it trains markedly faster from scratch than torch's default init."""
  def zero(path, v):
    name = jax.tree_util.keystr(path)
    return jnp.zeros_like(v) if any(z in name for z in ZERO_INIT) else v
  return jax.tree_util.tree_map_with_path(zero, params)


@dataclasses.dataclass
class WarmCosine:
  """A learning rate by step: a linear warm-up over `warm` steps to `peak`, then a cosine to 5 % of
  it at step `total` (set once the step time is measured; the peak until then)."""
  peak: float
  warm: int
  total: int | None = None

  def __call__(self, k: int) -> float:
    if k < self.warm:
      return self.peak * (k + 1) / self.warm
    frac = min((k - self.warm) / max(self.total - self.warm, 1), 1.0) if self.total else 0.0
    return self.peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))


def transformer_step(graphdef, opt, config: WanTransformerConfig, *, ema_decay: float, conditioned: bool,
                     attention_implementation: str):
  """The jitted flow-matching step `step(params, ema, state, x0, noise, sigma, text, given, rate) ->
  (params, ema, state, loss)` of `opt` (its `inject_hyperparams` learning rate set to `rate`), the
  EMA updated in the same program; `conditioned`: rows with `given` > 0 get clean first latent
  frames (`given_first_frame`), the loss on the others."""
  plan = ParallelPlan.single(attention_implementation)

  def loss_fn(params, x0, noise, sigma, text, given):
    xt, target = flow_pair(x0, noise, sigma)
    if not conditioned:
      pred = forward(nnx.merge(graphdef, params), xt, sigma * 1000.0, text, plan)
      return jnp.mean(jnp.square(pred - target))
    xt, timestep, weight = given_first_frame(x0, xt, sigma, given, config.patch_size)
    pred = forward(nnx.merge(graphdef, params), xt, timestep, text, plan)
    return jnp.sum(weight * jnp.square(pred - target)) / (jnp.sum(weight) * x0.shape[1] * x0[0, 0, 0].size)

  @jax.jit
  def step(params, ema, state, x0, noise, sigma, text, given, rate):
    inject = state[1]
    state = (state[0], inject._replace(hyperparams={**inject.hyperparams, "learning_rate": rate}))
    loss, grads = jax.value_and_grad(loss_fn)(params, x0, noise, sigma, text, given)
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    ema = jax.tree.map(lambda e, p: ema_decay * e + (1 - ema_decay) * p, ema, params)
    return params, ema, state, loss

  return step


def train_transformer(latents: np.ndarray, text_ids: np.ndarray, texts: np.ndarray, *, seed: int,
                      seconds: float, batch: int = 32, lr: float = 1e-3, ema_decay: float = 0.995,
                      config: WanTransformerConfig = TINY_TRAINED_TRANSFORMER, model=None,
                      attention_implementation: str = "lse", warm: int = 100, image_share: float = 0.0,
                      given_frames: np.ndarray | None = None):
  """Flow-matching training (module docstring) for about `seconds`; with `image_share` > 0 that
  share of the rows get their clean first latent frame and timestep 0 on its tokens, the loss on
  the other frames (Wan 2.2 TI2V's conditioning, `given_first_frame`); rows with `given_frames`
  get that many clean first latent frames the same way (a context window continuing the one
  before: `context_fuse="continue"`).

  Args:
    latents: float32 [n, C, F, Hl, Wl] normalised diffusion latents.
    text_ids: int [n], the row of `texts` of each latent's prompt.
    texts: float32 [P + 1, L, 32]: every prompt's text states, the last row the empty prompt's.
    given_frames: int [n] each row's clean first latent frames (0: none), or None (none anywhere).

  Returns:
    (the EMA model, [(step, loss)]).
  """
  fresh = model is None
  model = init_transformer(config, seed) if fresh else model
  graphdef, params = nnx.split(model)
  if fresh:
    params = zero_residual_outputs(params)
  # The step count is fixed from a measured step time after a short warm-up, so the cosine
  # schedule ends when the time does; the learning rate is an argument of the step (host-side
  # schedule), so fixing the count needs no new trace.
  learning_rate = WarmCosine(lr, warm)
  opt = optax.chain(optax.clip_by_global_norm(1.0),
                    optax.inject_hyperparams(optax.adamw)(learning_rate=lr, weight_decay=0.01, b2=0.99))
  state, ema = opt.init(params), params
  step = transformer_step(graphdef, opt, config, ema_decay=ema_decay, attention_implementation=attention_implementation,
                          conditioned=bool(image_share) or given_frames is not None)
  rng, empty, texts_dev = np.random.default_rng(seed + 1), len(texts) - 1, jnp.asarray(texts)
  history, start, k = [], time.perf_counter(), 0
  while learning_rate.total is None or k < learning_rate.total:
    if k == 10:
      after_compile = time.perf_counter()
    if learning_rate.total is None and k == 40:  # steps 10-39 measured (not the compile): fix the length
      elapsed, per_step = time.perf_counter() - start, (time.perf_counter() - after_compile) / 30
      learning_rate.total = max(int((seconds - elapsed) / per_step) + 40, warm + 1)
      log(f"transformer: {per_step:.2f} s/step -> {learning_rate.total} steps")
    idx = rng.integers(0, len(latents), batch)
    rows = np.where(rng.random(batch) < CFG_DROPOUT, empty, text_ids[idx])
    sigma = training_sigmas(rng.random(batch).astype(np.float32))
    noise = rng.standard_normal(latents[idx].shape).astype(np.float32)
    given = (rng.random(batch) < image_share).astype(np.float32)
    if given_frames is not None:
      given = np.maximum(given, given_frames[idx]).astype(np.float32)
    params, ema, state, loss = step(params, ema, state, latents[idx], noise, sigma, texts_dev[rows], given,
                                    np.float32(learning_rate(k)))
    history.append((k, float(loss)))
    if k % 100 == 0:
      log(f"transformer step {k}: loss {history[-1][1]:.4f} ({time.perf_counter() - start:.0f} s)")
    k += 1
  return nnx.merge(graphdef, ema), history


# --- outputs ---------------------------------------------------------------------------------------

def save_model(folder: str, transformer, encoder, vae: wan_vae.WanVAE) -> str:
  """Writes the diffusers-format folder (`pipelines.wan.pretrained.saving.save_pipeline`, with
  `GENERATION_DEFAULTS`); its tokenizer's `model_max_length` is `MAX_SEQUENCE_LENGTH`, the default
  text length (`tokenizer.text_length`). Returns the folder."""
  from pipelines.wan.pretrained import save_pipeline
  tokenizer = default_tokenizer()
  tokenizer.model_max_length = MAX_SEQUENCE_LENGTH
  return save_pipeline(folder, transformer=transformer, text_encoder=encoder, vae=vae, tokenizer=tokenizer,
                       scheduler_config=SCHEDULER, generation_defaults=GENERATION_DEFAULTS)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="output folder (model/, loss.png, samples.png, report.json)")
  p.add_argument("--seed", type=int, default=0, help="seed of every draw (weights, data, noise)")
  p.add_argument("--minutes", type=float, default=55.0, help="wall-clock budget for the whole run")
  p.add_argument("--vae-fraction", type=float, default=0.25, help="share of --minutes for the VAE")
  p.add_argument("--clips", type=int, default=2000, help="clips in the transformer's dataset")
  p.add_argument("--batch", type=int, default=32, help="transformer batch")
  p.add_argument("--lr", type=float, default=1e-3, help="transformer peak learning rate")
  p.add_argument("--layers", type=int, default=TINY_TRAINED_TRANSFORMER.num_layers)
  p.add_argument("--vae", default=None, metavar="FOLDER",
                 help="skip step 1: the VAE of this model folder (an earlier run's DIR/model) is used as is")
  return p


def normalised_dataset(vae: wan_vae.WanVAE, rng: np.random.Generator, count: int
                       ) -> tuple[wan_vae.WanVAE, np.ndarray, list[str]]:
  """(the VAE with the dataset's per-channel latent mean / std as its `latents_mean` /
  `latents_std`, `count` clips' normalised latents, their prompts)."""
  raw, prompts = encode_dataset(vae, rng, count)
  mean = raw.mean(axis=(0, 2, 3, 4))
  std = raw.std(axis=(0, 2, 3, 4)) + 1e-6
  vae = wan_vae.WanVAE(dataclasses.replace(vae.config, latents_mean=tuple(map(float, mean)),
                                           latents_std=tuple(map(float, std))), vae.params)
  return vae, np.asarray(wan_vae.normalize_latents(vae.config, jnp.asarray(raw))), prompts


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  t0 = time.perf_counter()
  budget = args.minutes * 60
  os.makedirs(args.out, exist_ok=True)
  config = dataclasses.replace(TINY_TRAINED_TRANSFORMER, num_layers=args.layers)
  report = {"seed": args.seed, "minutes": args.minutes, "clips": args.clips, "batch": args.batch,
            "lr": args.lr, "transformer": config.to_dict(),
            "vae": dataclasses.asdict(TINY_TRAINED_VAE), "times": {}}

  if args.vae is None:
    log("1/4 VAE")
    vae, vae_history = train_vae(args.seed, args.vae_fraction * budget)
  else:
    log(f"1/4 VAE: {args.vae}/vae (not trained here)")
    vae, vae_history = wan_vae.load_vae(os.path.join(args.vae, "vae")), []
    report["vae_from"] = os.path.abspath(args.vae)
  report["times"]["vae"] = time.perf_counter() - t0
  report["vae_reconstruction"] = run_report.check_reconstructions(vae, np.random.default_rng(args.seed + 3), count=10)
  log(f"VAE reconstructions pass the detector: {report['vae_reconstruction']}")
  write_json(report, os.path.join(args.out, "report.json"), overwrite=True)  # so far; rewritten at the end

  log(f"2/4 dataset: {args.clips} clips encoded")
  t = time.perf_counter()
  vae, latents, prompts = normalised_dataset(vae, np.random.default_rng(args.seed + 2), args.clips)
  report["times"]["dataset"] = time.perf_counter() - t
  log(f"dataset encoded in {report['times']['dataset']:.0f} s")
  grammar = world.all_prompts()
  encoder = text_encoder()
  texts = encode_texts(encoder, grammar + [""])
  text_ids = np.asarray([grammar.index(q) for q in prompts])

  reserve = 120.0  # sampling (50 videos), plots and saving
  seconds = budget - (time.perf_counter() - t0) - reserve
  log(f"3/4 transformer: {seconds:.0f} s")
  t = time.perf_counter()
  transformer, transformer_history = train_transformer(
      latents, text_ids, texts, seed=args.seed, seconds=seconds, batch=args.batch, lr=args.lr,
      config=config)
  report["times"]["transformer"] = time.perf_counter() - t

  log("4/4 save, sample, plot")
  folder = save_model(os.path.join(args.out, "model"), transformer, encoder, vae)
  run_report.plot_losses(vae_history, transformer_history, os.path.join(args.out, "loss.png"))
  _judge(folder, args.out, report, vae_history, transformer_history, t0)
  return 0


def _judge(folder: str, out: str, report: dict, vae_history: list, transformer_history: list, t0: float) -> None:
  """Samples the saved model on the acceptance prompts, plots them and writes the final report."""
  samples = run_report.sample_and_check(folder, run_report.acceptance_prompts())
  first = [s for s in samples if s["seed"] == samples[0]["seed"]]  # one row per prompt
  run_report.plot_samples([s["video"] for s in first], [f"{'ok' if s['ok'] else 'NO'}  {s['prompt']}" for s in first],
                          os.path.join(out, "samples.png"))
  report["times"]["total"] = time.perf_counter() - t0
  report["losses"] = {"vae_last100": float(np.mean([l for _, l in vae_history[-100:]])) if vae_history else None,
                      "transformer_last100": float(np.mean([l for _, l in transformer_history[-100:]])),
                      "vae_steps": len(vae_history), "transformer_steps": len(transformer_history)}
  report["samples"] = [{k: v for k, v in s.items() if k != "video"} for s in samples]
  report["accuracy"] = float(np.mean([s["ok"] for s in samples]))
  report["distances"] = run_report.prompt_and_seed_distances(samples)
  write_json(report, os.path.join(out, "report.json"), overwrite=True)
  log(f"done in {report['times']['total'] / 60:.1f} min: detector accuracy {report['accuracy']:.0%} "
      f"on {len(samples)} samples; {folder}")


if __name__ == "__main__":
  sys.exit(main())
