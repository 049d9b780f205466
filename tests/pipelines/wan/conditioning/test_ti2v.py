"""Wan 2.2 TI2V-5B: a diffusers TI2V folder (`expand_timesteps`) as a `WanPipeline`, per token.

Reference: a tiny diffusers `WanPipeline(expand_timesteps=True)` (the Wan 2.2 VAE topology at tiny
widths, z_dim 8; the tiny transformer with 8 latent channels; UniPC at shift 5) saved once per
module; diffusers' text-to-video run and its `WanImageToVideoPipeline` on the same parts (the
TI2V image path: first frame fixed, its tokens at t = 0) against ours, fp32, same latents. Latents
[1, 8, 3, 4, 6] -> 18 tokens: U=2,R=2 pads them to 20 (a mesh that does not divide the count).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.numerics import assert_psnr_at_least
from pipelines import WanImageToVideoPipeline, WanPipeline
from pipelines.parallel.plan import ParallelPlan
from pipelines.pipeline.checked.request import GenerationRequest
from pipelines.pipeline.run.ti2v import ti2v_condition
from pipelines.wan import transformer as wan_transformer, vae as wan_vae
from pipelines.wan.transformer import model as transformer_model
from pipelines.wan.conditioning import ti2v
from pipelines.wan.pretrained import TINY_TRANSFORMER
from tests.torch_weights import randomize

pytestmark = pytest.mark.numerics

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

PROMPT, NEGATIVE = "a red fox", "blurry"  # within max_sequence_length 16 ByT5 tokens
SIZE = dict(height=64, width=96, num_frames=9)  # 16x VAE: latents 4 x 6, 3 frames
LATENTS = np.random.default_rng(2).standard_normal((1, 8, 3, 4, 6)).astype(np.float32)
CALL = dict(**SIZE, num_inference_steps=2, guidance_scale=4.0, max_sequence_length=16)
# The acceptance bar of this model: fp32 on both sides, two steps; measured 126-129 dB (one device
# and the meshes, text and image), so 90 dB keeps a wide margin (FP32_VIDEO_PSNR_DB's analysis:
# >= 80 dB), while a wrong timestep or a lost first frame costs far more (the positive control).
TI2V_PSNR_DB = 90.0


def _save_folder(folder: str) -> None:
  torch.manual_seed(0)
  config = dataclasses.replace(TINY_TRANSFORMER, in_channels=8, out_channels=8).to_dict()
  transformer = diffusers.WanTransformer3DModel(**config)
  randomize(transformer, seed=21)
  vae_kwargs = {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(wan_vae.VAE_PRESETS["tiny-ti2v"]).items()}
  vae = diffusers.AutoencoderKLWan(**vae_kwargs)
  text_encoder = transformers.UMT5EncoderModel(transformers.UMT5Config(
      vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
      relative_attention_num_buckets=32, feed_forward_proj="gated-gelu"))
  scheduler = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                flow_shift=5.0, num_train_timesteps=1000)
  pipe = diffusers.WanPipeline(tokenizer=transformers.ByT5Tokenizer(), text_encoder=text_encoder, vae=vae,
                               scheduler=scheduler, transformer=transformer, expand_timesteps=True)
  pipe.save_pretrained(folder, safe_serialization=True)


def _image() -> np.ndarray:
  """[1, 3, 64, 96] in [0, 1]: a smooth gradient with a bright square (not noise)."""
  y, x = np.mgrid[0:SIZE["height"], 0:SIZE["width"]] / np.array([SIZE["height"], SIZE["width"]])[:, None, None]
  image = np.stack([x, y, 0.5 + 0.4 * np.sin(3 * x + 2 * y)]).astype(np.float32)
  image[:, 16:40, 24:56] = 0.9
  return image[None]


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
  """The saved folder and diffusers' text-to-video and image-to-video videos."""
  folder = str(tmp_path_factory.mktemp("ti2v") / "wan22_ti2v")
  _save_folder(folder)
  t2v = diffusers.WanPipeline.from_pretrained(folder)
  t2v.set_progress_bar_config(disable=True)
  i2v = diffusers.WanImageToVideoPipeline(
      tokenizer=t2v.tokenizer, text_encoder=t2v.text_encoder, vae=t2v.vae, scheduler=t2v.scheduler,
      transformer=t2v.transformer, image_encoder=None, image_processor=None, expand_timesteps=True)
  i2v.set_progress_bar_config(disable=True)
  with torch.no_grad():
    text = t2v(PROMPT, NEGATIVE, **CALL, latents=torch.from_numpy(LATENTS.copy()), output_type="np").frames
    image = i2v(torch.from_numpy(_image()), PROMPT, NEGATIVE, **CALL, latents=torch.from_numpy(LATENTS.copy()),
                output_type="np").frames
  return {"folder": folder, "text": text, "image": image}


