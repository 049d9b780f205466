"""Tests for image-to-video (pipelines/pipeline/image_pipeline.py and its parts: the transformer's
image branch, the CLIP vision encoder, the condition latents and mask).

Reference: tiny diffusers `WanImageToVideoPipeline`s (random weights, ByT5 tokenizer, a tiny
transformers CLIP vision model and `CLIPImageProcessor`, so nothing is downloaded) saved with
`save_pretrained` and read back by `WanImageToVideoPipeline.from_pretrained`; both run with the same
explicit latents, prompts, images and settings, fp32. Three kinds, one folder each: Wan 2.1 I2V
(CLIP branch, UniPC), Wan 2.1 FLF2V (CLIP branch with two-frame `pos_embed`, first and last image)
and Wan 2.2 I2V A14B (36-channel experts without an image branch, boundary 0.9, two guidance
scales, flow-match Euler). Text length 512: diffusers' attention splits image from text states by
assuming it. Latent grid F=3, Hl=6, Wl=10 (45 tokens: U * R = 4 pads).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pipelines import WanImageToVideoPipeline, WanPipeline
from pipelines.pipeline import wan_pipeline
from numerics import assert_psnr_at_least
from torch_weights import randomize

pytestmark = pytest.mark.numerics

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

PARITY_DB = 90.0  # fp32 on both sides: summation order only (the acceptance bar)
CONTROL_DB = 60.0  # another image must move the video further than this from the reference
PROMPTS = ["a red fox running through snow", "two cats on a roof"]
NEGATIVES = ["blurry", ""]
SIZE = dict(height=48, width=80, num_frames=9)  # test_pipeline.py's size: the VAE programs are shared
TEXT_LEN = 512
CLIP_WIDTH = 24
KINDS = ("i2v", "flf2v", "a14b")


def psnr(a, b) -> float:
  mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
  return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def _image(seed: int, size=(40, 56)) -> "PIL.Image.Image":
  """A smooth random RGB image (a 4x4 grid of colours, bilinear): the VAE keeps most of it."""
  rng = np.random.default_rng(seed)
  small = PIL.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8))
  return small.resize((size[1], size[0]), PIL.BILINEAR)


def _clip(with_projection: bool):
  config = transformers.CLIPVisionConfig(hidden_size=CLIP_WIDTH, intermediate_size=40, num_attention_heads=2,
                                         num_hidden_layers=3, image_size=32, patch_size=8, hidden_act="gelu",
                                         projection_dim=16)
  cls = transformers.CLIPVisionModelWithProjection if with_projection else transformers.CLIPVisionModel
  model = cls(config).eval()
  randomize(model, seed=5)
  return model, transformers.CLIPImageProcessor(crop_size=32, size={"shortest_edge": 32})


def _save(kind: str, folder: str) -> None:
  torch.manual_seed(0)
  base = dataclasses.replace(wan_pipeline.TINY_TRANSFORMER, in_channels=36, out_channels=16)
  if kind != "a14b":
    base = dataclasses.replace(base, image_dim=CLIP_WIDTH, added_kv_proj_dim=base.dim,
                               pos_embed_seq_len=34 if kind == "flf2v" else None)
  experts = [diffusers.WanTransformer3DModel(**base.to_dict()) for _ in range(2 if kind == "a14b" else 1)]
  for i, expert in enumerate(experts):
    randomize(expert, seed=20 + i)
  vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                   temperal_downsample=[False, True, True])
  text_encoder = transformers.UMT5EncoderModel(transformers.UMT5Config(
      vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
      relative_attention_num_buckets=32, feed_forward_proj="gated-gelu"))
  if kind == "a14b":
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0)
    encoder, processor = None, None
  else:
    scheduler = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                  flow_shift=3.0, num_train_timesteps=1000)
    encoder, processor = _clip(with_projection=kind == "flf2v")
  pipe = diffusers.WanImageToVideoPipeline(
      tokenizer=transformers.ByT5Tokenizer(), text_encoder=text_encoder, vae=vae, scheduler=scheduler,
      image_encoder=encoder, image_processor=processor, transformer=experts[0],
      transformer_2=experts[1] if kind == "a14b" else None, boundary_ratio=0.9 if kind == "a14b" else None)
  pipe.save_pretrained(folder, safe_serialization=True)


LATENTS = np.random.default_rng(1).standard_normal((2, 16, 3, 6, 10)).astype(np.float32)


def _call_args(kind: str, image_seed: int = 0) -> dict:
  args = dict(image=_image(image_seed), prompt=PROMPTS, negative_prompt=NEGATIVES, **SIZE, num_inference_steps=2,
              guidance_scale=4.0, max_sequence_length=TEXT_LEN)
  if kind == "flf2v":
    args["last_image"] = _image(image_seed + 100)
  if kind == "a14b":
    args["guidance_scale_2"] = 2.5
  return args


@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
  """kind -> (folder, diffusers' frames, our pipeline), built on first use."""
  cache = {}

  def get(kind: str):
    if kind not in cache:
      folder = str(tmp_path_factory.mktemp(kind))
      _save(kind, folder)
      ref_pipe = diffusers.WanImageToVideoPipeline.from_pretrained(folder)
      ref_pipe.set_progress_bar_config(disable=True)
      with torch.no_grad():
        ref = ref_pipe(**_call_args(kind), latents=torch.from_numpy(LATENTS.copy()), output_type="np").frames
      pipe = WanImageToVideoPipeline.from_pretrained(folder)
      pipe.set_progress_bar_config(disable=True)
      cache[kind] = (folder, ref, pipe)
    return cache[kind]

  return get


@pytest.mark.parametrize("kind", KINDS)
def test_diffusers_parity_one_device_and_mesh(kinds, kind):
  """Ours vs diffusers >= 90 dB on one device and on U=2,R=2; positive control: another image
  (first and last) moves our video below 60 dB of the reference, so the bar can fail."""
  _, ref, pipe = kinds(kind)
  assert ref.shape == (2, 9, 48, 80, 3) and float(ref.std()) > 0.02
  one = pipe.run(**_call_args(kind), latents=LATENTS)
  assert_psnr_at_least(one.frames, ref, PARITY_DB, name=f"{kind} one device vs diffusers")
  mesh = pipe(**_call_args(kind), latents=LATENTS, mesh="U=2,R=2", vae_parallel=False)
  assert_psnr_at_least(mesh, ref, PARITY_DB, name=f"{kind} U=2,R=2 vs diffusers")
  other = pipe(**_call_args(kind, image_seed=7), latents=LATENTS)
  assert psnr(other, ref) < CONTROL_DB, f"{kind}: another image barely changes the video"
  if kind == "a14b":
    assert set(one.settings["experts_per_step"]) == {0, 1}
  assert one.settings["image_sha256"] and (one.settings["last_image_sha256"] is not None) == (kind == "flf2v")


def test_cfg_parallel_parity(kinds):
  _, ref, pipe = kinds("i2v")
  frames = pipe(**_call_args("i2v"), latents=LATENTS, mesh="CFG=2,U=2,R=2")
  assert_psnr_at_least(frames, ref, PARITY_DB, name="i2v CFG=2,U=2,R=2 vs diffusers")
