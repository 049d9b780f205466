"""What a tiny training run reports besides its model: its VAE's reconstructions and its samples
judged by the synthetic world's detectors (`synthetic_world.check`, `check_long`): 17-frame samples
of the acceptance prompts (every colour x motion), 65-frame ones in context windows, first-frame
given ones (TI2V); how far videos of different prompts are apart against videos of different
seeds; and its pictures (the loss curves, the grid of samples). `end_to_end.train.tiny` and
`end_to_end.train.long_clips` report their runs with it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from end_to_end.train import synthetic_world as world
from pipelines.wan import vae as wan_vae


def check_reconstructions(vae: wan_vae.WanVAE, rng: np.random.Generator, count: int = 5) -> dict:
  """Encodes and decodes `count` full-size clips (as the pipeline would); the detector's verdict on
  each reconstruction for its prompt, and the mean absolute pixel error."""
  ok, errors, seen = [], [], []
  for _ in range(count):
    scene = world.random_scene(rng)
    clip = world.render(scene)
    z = wan_vae.encode(vae, jnp.asarray(clip.transpose(3, 0, 1, 2)[None] * 2 - 1)).mean
    video = np.asarray(wan_vae.decode(vae, z, video_layout="BFHWC"))[0] * 0.5 + 0.5
    verdict = world.check(video, scene.prompt)
    ok.append(bool(verdict[0]))
    seen.append(f"{scene.prompt}: {'ok' if verdict[0] else 'NO'}, {verdict[1]}")
    errors.append(float(np.abs(np.clip(video, 0, 1) - clip).mean()))
  return {"passed": int(sum(ok)), "of": count, "mean_abs_error": float(np.mean(errors)), "seen": seen}


def acceptance_prompts() -> list[str]:
  """Every colour x motion, shapes in turn (25 prompts)."""
  out = []
  for i, (colour, motion) in enumerate((c, m) for c in world.COLOURS for m in world.MOTIONS):
    out.append(world.prompt_for(colour, world.SHAPES[i % len(world.SHAPES)], motion))
  return out


def sample_and_check(folder: str, prompts: list[str], seeds=(0, 1), steps: int = 8,
                     guidance_scale: float = 5.0) -> list[dict]:
  """Loads `folder`, generates each prompt with each seed at the tiny settings (8 steps, 17 x 64 x
  64, one device, the folder's default text length; guidance 5, what this command's models are
  accepted at; `long_clips`' picture-latent models at 2) and runs the acceptance detector."""
  from pipelines.pipeline import WanPipeline
  pipe = WanPipeline.from_pretrained(folder)
  out = []
  for prompt in prompts:
    for seed in seeds:
      video = pipe(prompt, height=world.HEIGHT, width=world.WIDTH, num_frames=world.FRAMES,
                   num_inference_steps=steps, guidance_scale=guidance_scale, seed=seed, progress=False)[0]
      ok, reason = world.check(video, prompt)
      out.append({"prompt": prompt, "seed": seed, "ok": bool(ok), "seen": reason, "video": video})
  return out


def long_samples(folder: str, prompts: list[str], seeds=(0,), steps: int = 8, *, guidance_scale: float = 5.0,
                 context_fuse: str = "pyramid") -> list[dict]:
  """Each prompt at 65 frames (`synthetic_world.SLOW_FRAMES`) in context windows of 17 overlapping
  by 8 (5 windows; `context_fuse`: blended at every step, or "continue": one after another), the
  tiny preset's settings otherwise, judged by `synthetic_world.check_long`."""
  from pipelines.pipeline import WanPipeline
  pipe = WanPipeline.from_pretrained(folder)
  out = []
  for prompt in prompts:
    for seed in seeds:
      video = pipe(prompt, height=world.HEIGHT, width=world.WIDTH, num_frames=world.SLOW_FRAMES,
                   num_inference_steps=steps, guidance_scale=guidance_scale, seed=seed, progress=False,
                   context_frames=world.FRAMES, context_overlap=8, context_fuse=context_fuse)[0]
      ok, seen = world.check_long(video, prompt)
      out.append({"prompt": prompt, "seed": seed, "ok": bool(ok), "seen": seen, "video": video})
  return out


def _first_frame(scene: world.Scene, frames: int):
  """(the scene's rendered frame 0 [H, W, 3] in [0, 1], that frame as the 8-bit image a user gives)."""
  from PIL import Image
  first = world.render(scene, frames=frames, only=[0])[0]
  return first, Image.fromarray(np.round(first * 255).astype(np.uint8))


def image_samples(folder: str, rng: np.random.Generator, count: int, steps: int = 8,
                  guidance_scale: float | None = None) -> list[dict]:
  """TI2V: a rendered first frame of a drawn scene (a fast motion; its colour, shape and position
  drawn) given to the folder's transformer as `expand_timesteps` does, 17 frames, at the folder's
  own guidance unless `guidance_scale` is given; the detector on the video, and the first frame's
  mean absolute pixel error against the given one."""
  from pipelines.pipeline import WanPipeline
  pipe = WanPipeline.from_pretrained(folder)
  pipe.expand_timesteps = True
  guidance = {} if guidance_scale is None else {"guidance_scale": guidance_scale}
  out = []
  for i in range(count):
    scene = world.random_scene(rng)
    first, image = _first_frame(scene, world.FRAMES)
    video = pipe(scene.prompt, image=image, height=world.HEIGHT, width=world.WIDTH, num_frames=world.FRAMES,
                 num_inference_steps=steps, seed=i, progress=False, **guidance)[0]
    ok, seen = world.check(video, scene.prompt)
    out.append({"prompt": scene.prompt, "ok": bool(ok), "seen": seen, "image": first,
                "first_frame_error": float(np.abs(np.clip(video[0], 0, 1) - first).mean()), "video": video})
  return out


def long_image_samples(folder: str, prompts: list[str], rng: np.random.Generator) -> list[dict]:
  """TI2V at 65 frames: each prompt's scene (drawn with its words; a slow one along its 65-frame
  path) given by its rendered first frame, in context windows of 17 overlapping by 8 at the folder's
  own settings (its guidance and context fuse), seed i for prompt i; judged by
  `synthetic_world.check_long`, with the first frame's mean absolute error."""
  from pipelines.pipeline import WanPipeline
  pipe = WanPipeline.from_pretrained(folder)
  pipe.expand_timesteps = True
  out = []
  for i, prompt in enumerate(prompts):
    scene = world.random_scene(rng, *world.parse_prompt(prompt))
    first, image = _first_frame(scene, world.SLOW_FRAMES if scene.motion in world.SLOW_MOTIONS else world.FRAMES)
    video = pipe(prompt, image=image, height=world.HEIGHT, width=world.WIDTH, num_frames=world.SLOW_FRAMES,
                 context_frames=world.FRAMES, context_overlap=8, seed=i, progress=False)[0]
    ok, seen = world.check_long(video, prompt)
    out.append({"prompt": prompt, "seed": i, "ok": bool(ok), "seen": seen, "image": first, "video": video,
                "first_frame_error": float(np.abs(np.clip(video[0], 0, 1) - first).mean())})
  return out


def prompt_and_seed_distances(samples: list[dict]) -> dict:
  """Mean absolute pixel difference between videos of the same prompt with different seeds, and
  between videos of different prompts with the same seed (the acceptance's "prompts differ far
  more than seeds")."""
  by_seed: dict[int, list[np.ndarray]] = {}
  by_prompt: dict[str, list[np.ndarray]] = {}
  for s in samples:
    by_seed.setdefault(s["seed"], []).append(s["video"])
    by_prompt.setdefault(s["prompt"], []).append(s["video"])
  seeds = [float(np.abs(v[i] - v[j]).mean()) for v in by_prompt.values()
           for i in range(len(v)) for j in range(i + 1, len(v))]
  prompts = [float(np.abs(v[i] - v[j]).mean()) for v in by_seed.values()
             for i in range(len(v)) for j in range(i + 1, len(v))]
  return {"different_seeds": float(np.mean(seeds)) if seeds else None,
          "different_prompts": float(np.mean(prompts)) if prompts else None}


def plot_samples(videos: list[np.ndarray], labels: list[str], path: str, frames=(0, 4, 8, 12, 16)) -> None:
  """samples.png: one row per video (its label on the left), the given frames across."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(len(videos), len(frames), figsize=(1.6 * len(frames) + 2.2, 1.6 * len(videos)),
                           squeeze=False)
  for r, (video, label) in enumerate(zip(videos, labels)):
    for c, f in enumerate(frames):
      ax = axes[r, c]
      ax.imshow(np.clip(video[min(f, len(video) - 1)], 0, 1))
      ax.set_xticks([])
      ax.set_yticks([])
      if r == 0:
        ax.set_title(f"frame {f}", fontsize=8)
      if c == 0:
        ax.set_ylabel(label, fontsize=7, rotation=0, ha="right", va="center")
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


def plot_losses(vae_history, transformer_history, path: str) -> None:
  """loss.png: the two training curves (raw and a 50-step running mean), log scale."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for ax, history, title in ((axes[0], vae_history, "VAE (reconstruction MSE + latent L2)"),
                             (axes[1], transformer_history, "transformer (flow-matching MSE)")):
    if not history:  # the VAE came from an earlier run (--vae)
      ax.set_title(f"{title}: not trained in this run")
      continue
    steps, losses = (np.asarray(v) for v in zip(*history))
    ax.plot(steps, losses, alpha=0.3, lw=0.7, label="per step")
    w = min(50, len(losses))
    ax.plot(steps[w - 1:], np.convolve(losses, np.ones(w) / w, "valid"), lw=1.5, label=f"mean of {w}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