@pytest.fixture(scope="module")
def pipe(refs):
  pipe = WanPipeline.from_pretrained(refs["folder"])
  pipe.set_progress_bar_config(disable=True)
  return pipe


@pytest.mark.parametrize("mesh", [None, "U=2,R=2"])
def test_text_to_video_matches_diffusers(refs, pipe, mesh):
  assert pipe.expand_timesteps and pipe.facts.spatial_factor == 16
  # vae_parallel=False: the one-device decode programs serve every mesh (the split decode is
  # compared with diffusers in tests/pipelines/wan/vae/test_residual.py).
  frames = pipe(PROMPT, NEGATIVE, **CALL, latents=LATENTS, mesh=mesh, vae_parallel=False)
  assert frames.shape == refs["text"].shape == (1, 9, 64, 96, 3)
  assert_psnr_at_least(frames, refs["text"], TI2V_PSNR_DB, name=f"TI2V text-to-video, mesh {mesh}")


@pytest.mark.parametrize("mesh", [None, "CFG=2,U=2,R=2"])
def test_image_to_video_matches_diffusers(refs, pipe, mesh):
  request = GenerationRequest.build(pipe.facts, PROMPT, NEGATIVE, **CALL, latents=LATENTS, mesh=mesh,
                                    vae_parallel=False)
  request = ti2v_condition(pipe.vae, request, _image() * 2 - 1)
  result = pipe.generate(request)
  assert result.settings["first_frame_latents_sha256"]
  assert_psnr_at_least(result.frames, refs["image"], TI2V_PSNR_DB, name=f"TI2V image-to-video, mesh {mesh}")
  # Positive control: the image and the text-only videos differ by far more than the bar.
  mse = np.mean((refs["image"].astype(np.float64) - refs["text"]) ** 2)
  assert 10 * np.log10(1 / mse) < 40, "the image barely changes diffusers' video: the check would be weak"


def test_image_argument_matches_diffusers(refs, pipe):
  """`image=` (HWC floats in [0, 1], as `generate --image` passes a file's pixels) is encoded by the
  pipeline: `WanImageToVideoPipeline.from_pretrained` of the TI2V folder gives diffusers'
  `WanImageToVideoPipeline(expand_timesteps=True)` video; TI2V refuses a last frame."""
  image = _image()[0].transpose(1, 2, 0)
  i2v = WanImageToVideoPipeline.from_pretrained(refs["folder"])
  i2v.set_progress_bar_config(disable=True)
  assert i2v.facts.expand_timesteps and not i2v.facts.image_to_video and i2v.image_encoder is None
  frames = i2v(image, PROMPT, NEGATIVE, **CALL, latents=LATENTS)
  assert_psnr_at_least(frames, refs["image"], TI2V_PSNR_DB, name="TI2V image= on WanImageToVideoPipeline")
  with pytest.raises(ValueError, match="first frame only"):
    GenerationRequest.build(pipe.facts, PROMPT, **CALL, seed=0, image=image, last_image=image)
  with pytest.raises(ValueError, match="already has an `image`"):
    ti2v_condition(pipe.vae, GenerationRequest.build(pipe.facts, PROMPT, **CALL, seed=0, image=image),
                   _image() * 2 - 1)


def test_generate_image(refs, pipe, tmp_path, capsys):
  """`generate --image` on a TI2V folder gives the Python call's video (`pipe(image=...)`, the
  same PNG pixels and seed), and the sidecar records the image's digest. Positive control: the
  text-only video of that seed is far from it."""
  import json

  import PIL.Image

  from pipelines.cli import generate
  from pipelines.pipeline.checked.image_inputs import digest

  pixels = (_image()[0].transpose(1, 2, 0) * 255).round().astype(np.uint8)
  PIL.Image.fromarray(pixels).save(tmp_path / "first.png")
  out = tmp_path / "video.npy"
  argv = ["--model", refs["folder"], "--image", str(tmp_path / "first.png"), "--prompt", PROMPT,
          "--negative-prompt", NEGATIVE, "--size", "96x64", "--frames", "9", "--steps", "2", "--guidance", "4",
          "--seed", "0", "--max-sequence-length", "16", "--dtype", "float32", "--out", str(out)]
  assert generate.main(argv) == 0, capsys.readouterr().err
  video = np.load(out)
  frames = pipe(PROMPT, NEGATIVE, **CALL, seed=0, image=pixels)
  assert_psnr_at_least(video, frames[0], TI2V_PSNR_DB, name="generate --image vs pipe(image=)")
  text_only = pipe(PROMPT, NEGATIVE, **CALL, seed=0)
  assert np.mean((text_only[0] - frames[0]) ** 2) > 1e-4, "the image barely changes the video"
  record = json.loads(open(f"{out}.json").read())
  assert digest(pixels) in json.dumps(record)


