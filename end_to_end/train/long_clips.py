"""Teaches the trained tiny default long videos: its VAE a time-stationary latent space, its
transformer slow motion (what a 65-frame clip of the 64x64 world can show), optionally the first
frame given (TI2V-style).

    python -m end_to_end.train.long_clips --out DIR [--from FOLDER] [--minutes M] [--batch B]

The tiny default (`end_to_end.train.tiny`) was trained on 17-frame clips. Asked for 65 frames in
context windows it fails, whatever the sampler does, because its VAE is not stationary in time:
- its causal encoder's latents grow along a clip, in magnitude 0.30, 0.30, 0.45, 0.57, 0.76 over a
  17-frame clip's five latent frames and on to 1.03 by the ninth (measured on slow 65-frame
  scenes), so a window that starts at latent frame 6 holds latents no 17-frame clip has (what the
  transformer learned), and the decoder, whose time cache ran 5 latent frames, smears every frame
  past ~21 (mean absolute error 0.02 up to frame 20, 0.16-0.17 from frame 40);
- its world cannot hold a long video: every clip moves 40-50 % of the frame in 17 frames. The slow
  motions ("a red square moving slowly right": 50-62 % of the frame over 65 frames,
  `synthetic_world.SLOW_TRAVEL_RANGE`) are what a long video of it shows; 17-frame windows of such
  clips are what the context windows (`pipelines/wan/conditioning/windows.py`) ask for.

Steps, each from the folder given (default: the shipped tiny default):
1. the VAE made time-stationary: with `--stationary-vae` by its weights (`stationary_vae`: the
   encoder exactly, latent frame k the encoding of video frame 4k alone, a picture like a clip's
   latent frame 0: one distribution at every position, the colour in each; the decoder holding
   each picture 4 frames), else by training (`train_vae`: the encoder regressed onto
   `stationary_latents` of its starting self); the decoder taught to reconstruct 65-frame and
   17-frame clips from those latents (`--vae-phases`);
2. a dataset: 17-frame clips of the original world and 5-latent-frame windows of encoded 65-frame
   slow clips (every window offset), normalised by the 17-frame clips' per-channel statistics
   (the VAE's new latents_mean / latents_std);
3. the transformer fine-tuned from the folder's on that mix (`tiny.train_transformer`, with
   `image_share` of the rows given their clean first latent frame, timestep 0 on its tokens,
   the loss on the other frames: Wan 2.2 TI2V's conditioning, `pipelines/pipeline/run/ti2v.py`), at a
   lower learning rate and without the warm start's zero-init.
Writes DIR/model/ (the default's layout), DIR/report.json (times, losses, the VAE's 65-frame
reconstruction error by frame, the detector's verdicts), DIR/long.png (contact sheet).
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

from end_to_end.train import run_report, synthetic_world as world, tiny
from end_to_end.train.stationary_vae import stationary_vae
from pipelines.wan import vae as wan_vae
from pipelines.storage.video_io import write_json

LONG_FRAMES = 65
# Decoder batches (frames, crop side, share of the steps), drawn at each step: 65-frame clips (the
# time cache run 17 chunks long; 32x32 crops: the cache is what needs teaching, at 1/4 of a full
# frame's cost), and 17-frame crops so the short clips stay as they were.
DECODER_PHASES = ((LONG_FRAMES, 32, 0.7), (world.FRAMES, 48, 0.3))
DECODED = ("decoder.", "post_quant_conv.")
# Latent frames a later window is given by the one before: the acceptance's 8-frame overlap.
GIVEN_OVERLAP = 2
# Guidance of the checks (17-frame samples, windows that continue): with these picture latents a colour lies on a ray
# from the background's latents, and guidance much above 2 pushes it along to the next colour
# (docs/measurements/training.md, "Training the tiny models further").
CONTINUE_GUIDANCE = 2.0


def parse_phases(text: str) -> tuple[tuple[int, int, float], ...]:
  """"FRAMESxCROP:SHARE,..." (e.g. "65x32:0.7,17x48:0.3") -> ((frames, crop, share), ...), as
  `DECODER_PHASES`. Raises ValueError naming the part: frames not 4k + 1 in [5, 65], a crop not a
  multiple of 8 in [16, the frame], a share not above 0."""
  phases = []
  for part in text.split(","):
    try:
      size, share = part.split(":")
      frames, crop = (int(v) for v in size.split("x"))
      share = float(share)
    except ValueError:
      raise ValueError(f"--vae-phases part {part!r} must be FRAMESxCROP:SHARE, e.g. 65x32:0.7") from None
    if (frames - 1) % 4 or not 5 <= frames <= LONG_FRAMES or crop % 8 or not 16 <= crop <= world.WIDTH \
        or not share > 0:
      raise ValueError(f"--vae-phases part {part!r}: frames 4k + 1 in [5, {LONG_FRAMES}], a crop a multiple of 8 "
                       f"in [16, {world.WIDTH}], a share above 0")
    phases.append((frames, crop, share))
  return tuple(phases)


def _phases_flag(text: str):
  """`parse_phases` for argparse, whose own message would replace a ValueError's."""
  try:
    return parse_phases(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
  """An int >= 1 for argparse (rows per step)."""
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1, e.g. 32")
  return value


def _non_negative(text: str) -> float:
  """A finite float >= 0 for argparse (a noise std)."""
  try:
    value = float(text)
  except ValueError:
    value = -1.0
  if not (math.isfinite(value) and value >= 0):
    raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0, e.g. 0.1")
  return value


def log(msg: str) -> None:
  tiny.log(msg)


def long_scene(rng: np.random.Generator) -> world.Scene:
  """A 65-frame scene: slow motion (70 %) or standing still."""
  if rng.random() < 0.3:
    return world.random_scene(rng, motion="standing still")
  return world.random_scene(rng, motion=str(rng.choice(list(world.SLOW_MOTIONS))))


def clip_batch(rng: np.random.Generator, batch: int, frames: int, crop: int) -> np.ndarray:
  """float32 [batch, frames, crop, crop, 3] in [-1, 1]: long scenes at 65 frames, the original
  world's at 17 (when `crop` < the frame: crops around the shape's mid-clip position (70 %) or
  anywhere)."""
  out = np.empty((batch, frames, crop, crop, 3), np.float32)
  for b in range(batch):
    scene = long_scene(rng) if frames == LONG_FRAMES else world.random_scene(rng)
    clip = world.render(scene, frames=frames)
    y0, x0 = (int(rng.integers(0, n - crop + 1)) for n in (world.HEIGHT, world.WIDTH))
    if rng.random() < 0.7:
      cx, cy = scene.centre(frames // 2, frames=frames)
      x0, y0 = (int(np.clip(c * n - crop / 2 + rng.uniform(-crop / 4, crop / 4), 0, n - crop))
                for c, n in ((cx, world.WIDTH), (cy, world.HEIGHT)))
    out[b] = clip[:, y0:y0 + crop, x0:x0 + crop] * 2 - 1
  return out


def decode_all(params, config: wan_vae.WanVAEConfig, z_BFHWC: jax.Array) -> jax.Array:
  """Latent frames [B, 1 + k, Hl, Wl, z] -> video [B, 1 + 4k, 8Hl, 8Wl, 3], the decoder's chunks in
  a `lax.scan` (one traced chunk, whatever the length)."""
  vae = wan_vae.WanVAE(config, params)
  first, cache = wan_vae.decode_chunk(vae, None, z_BFHWC[:, :1])

  def body(cache, z):
    y, cache = wan_vae.decode_chunk(vae, cache, z[:, None])
    return cache, y

  _, rest = jax.lax.scan(body, cache, jnp.moveaxis(z_BFHWC[:, 1:], 1, 0))
  rest = jnp.moveaxis(rest, 0, 1)  # [B, k, 4, H, W, 3]
  return jnp.concatenate([first, rest.reshape(rest.shape[0], -1, *rest.shape[3:])], axis=1)


def encode_mean(vae: wan_vae.WanVAE, x_BFHWC: jax.Array) -> jax.Array:
  """The encoder's mean, VAE space: [B, 1 + k, Hl, Wl, z]."""
  return jnp.moveaxis(wan_vae.encode(vae, jnp.moveaxis(x_BFHWC, -1, 1)).mean, 1, -1)


ENCODED = ("encoder.", "quant_conv.")
FIRST_FRAME_WEIGHT = 4.0


def stationary_latents(encode, x_BFHWC: np.ndarray) -> np.ndarray:
  """The latents a time-stationary encoder gives a clip: latent frame k is `encode`'s latent of video
  frame 4k alone (a one-frame clip: what a causal Wan encoder makes of a clip's frame 0, the whole
  picture). Every latent frame is then one picture: the same distribution at every position, the
  absolute colour, shape and place in each (a Wan encoder's later latent frames hold what changed
  since frame 0: a red clip's latents 1-4 after a blue clip's latent 0 decode green), and the
  decoder makes the 3 frames between two pictures. Latent frame 0 is the plain encoding's.

  Args:
    encode: the source encoder's mean, float32 [N, 1, H, W, 3] -> [N, 1, H/8, W/8, z].
    x_BFHWC: float32 [B, 1 + 4k, H, W, 3] in [-1, 1].

  Returns:
    float32 [B, 1 + k, H/8, W/8, z].
  """
  pictures = x_BFHWC[:, ::4]
  z = np.asarray(encode(pictures.reshape(-1, 1, *pictures.shape[2:])))[:, 0]
  return z.reshape(*pictures.shape[:2], *z.shape[1:])


def train_vae(vae: wan_vae.WanVAE, seconds: float, *, seed: int, batch: int = 2, lr: float = 1e-3,
              latent_noise: float = 0.1, phases=DECODER_PHASES, encoder: bool = True,
              target: wan_vae.WanVAE | None = None, object_weight: float = tiny.OBJECT_WEIGHT):
  """Makes the VAE time-stationary for about `seconds`: the encoder regressed onto
  `stationary_latents` of its starting self (the error in units of the folder's latents_std), the
  decoder taught to reconstruct each clip from those latents (+ `latent_noise`), with
  `tiny.train_vae`'s weighted loss (`object_weight`: the shapes' pixels' extra weight); each step's
  batch drawn from `phases` by their shares. With `encoder` False the encoder stays as it is and
  the decoder learns from its latents (a VAE made stationary before, whose latents a transformer
  has learned). With a `target` VAE, the latents both learn from are `stationary_latents` of its
  encoder (exact targets: a transformer trained on them, `--target-encoder`, stays valid however
  far the encoder gets).
  Returns (the VAE, [(step, encoder loss, decoder loss)])."""
  config = vae.config
  source = jax.jit(lambda x: encode_mean(vae, x))
  pictures = None if target is None else jax.jit(lambda x: encode_mean(target, x))
  std = jnp.asarray(config.latents_std, jnp.float32)
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adam)(learning_rate=lr))
  trained = ENCODED + DECODED if encoder else DECODED
  params = {k: v for k, v in vae.params.items() if k.startswith(trained)}
  frozen = {k: v for k, v in vae.params.items() if not k.startswith(trained)}
  state = opt.init(params)

  def loss_fn(params, x, z, noise):
    both = {**frozen, **params}
    fit = (jnp.mean(jnp.square((encode_mean(wan_vae.WanVAE(config, both), x) - z) / std)) if encoder
           else jnp.float32(0))
    y = decode_all(both, config, z + noise)
    w = tiny.object_weights(x, object_weight)
    # Frame 0 is the decoder's own path (one latent frame -> one video frame): weighted up to as
    # many as the 4 frames of every later latent frame.
    w = w * jnp.where(jnp.arange(x.shape[1]) == 0, FIRST_FRAME_WEIGHT, 1.0)[None, :, None, None, None]
    parts = fit, jnp.mean(w * jnp.square(y - x)) / jnp.mean(w)
    return parts[0] + parts[1], parts

  step = tiny.optimizer_step(opt, loss_fn, has_aux=True)
  rng = np.random.default_rng(seed)
  history, start, k = [], time.perf_counter(), 0
  shares = np.asarray([share for *_, share in phases])
  while time.perf_counter() - start < seconds:
    frac = min((time.perf_counter() - start) / seconds, 1.0)
    rate = lr * min(1.0, (k + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
    frames, crop, _ = phases[int(rng.choice(len(phases), p=shares / shares.sum()))]
    x = clip_batch(rng, batch, frames, crop)
    z = (stationary_latents(pictures, x) if pictures is not None else stationary_latents(source, x) if encoder
         else np.asarray(source(x)))
    noise = latent_noise * rng.standard_normal(z.shape).astype(np.float32)
    params, state, (_, parts) = step(params, state, x, z, noise, np.float32(rate))
    history.append((k, float(parts[0]), float(parts[1])))
    if k % 20 == 0:
      log(f"vae step {k}: encoder {history[-1][1]:.4f}, decoder {history[-1][2]:.5f} "
          f"({time.perf_counter() - start:.0f} s)")
    k += 1
  return wan_vae.WanVAE(config, {**vae.params, **params}), history


def round_trip(vae: wan_vae.WanVAE, clip_FHWC: np.ndarray) -> np.ndarray:
  """A clip in [0, 1], float32 [F, H, W, 3], encoded (the mean) and decoded as the pipeline does:
  the video in [0, 1], float32 [F, H, W, 3]."""
  z = wan_vae.encode(vae, jnp.asarray(clip_FHWC.transpose(3, 0, 1, 2)[None] * 2 - 1)).mean
  return np.clip(np.asarray(wan_vae.decode(vae, z, video_layout="BFHWC"))[0] * 0.5 + 0.5, 0, 1)


def long_reconstruction(vae: wan_vae.WanVAE, rng: np.random.Generator, count: int = 4) -> dict:
  """Mean absolute pixel error by 8-frame span of `count` clean 65-frame clips encoded and decoded
  as the pipeline does, and the long-video detector's verdict on each."""
  errors, verdicts = [], []
  for _ in range(count):
    scene = long_scene(rng)
    clip = world.render(scene, frames=LONG_FRAMES)
    video = round_trip(vae, clip)
    errors.append(np.abs(video - clip).mean(axis=(1, 2, 3)))
    verdicts.append(f"{scene.prompt}: {world.check_long(video, scene.prompt)}")
  by_span = np.mean(errors, axis=0)
  return {"error_by_8_frames": [round(float(by_span[i:i + 8].mean()), 4) for i in range(0, LONG_FRAMES, 8)],
          "seen": verdicts}


# --- the transformer's data ------------------------------------------------------------------------

def encode_clips(vae: wan_vae.WanVAE, scenes: list[world.Scene], frames: int, batch: int = 4,
                 pictures=None) -> np.ndarray:
  """The scenes rendered at `frames` and encoded: VAE-space latent means float32
  [n, 16, 1 + (frames-1)/4, 8, 8]; with `pictures` (an encoder of one-frame clips, as
  `stationary_latents` takes) the exact `stationary_latents` instead (what a stationary encoder
  trained from that one regresses onto), not `vae`'s encoding."""
  out = []
  for first in range(0, len(scenes), batch):
    clips = np.stack([world.render(s, frames=frames) for s in scenes[first:first + batch]]) * 2 - 1
    if pictures is not None:
      out.append(np.moveaxis(stationary_latents(pictures, clips), -1, 1))
    else:
      out.append(np.asarray(wan_vae.encode(vae, jnp.asarray(clips.transpose(0, 4, 1, 2, 3))).mean))
  return np.concatenate(out)


def training_set(vae: wan_vae.WanVAE, rng: np.random.Generator, short: int, long: int, given: int = 0,
                 pictures=None) -> tuple[np.ndarray, list[str], np.ndarray]:
  """`short` 17-frame clips of the original world and 4 windows (5 latent frames, distinct offsets
  drawn) of each of `long` 65-frame scenes: (VAE-space latents [n, 16, 5, 8, 8], prompts, int [n]
  each row's given latent frames).

  With `given` > 0 the rows teach windows that continue (`context_fuse="continue"`): one window of
  each scene starts it (offset 0, nothing given: what a video's first window is), the other 3 have
  their first `given` latent frames given (what a later window takes from the one before); the
  short clips are given nothing. With 0, every row is given nothing. `pictures`: as `encode_clips`."""
  scenes = [world.random_scene(rng) for _ in range(short)]
  latents, prompts = [encode_clips(vae, scenes, world.FRAMES, pictures=pictures)], [s.prompt for s in scenes]
  counts = [np.zeros(short, np.int32)]
  long_scenes = [long_scene(rng) for _ in range(long)]
  encoded = encode_clips(vae, long_scenes, LONG_FRAMES, pictures=pictures) if long_scenes else []
  window = latents[0].shape[2]
  for scene, z in zip(long_scenes, encoded):
    if given:
      offsets = np.concatenate([[0], 1 + rng.choice(z.shape[1] - window, 3, replace=False)])
    else:
      offsets = rng.choice(z.shape[1] - window + 1, 4, replace=False)
    latents.append(np.stack([z[:, o:o + window] for o in offsets]))
    prompts += [scene.prompt] * 4
    counts.append(np.where(offsets > 0, given, 0).astype(np.int32))
  return np.concatenate(latents), prompts, np.concatenate(counts)


# --- the run ---------------------------------------------------------------------------------------

def _texts(encoder) -> tuple[list[str], np.ndarray]:
  grammar = world.all_prompts() + world.slow_prompts()
  return grammar, tiny.encode_texts(encoder, grammar + [""])


def _report(out: str, report: dict) -> None:
  write_json(report, os.path.join(out, "report.json"), overwrite=True)


def _checks(folder: str, seed: int, report: dict, out: str, image: bool, continued: bool) -> None:
  """The detector on 17-frame samples (10 held-out prompts x 2 seeds, guidance `CONTINUE_GUIDANCE`:
  the picture latents' (h) in docs/measurements/training.md), 65-frame windowed samples
  (slow and still prompts; `continued`: windows that continue, at `CONTINUE_GUIDANCE`), and
  first-frame-given samples; long.png shows the long ones."""
  from pipelines.storage.contact_sheet import write_contact_sheet
  rng = np.random.default_rng(seed + 7)
  held_out = [str(p) for p in rng.choice(world.all_prompts(), 10, replace=False)]
  short = run_report.sample_and_check(folder, held_out, guidance_scale=CONTINUE_GUIDANCE)
  slow = ["a red square moving slowly right", "a green circle moving slowly left", "a blue triangle moving slowly down",
          "a yellow square moving slowly up", "a white circle moving slowly right", "a red triangle standing still"]
  longs = run_report.long_samples(
      folder, slow, **(dict(context_fuse="continue", guidance_scale=CONTINUE_GUIDANCE) if continued else {}))
  images = run_report.image_samples(folder, np.random.default_rng(seed + 9), 10) if image else []
  for name, rows in (("short", short), ("long", longs), ("image", images)):
    report[name] = {"passed": sum(r["ok"] for r in rows), "of": len(rows),
                    "seen": [{k: v for k, v in r.items() if k not in ("video", "image")} for r in rows]}
  write_contact_sheet([r["video"] for r in longs], os.path.join(out, "long.png"),
                      labels=[f"{'ok' if r['ok'] else 'NO'} {r['prompt']}" for r in longs], max_columns=9)
  if images:
    write_contact_sheet([r["video"] for r in images], os.path.join(out, "image.png"),
                        labels=[f"{'ok' if r['ok'] else 'NO'} {r['prompt']}" for r in images], max_columns=9)


def _vae_stage(vae: wan_vae.WanVAE, args, report: dict) -> wan_vae.WanVAE:
  """`train_vae` for its share of the minutes (none: the folder's VAE), its 65-frame round trip
  before and after in the report."""
  report["vae_before"] = long_reconstruction(vae, np.random.default_rng(args.seed + 3))
  log(f"65-frame reconstruction before: {report['vae_before']['error_by_8_frames']}")
  history = []
  if args.vae_fraction > 0:
    vae, history = train_vae(vae, min(args.vae_fraction, 1.0) * args.minutes * 60, seed=args.seed, lr=args.vae_lr,
                             batch=args.vae_batch,
                             encoder=not args.keep_encoder, phases=args.vae_phases,
                             latent_noise=args.latent_noise, target=_target_vae(args),
                             object_weight=args.object_weight)
    report["vae_after"] = long_reconstruction(vae, np.random.default_rng(args.seed + 3))
    log(f"65-frame reconstruction after: {report['vae_after']['error_by_8_frames']}")
  report["losses"] = {"vae_steps": len(history),
                      "encoder_last20": float(np.mean([h[1] for h in history[-20:]])) if history else None,
                      "decoder_last20": float(np.mean([h[2] for h in history[-20:]])) if history else None}
  _report(args.out, report)
  return vae


def _start_vae(args) -> wan_vae.WanVAE:
  """The folder's VAE, made time-stationary by its weights with `--stationary-vae`."""
  vae = wan_vae.load_vae(os.path.join(args.source, "vae"))
  return stationary_vae(vae) if args.stationary_vae else vae


def _target_vae(args) -> wan_vae.WanVAE | None:
  """`--target-encoder`'s VAE (whose pictures' latents are the exact targets), or None."""
  return None if args.target_encoder is None else wan_vae.load_vae(os.path.join(args.target_encoder, "vae"))


def _dataset(vae: wan_vae.WanVAE, args, report: dict):
  """`training_set` normalised by its 17-frame clips' per-channel statistics, which become the
  VAE's latents_mean / latents_std (as `tiny` sets them): (the VAE, latents, prompts, given frames)."""
  t = time.perf_counter()
  source = _target_vae(args)
  pictures = None if source is None else jax.jit(lambda x: encode_mean(source, x))
  raw, prompts, given = training_set(vae, np.random.default_rng(args.seed + 2), args.short, args.long,
                                     given=args.given_overlap, pictures=pictures)
  short = raw[:args.short]
  config = dataclasses.replace(vae.config, latents_mean=tuple(map(float, short.mean(axis=(0, 2, 3, 4)))),
                               latents_std=tuple(map(float, short.std(axis=(0, 2, 3, 4)) + 1e-6)))
  vae = wan_vae.WanVAE(config, vae.params)
  report["dataset_seconds"] = time.perf_counter() - t
  return vae, np.asarray(wan_vae.normalize_latents(config, jnp.asarray(raw))), prompts, given


def build_parser() -> argparse.ArgumentParser:
  from pipelines.wan.pretrained import TINY_DEFAULT_FOLDER

  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="output folder (model/, report.json, long.png, image.png)")
  p.add_argument("--from", dest="source", default=TINY_DEFAULT_FOLDER, help="the model folder to train further")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--minutes", type=float, default=40.0, help="wall-clock budget of the training")
  p.add_argument("--vae-fraction", type=float, default=0.35,
                 help="share of --minutes for the VAE; 1: the VAE only (the folder's transformer kept); "
                      "0: the folder's VAE kept")
  p.add_argument("--vae-lr", type=float, default=1e-3, help="the VAE's peak learning rate")
  p.add_argument("--vae-phases", type=_phases_flag, default=DECODER_PHASES, metavar="FxC:S,...",
                 help="the VAE's batches: clips of F frames cropped to CxC, drawn with share S (default: "
                      f"{','.join(f'{f}x{c}:{s}' for f, c, s in DECODER_PHASES)}; 64 is the whole frame)")
  p.add_argument("--latent-noise", type=_non_negative, default=0.1,
                 help="std of the Gaussian noise on the latents the decoder learns from, VAE units (default: 0.1)")
  p.add_argument("--vae-batch", type=_positive_int, default=2, help="clips per VAE step (default: 2)")
  p.add_argument("--object-weight", type=_non_negative, default=tiny.OBJECT_WEIGHT,
                 help="the VAE loss's extra weight on the shapes' pixels (1 + W there, 1 on the background; "
                      f"default: {tiny.OBJECT_WEIGHT:g})")
  p.add_argument("--keep-encoder", action="store_true",
                 help="train the decoder only, from the folder's encoder's latents (a VAE made stationary before)")
  p.add_argument("--stationary-vae", action="store_true",
                 help="first make the folder's VAE time-stationary by its weights (end_to_end.train.stationary_vae: "
                      "latent frame k exactly the encoding of video frame 4k alone; the decoder holds each picture "
                      "for 4 frames until trained); implies --keep-encoder")
  p.add_argument("--short", type=int, default=2000, help="17-frame clips in the transformer's data")
  p.add_argument("--long", type=int, default=500, help="65-frame slow scenes (4 windows each)")
  p.add_argument("--given-overlap", type=int, default=GIVEN_OVERLAP, choices=range(0, 5), metavar="N",
                 help="latent frames a long scene's later windows are given (windows that continue, "
                      f"context_fuse='continue'); 0: none, windows for the parallel blend (default: {GIVEN_OVERLAP})")
  p.add_argument("--target-encoder", default=None, metavar="FOLDER",
                 help="the latents the VAE and the transformer learn: the exact stationary latents of FOLDER's "
                      "encoder (each latent frame a picture encoded alone, e.g. the shipped default's) rather than "
                      "those of the folder's own (default: the folder's own; its encoding for the transformer)")
  p.add_argument("--lr", type=float, default=3e-4, help="the transformer's peak learning rate")
  p.add_argument("--batch", type=_positive_int, default=32,
                 help="the transformer's rows per step (default: 32, the 2-core CPU runs'; on a TPU 128, docs/measurements/training.md)")
  p.add_argument("--image-share", type=float, default=0.3, help="rows given their first frame (TI2V)")
  p.add_argument("--fresh-transformer", action="store_true",
                 help="train the transformer from a fresh initialisation (as end_to_end.train.tiny does) rather "
                      "than from the folder's")
  return p


def main(argv: list[str] | None = None) -> int:
  from pipelines.wan.transformer import load_transformer

  args = build_parser().parse_args(argv)
  args.keep_encoder = args.keep_encoder or args.stationary_vae  # a stationary encoder by weights is exact
  t0 = time.perf_counter()
  os.makedirs(args.out, exist_ok=True)
  report = {k: v for k, v in vars(args).items()}
  vae = _vae_stage(_start_vae(args), args, report)
  encoder = tiny.text_encoder()
  transformer = None if args.fresh_transformer else load_transformer(os.path.join(args.source, "transformer"))
  history = []
  if args.vae_fraction < 1:
    vae, latents, prompts, given = _dataset(vae, args, report)
    grammar, texts = _texts(encoder)
    seconds = args.minutes * 60 - (time.perf_counter() - t0)
    log(f"transformer: {len(latents)} rows, {seconds:.0f} s")
    transformer, history = tiny.train_transformer(
        latents, np.asarray([grammar.index(q) for q in prompts]), texts, seed=args.seed, seconds=seconds,
        lr=args.lr, batch=args.batch, warm=100 if transformer is None else 30, model=transformer, image_share=args.image_share,
        given_frames=given if args.given_overlap else None)
  if transformer is None:
    transformer = load_transformer(os.path.join(args.source, "transformer"))
  folder = tiny.save_model(os.path.join(args.out, "model"), transformer, encoder, vae)
  report["losses"]["transformer_last100"] = float(np.mean([l for _, l in history[-100:]])) if history else None
  report["losses"]["transformer_steps"] = len(history)
  report["train_seconds"] = time.perf_counter() - t0
  _checks(folder, args.seed, report, args.out, image=args.image_share > 0, continued=args.given_overlap > 0)
  report["total_seconds"] = time.perf_counter() - t0
  _report(args.out, report)
  log(f"done in {report['total_seconds'] / 60:.1f} min: short {report['short']['passed']}/{report['short']['of']}, "
      f"long {report['long']['passed']}/{report['long']['of']}, image {report['image']['passed']}/"
      f"{report['image']['of']}; {folder}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
