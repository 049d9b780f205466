"""Guidance decided per expert (`GenerationRequest.expert_cfg`): with Wan 2.2's two experts each
applies its own scale, so `guidance_scale=1, guidance_scale_2=4` (Lightning-style: a distilled
high-noise expert without CFG, the low-noise expert guided) guides the low-noise steps only.

Reference: Wan 2.2's sampler, built by hand here from the saved diffusers pipeline's own modules
(its transformers, scheduler and VAE): high-noise steps one conditional pass, low-noise steps
uncond + 4 (cond - uncond). diffusers' `WanPipeline` differs on purpose: it turns guidance off for
both experts when `guidance_scale` <= 1 (`do_classifier_free_guidance`), ignoring
`guidance_scale_2`; DESIGN.md says so.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipelines import WanPipeline
from pipelines.cli import generate
from tests.numerics import FP32_VIDEO_PSNR_DB, assert_psnr_at_least
from tests.pipelines.pipeline.test_wan_pipeline import (LATENTS, MAX_LEN, NEGATIVES, PROMPTS, SIZE,
                                                        _save_diffusers_pipeline, psnr)

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

STEPS = 4  # FlowMatchEuler shift 3 at boundary 0.875: the first steps on the high-noise expert


def _by_hand(pipe, scales: tuple[float, float]) -> np.ndarray:
  """Wan 2.2's sampler on diffusers' modules: each expert its own scale, one pass at scale <= 1."""
  cond, uncond = pipe.encode_prompt(PROMPTS, NEGATIVES, do_classifier_free_guidance=True,
                                    max_sequence_length=MAX_LEN)
  scheduler = pipe.scheduler
  scheduler.set_timesteps(STEPS)
  boundary = pipe.config.boundary_ratio * scheduler.config.num_train_timesteps
  latents = torch.from_numpy(LATENTS.copy())
  for t in scheduler.timesteps:
    model, scale = (pipe.transformer, scales[0]) if t >= boundary else (pipe.transformer_2, scales[1])
    timestep = t.expand(latents.shape[0])
    noise = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=cond, return_dict=False)[0]
    if scale > 1:
      free = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=uncond, return_dict=False)[0]
      noise = free + scale * (noise - free)
    latents = scheduler.step(noise, t, latents, return_dict=False)[0]
  z = pipe.vae.config.z_dim
  mean = torch.tensor(pipe.vae.config.latents_mean).view(1, z, 1, 1, 1)
  std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, z, 1, 1, 1)
  video = pipe.vae.decode(latents / std + mean, return_dict=False)[0]
  return pipe.video_processor.postprocess_video(video, output_type="np")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("wan22") / "wan22")
  _save_diffusers_pipeline(path, two_experts=True)
  return path


@pytest.fixture(scope="module")
def hand_made(folder):
  """The by-hand reference video for (g, g2) = (1, 4)."""
  pipe = diffusers.WanPipeline.from_pretrained(folder)
  with torch.no_grad():
    return _by_hand(pipe, (1.0, 4.0))


def _run(pipe, g1, g2, **kwargs):
  return pipe.run(PROMPTS, NEGATIVES, **SIZE, num_inference_steps=STEPS, guidance_scale=g1, guidance_scale_2=g2,
                  latents=LATENTS, max_sequence_length=MAX_LEN, **kwargs)


def test_low_noise_expert_guides_alone(folder, hand_made):
  """g = 1, g2 = 4 is Wan 2.2's sampler (>= 80 dB fp32), its high-noise steps one pass; the sidecar
  settings say which expert ran guided; positive control: g2 = 1 (no guidance at all) is another
  video."""
  pipe = WanPipeline.from_pretrained(folder)
  result = _run(pipe, 1.0, 4.0)
  experts = result.settings["experts_per_step"]
  assert 0 in experts and 1 in experts, experts  # both experts ran
  assert result.settings["cfg"] is True and result.settings["cfg_per_expert"] == [False, True]
  assert (result.settings["guidance_scale"], result.settings["guidance_scale_2"]) == (1.0, 4.0)
  assert_psnr_at_least(result.frames, hand_made, FP32_VIDEO_PSNR_DB, name="g=1, g2=4 vs Wan 2.2's sampler")
  unguided = _run(pipe, 1.0, 1.0)
  assert unguided.settings["cfg"] is False and unguided.settings["cfg_per_expert"] == [False, False]
  assert psnr(unguided.frames, result.frames) < 60, "guidance_scale_2 changed nothing"


def test_cfg_mesh_mixes_the_unguided_expert_at_one(folder, hand_made):
  """On a CFG=2 mesh the rows stay split in halves: the high-noise expert runs both and mixes at 1,
  the same video as the one-pass steps (fp32)."""
  result = _run(WanPipeline.from_pretrained(folder), 1.0, 4.0, mesh="CFG=2,U=2")
  assert result.settings["cfg_per_expert"] == [True, True]
  assert_psnr_at_least(result.frames, hand_made, FP32_VIDEO_PSNR_DB, name="CFG=2,U=2 vs Wan 2.2's sampler")


def test_generate_guidance_pair_reaches_the_low_noise_expert(folder, tmp_path):
  """`generate --guidance 1,4` is another video than `--guidance 1,1`, and its sidecar says so."""
  videos = {}
  for pair in ("1,4", "1,1"):
    out = tmp_path / f"g{pair.replace(',', '_')}.npy"
    argv = ["--model", folder, "--prompt", PROMPTS[0], "--size", "80x48", "--frames", "9", "--steps", str(STEPS),
            "--seed", "1", "--max-sequence-length", str(MAX_LEN), "--guidance", pair, "--out", str(out)]
    assert generate.main(argv) == 0
    videos[pair] = np.load(out)
    settings = json.loads(out.with_name(out.name + ".json").read_text())["settings"]
    assert settings["cfg_per_expert"] == ([False, True] if pair == "1,4" else [False, False]), settings
  assert psnr(videos["1,4"], videos["1,1"]) < 60