def test_condition_checks(pipe):
  request = GenerationRequest.build(pipe.facts, PROMPT, **CALL, seed=0)
  with pytest.raises(ValueError, match=r"image shape \(1, 3, 32, 96\) must be \[1 or 1, 3, 64, 96\]"):
    ti2v_condition(pipe.vae, request, np.zeros((1, 3, 32, 96), np.float32))
  with pytest.raises(ValueError, match=r"in \[-1, 1\]"):
    ti2v_condition(pipe.vae, request, np.full((1, 3, 64, 96), 2.0, np.float32))
  tiny = WanPipeline.tiny(random=True)
  with pytest.raises(ValueError, match="not a Wan 2.2 TI2V model"):
    ti2v_condition(tiny.vae, GenerationRequest.build(tiny.facts, PROMPT, seed=0, height=32, width=32),
                   np.zeros((1, 3, 32, 32), np.float32))


def _token_sized(hlo: str, tokens: int, widths: tuple[int, ...]) -> list[str]:
  """HLO lines holding an array whose shape has the whole (padded) token count next to a model
  width: [..., T, D] or [..., T, 6, D] (the per-token embedding or modulation, built whole)."""
  dims = "|".join(str(w) for w in widths)
  pattern = re.compile(rf"\[(?:\d+,)*{tokens},(?:6,)?(?:{dims})\]")
  return [line.strip()[:160] for line in hlo.splitlines() if pattern.search(line)]


def test_per_token_timesteps_stay_sharded(pipe, monkeypatch):
  """The compiled TI2V step on U=2,R=2 (18 tokens padded to 20) has the plain step's collectives
  (all-gathers: the attention's k sums, per layer, and the noise prediction for unpatchify) and no
  whole per-token tensor on a device;
  positive control: the same detector finds one when the embedding is built replicated."""
  plan = ParallelPlan.build("U=2,R=2", heads=8)
  model = jax.device_put(nnx_merge(pipe), plan.replicated)
  latents = jnp.asarray(np.concatenate([LATENTS] * 2))  # [cond; uncond]
  text = jnp.zeros((2, 16, 32), jnp.float32)
  t_B = jnp.full((2,), 900.0)

  def step(model, latents, condition, text, t_B):  # as `denoise_step` with a TI2V `condition`
    x, timestep, *_ = condition.transformer_inputs(latents, t_B, cfg=False)
    return wan_transformer.forward(model, x, timestep, text, plan)

  condition = ti2v.TI2VConditioning(patch_size=model.config.patch_size, first_frame_BCFHW=latents[:, :, :1])
  hlo = jax.jit(step).lower(model, latents, condition, text, t_B).compile().as_text()
  gathers = [line for line in hlo.splitlines() if re.search(r"= [^=]*\ball-gather(-start)?\(", line)]
  outputs = [line for line in gathers if "[2,20,32]" in line]  # [B, T_padded, 4 * C]: the output
  assert len(gathers) == 2 and len(outputs) == 1, gathers  # the other: the k sums [U R, B, K, H]
  d = pipe.transformer_config.dim
  assert _token_sized(hlo, 20, (d,)) == []
  assert _token_sized(hlo, 18, (d,)) == []

  def built_whole(model, layout, timestep, dtype):  # the bug class: every device embeds every token
    timestep = jnp.pad(timestep.dense(), ((0, 0), (0, layout.padding)))
    out = model.condition_embedder(timestep, dtype=dtype, freq_dim=model.config.freq_dim)
    return (*(layout.constrain_rows(a) for a in out), None)

  monkeypatch.setattr(transformer_model, "_time", built_whole)
  # A new function: jit caches traces per function, so `step` would reuse the first trace.
  bad = jax.jit(lambda *args: step(*args)).lower(model, latents, condition, text, t_B).compile().as_text()
  assert _token_sized(bad, 20, (d,)), "the detector misses a per-token modulation built whole"


def test_preset_and_planner_size_the_5b():
  """wan2.2-ti2v-5b: Wan2.2 configs/wan_ti2v_5B.py's sampling defaults; the transformer preset has
  diffusers' parameters exactly (5.0B); the planner counts the 16x VAE's tokens (27,280)."""
  from pipelines.commands.presets import PRESETS
  from pipelines.parallel import planner
  from pipelines.pipeline.checked.model_facts import token_facts
  from pipelines.wan.transformer import PRESETS as MODELS, param_counts

  p = PRESETS["wan2.2-ti2v-5b"]
  assert (p.width, p.height, p.frames, p.steps, p.shift, p.guidance, p.fps) == (1280, 704, 121, 50, 5.0, (5.0,), 24.0)
  config = MODELS["wan2.2-ti2v-5b"]
  with torch.device("meta"):
    ref = diffusers.WanTransformer3DModel(**config.to_dict())
  assert sum(param_counts(config)) == sum(p.numel() for p in ref.parameters()) == 4_999_787_712
  facts = token_facts(config, spatial_factor=16, temporal_factor=4, text_tokens=512)
  assert facts.video_tokens(121, 704, 1280) == 31 * 22 * 40
  found = planner.candidates(config, facts, param_counts=param_counts(config), devices=8, frames=121, height=704,
                             width=1280, chip=planner.CHIPS["v6e"])
  best = planner.recommend(found)
  assert best is not None and all(24 % c.mesh.ulysses == 0 for c in found)


def nnx_merge(pipe):
  from flax import nnx

  return nnx.merge(pipe._graphdef, pipe.weights.experts[0])


def test_fps_follows_the_preset(tmp_path):
  """generate --preset wan2.2-ti2v-5b writes 24 fps (Wan2.2's sample_fps) unless --fps says."""
  import warnings

  from pipelines.cli.flags import build_parser
  from pipelines.cli.run_plan import plan_run

  def fps(*flags):
    args = build_parser().parse_args(["--prompt", "a fox", "--out", str(tmp_path / "o.npy"), *flags])
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # a real model's preset on the tiny model warns
      return plan_run(args).fps

  assert fps("--preset", "wan2.2-ti2v-5b") == 24.0
  assert fps("--preset", "wan2.2-ti2v-5b", "--fps", "12") == 12.0
  assert fps() == 16.0


def test_given_frames_widen_the_first_frame():
  """Fg given frames (a context window's overlap, `context_fuse="continue"`): the transformer's input
  is the given latents on frames 0..Fg-1 and the latents after, bit for bit; their tokens' timestep is
  0 and the rest t; the final latents keep them. With Fg = 1 this is diffusers' formula (written out
  here: the mask's first frame 0, the condition broadcast): the path checked against diffusers above."""
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((2, 8, 4, 4, 6)).astype(np.float32))
  for given in (1, 2, 3):
    condition = ti2v.TI2VConditioning((1, 2, 2), jnp.asarray(rng.standard_normal((1, 8, given, 4, 6)), jnp.float32))
    inputs = condition.transformer_inputs(x, jnp.asarray([700.0, 700.0]), cfg=True)
    np.testing.assert_array_equal(inputs.latents[:, :, :given], jnp.concatenate([condition.first_frame_BCFHW] * 2))
    np.testing.assert_array_equal(inputs.latents[:, :, given:], x[:, :, given:])
    tokens = 2 * 3  # (4 / 2) (6 / 2) per latent frame
    np.testing.assert_array_equal(inputs.timestep.dense(), np.repeat([[0.0] * given * tokens + [700.0] * (4 - given) * tokens],
                                                             2, axis=0))
    np.testing.assert_array_equal(condition.final_latents(x[:1])[:, :, :given], condition.first_frame_BCFHW)
  image = jnp.asarray(rng.standard_normal((2, 8, 1, 4, 6)), jnp.float32)
  mask = np.ones((1, 1, 4, 4, 6), np.float32)
  mask[:, :, 0] = 0
  diffusers_formula = (1 - mask) * np.broadcast_to(image, x.shape) + mask * np.asarray(x)
  np.testing.assert_array_equal(ti2v.model_input(x, image), diffusers_formula)
