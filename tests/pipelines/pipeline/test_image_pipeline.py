"""Tests for image-to-video (pipelines/pipeline/image_pipeline.py and its parts: the transformer's
image branch, the CLIP vision encoder, the condition latents and mask).

Reference: tiny diffusers `WanImageToVideoPipeline`s (random weights, ByT5 tokenizer, a tiny
transformers CLIP vision model and `CLIPImageProcessor`, so nothing is downloaded) saved with
`save_pretrained` and read back by `WanImageToVideoPipeline.from_pretrained`; both run with the same
explicit latents, prompts, images and settings, fp32. Four kinds, one folder each: Wan 2.1 I2V
(CLIP branch, UniPC), Wan 2.1 FLF2V (CLIP branch with two-frame `pos_embed`, first and last image),
Wan 2.2 I2V A14B (36-channel experts without an image branch, boundary 0.9, two guidance scales,
flow-match Euler), and diffusers' own I2V test model (`image_dim` without `added_kv_proj_dim`: the
embedded image tokens join the text context). Text length 512: diffusers' attention splits image from text states by
assuming it. Latent grid F=3, Hl=6, Wl=10 (45 tokens: U * R = 4 pads).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil

import numpy as np
import pytest
import torch

from pipelines import WanImageToVideoPipeline, WanPipeline
from pipelines.wan import pretrained
from tests.numerics import assert_psnr_at_least
from tests.torch_weights import randomize

pytestmark = pytest.mark.numerics

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

PARITY_DB = 90.0  # fp32 on both sides: summation order only (the acceptance bar)
CONTROL_DB = 60.0  # another image must move the video further than this from the reference
PROMPTS = ["a red fox running through snow", "two cats on a roof"]
NEGATIVES = ["blurry", ""]
SIZE = dict(height=48, width=80, num_frames=9)  # tests/pipelines/pipeline/test_wan_pipeline.py's size: the VAE programs are shared
TEXT_LEN = 512
CLIP_WIDTH = 24
KINDS = ("i2v", "flf2v", "a14b", "i2v-context")  # i2v-context: diffusers' own test model (image_dim, no added K/V)


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
  base = dataclasses.replace(pretrained.TINY_TRANSFORMER, in_channels=36, out_channels=16)
  if kind != "a14b":  # i2v-context: the image tokens join the text context, as diffusers' I2V test builds it
    base = dataclasses.replace(base, image_dim=CLIP_WIDTH, added_kv_proj_dim=None if kind == "i2v-context" else base.dim,
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
    scheduler = _unipc()
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


@pytest.mark.parametrize("kind,mesh", [("i2v", None), ("flf2v", "CFG=2,U=2,R=1")])
def test_image_kv_once_equals_recomputing_every_step(kinds, kind, mesh, monkeypatch):
  """The image's cross-attention K/V (add_k_proj, norm_added_k, add_v_proj) computed once with the
  text's before the loop (`transformer.text_kv`): the same latents, bit for bit, as computing them
  inside every step (`text_kv_once=False`), on one device and on a CFG-split mesh. Positive
  controls: the held step program has no matmul over the CLIP width (the image embedder and the
  image K/V are gone from it) while the in-step one has, and the latents moved."""
  from pipelines.pipeline.run.call_options import CallOptions
  from pipelines.pipeline.checked.request import GenerationRequest
  from pipelines.pipeline.run.step import CompiledSteps

  _, _, pipe = kinds(kind)
  images = []
  original = CompiledSteps.text_kv

  def text_kv(self, params, text, image=None, **kwargs):
    images.append(None if image is None else image.shape)
    return original(self, params, text, image, **kwargs)

  monkeypatch.setattr(CompiledSteps, "text_kv", text_kv)
  request = GenerationRequest.build(pipe.facts, **_call_args(kind), latents=LATENTS, mesh=mesh, decode=False)
  once = pipe.generate(request, CallOptions(progress=False))
  frames = 2 if kind == "flf2v" else 1
  assert images == [(2 * len(PROMPTS) * frames, 17, CLIP_WIDTH)]  # once, the [cond; uncond] rows
  every = pipe.generate(request, CallOptions(progress=False, text_kv_once=False))
  assert len(images) == 1
  np.testing.assert_array_equal(once.latents, every.latents)
  assert np.abs(once.latents - LATENTS).max() > 0.1
  held, in_step = (p.as_text() for p in pipe.compiled_steps.programs()[-2:])
  clip_matmul = re.compile(rf"= f32\[\d+,{CLIP_WIDTH}\]\{{[^}}]*\}} dot\(")  # the image embedder's proj_in
  assert clip_matmul.search(in_step) and not clip_matmul.search(held)


# --- folder forms ---------------------------------------------------------------------------------

def _variant(tmp_path, folder: str, name: str, **index_changes) -> str:
  """A copy of `folder` (symlinked components) with model_index.json changed; a None value drops
  that component as diffusers saves a None one ([null, null], no folder)."""
  import json
  import os

  copy = tmp_path / name
  copy.mkdir()
  index = json.loads(open(os.path.join(folder, "model_index.json")).read())
  for key, value in index_changes.items():
    index[key] = [None, None] if value is None else value
  for entry in os.listdir(folder):
    if entry != "model_index.json" and index_changes.get(entry, "") is not None:
      os.symlink(os.path.join(folder, entry), copy / entry)
  (copy / "model_index.json").write_text(json.dumps(index))
  return str(copy)


def _unipc():
  return diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                           num_train_timesteps=1000)


def _set_index(folder: str, **changes) -> None:
  import json

  path = f"{folder}/model_index.json"
  index = json.loads(open(path).read())
  index.update(changes)
  open(path, "w").write(json.dumps(index))


def test_low_noise_expert_only_folder(kinds, tmp_path):
  """The Wan 2.2 form diffusers' tests save: no transformer/, boundary_ratio 1.0 (every t < 1000,
  so only transformer_2 runs, with guidance_scale_2 = guidance_scale). Ours loads transformer_2 as
  the one expert: >= 90 dB against diffusers on that folder; the T2V class reads the same form."""
  from pipelines.wan.pretrained import PipelineIndex

  folder, _, _ = kinds("a14b")
  # UniPC (as diffusers' test): its first t is < 1000; flow-match Euler starts at t = 1000, where
  # diffusers would call the absent transformer (ours runs transformer_2 at every step).
  variant = _variant(tmp_path, folder, "low_only", transformer=None, boundary_ratio=1.0, scheduler=None)
  _unipc().save_pretrained(f"{variant}/scheduler")
  _set_index(variant, scheduler=["diffusers", "UniPCMultistepScheduler"])
  ref_pipe = diffusers.WanImageToVideoPipeline.from_pretrained(variant)
  ref_pipe.set_progress_bar_config(disable=True)
  args = {k: v for k, v in _call_args("a14b").items() if k != "guidance_scale_2"}
  with torch.no_grad():
    ref = ref_pipe(**args, latents=torch.from_numpy(LATENTS.copy()), output_type="np").frames
  pipe = WanImageToVideoPipeline.from_pretrained(variant)
  assert pipe.num_experts == 1 and pipe.boundary_ratio is None
  frames = pipe(**args, latents=LATENTS, progress=False)
  assert_psnr_at_least(frames, ref, PARITY_DB, name="transformer_2-only folder vs diffusers")
  t2v = _variant(tmp_path, folder, "low_only_t2v", transformer=None, boundary_ratio=1.0,
                 _class_name="WanPipeline")
  index = PipelineIndex.read(t2v)
  assert index.experts == ("transformer_2",) and not index.image_to_video
  with pytest.raises(ValueError, match="load it with WanImageToVideoPipeline.from_pretrained"):
    WanPipeline.from_pretrained(folder)


# --- the generate command -------------------------------------------------------------------------

def _pass_through_transformer():
  """A 36-channel I2V transformer (with the CLIP branch) built to predict v = x - c (noise channels
  minus condition-latent channels): every block's gates, the cross-attention's output and the time
  embedding are zero, so the tokens reach the output norm as the patch embedding made them,
  [x - c, c - x] (mean 0); that norm's eps 1e10 swamps the variance in fp32, and its scale 1e5 - 1
  undoes the 1 / sqrt(eps), so the output is exactly linear. One flow-match Euler step from sigma 1
  to 0 then lands on x - (x - c) = c: the video decodes the condition latents, whose first frame is
  the VAE's reconstruction of the image."""
  config = dataclasses.replace(pretrained.TINY_TRANSFORMER, num_attention_heads=2, attention_head_dim=64,
                               num_layers=1, in_channels=36, out_channels=16, eps=1e10, image_dim=CLIP_WIDTH,
                               added_kv_proj_dim=128)
  model = diffusers.WanTransformer3DModel(**config.to_dict())
  with torch.no_grad():
    for p in model.parameters():
      p.zero_()
    patch = model.patch_embedding.weight  # [D, 36, 1, 2, 2]
    for c in range(16):
      for i in range(2):
        for j in range(2):
          o = (i * 2 + j) * 16 + c  # diffusers' unpatchify order (p_t, p_h, p_w, C_out)
          patch[o, c, 0, i, j], patch[o, 20 + c, 0, i, j] = 1.0, -1.0
          patch[64 + o, c, 0, i, j], patch[64 + o, 20 + c, 0, i, j] = -1.0, 1.0
    model.proj_out.weight[:, :64] = torch.eye(64)
    model.scale_shift_table[0, 1] = 1e5 - 1.0  # output norm: (1 + scale) = sqrt(eps)
  return model


@pytest.fixture(scope="module")
def pass_through_folder(tmp_path_factory):
  folder = str(tmp_path_factory.mktemp("pass_through"))
  vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                   temperal_downsample=[False, True, True])
  text_encoder = transformers.UMT5EncoderModel(transformers.UMT5Config(
      vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
      relative_attention_num_buckets=32, feed_forward_proj="gated-gelu"))
  encoder, processor = _clip(with_projection=False)
  diffusers.WanImageToVideoPipeline(
      tokenizer=transformers.ByT5Tokenizer(), text_encoder=text_encoder, vae=vae,
      scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=1.0), image_encoder=encoder,
      image_processor=processor, transformer=_pass_through_transformer()).save_pretrained(folder)
  # The trained tiny default's VAE (a random one reconstructs every image as about the same blur).
  shutil.rmtree(f"{folder}/vae")
  os.symlink(os.path.join(pretrained.TINY_DEFAULT_FOLDER, "vae"), f"{folder}/vae")
  return folder


def _shape_image(colour, top_left) -> np.ndarray:
  """A shapes-world frame (the tiny default's VAE knows them): a solid square on a dark background."""
  image = np.full((48, 80, 3), 20, np.uint8)
  y, x = top_left
  image[y:y + 16, x:x + 16] = colour
  return image


def test_generate_image_first_frame_is_the_image(pass_through_folder, tmp_path, capsys):
  """`generate --image` end to end: the video's first frame is the VAE's reconstruction of the
  image (>= 90 dB from encoding and decoding the image alone), so it equals the image within the
  VAE's reconstruction error; the sidecar records the image's digest. Positive control: the
  reconstruction of another image is far from it."""
  import json

  from pipelines.cli import generate
  from pipelines.pipeline.checked.image_inputs import digest, to_video_frame
  from pipelines.wan import vae as wan_vae

  image = _shape_image((220, 40, 40), (8, 10))
  PIL.fromarray(image).save(tmp_path / "first.png")
  out = tmp_path / "video.npy"
  argv = ["--model", pass_through_folder, "--image", str(tmp_path / "first.png"), "--prompt", "a fox",
          "--size", "80x48", "--frames", "9", "--steps", "1", "--guidance", "1", "--seed", "0",
          "--max-sequence-length", "16", "--dtype", "float32", "--out", str(out)]
  assert generate.main(argv) == 0, capsys.readouterr().err
  video = np.load(out)
  assert video.shape == (9, 48, 80, 3)  # test_output's size and VAE (tests/pipelines/cli): its decode program is shared
  pipe = WanImageToVideoPipeline.from_pretrained(pass_through_folder)

  def reconstruction(img):
    frame = to_video_frame(img, 48, 80)[:, None][None]  # [1, 3, 1, H, W]
    latent = wan_vae.encode(pipe.vae, frame).mean
    return (np.asarray(wan_vae.decode(pipe.vae, latent))[0, :, 0].transpose(1, 2, 0) + 1) / 2

  recon = np.clip(reconstruction(image), 0, 1)
  assert_psnr_at_least(video[0], recon, PARITY_DB, name="first frame vs the VAE's reconstruction")
  vae_db = psnr(recon, image / 255.0)
  print(f"first frame vs the image: {psnr(video[0], image / 255.0):.1f} dB (the VAE's own: {vae_db:.1f} dB)")
  assert vae_db > 20, "the VAE does not reconstruct the image: the check above would be vacuous"
  assert psnr(np.clip(reconstruction(_shape_image((40, 40, 220), (24, 50))), 0, 1), recon) < CONTROL_DB
  sidecar = json.loads(open(f"{out}.json").read())
  assert sidecar["settings"]["image_sha256"] == digest(image)


@pytest.mark.parametrize("case", ["text_model_given_image", "image_model_no_image", "last_without_first",
                                  "missing_file"])
def test_generate_refuses_before_loading(pass_through_folder, tmp_path, capsys, monkeypatch, case):
  """Wrong image flags fail with exit status 2 before any weight is loaded or step compiled, the
  message naming the fix."""
  from tests.harness import step_compiles
  from pipelines.cli import generate
  from pipelines.pipeline.load import loading

  loads = []
  monkeypatch.setattr(loading, "folder_parts", lambda *a, **k: loads.append(a))
  compiles = step_compiles(monkeypatch)
  PIL.fromarray(_shape_image((220, 40, 40), (8, 10))).save(tmp_path / "first.png")
  image = ["--image", str(tmp_path / "first.png")]
  extra, message = {
      "text_model_given_image": (["--model", "tiny-random", *image], "needs an image-to-video model: a folder"),
      "image_model_no_image": (["--model", pass_through_folder], "--image: image=None: this image-to-video model needs"),
      "last_without_first": (["--model", pass_through_folder, "--last-image", str(tmp_path / "first.png")],
                             "--last-image needs --image too"),
      "missing_file": (["--model", pass_through_folder, "--image", str(tmp_path / "nope.png")],
                       "--image " + repr(str(tmp_path / "nope.png")) + " is not a file"),
  }[case]
  argv = ["--prompt", "a fox", "--size", "80x48", "--frames", "5", "--steps", "1", "--out",
          str(tmp_path / "x.npy"), *extra]
  assert generate.main(argv) == 2
  assert message in capsys.readouterr().err
  assert loads == [] and compiles == []


def test_size_follows_the_image(pass_through_folder, tmp_path):
  """Without --size the video takes the image's aspect ratio within the preset's area, floored
  to the model's multiple as Wan2.1 image2video.py does (832x480 area, a 5:3 image: 800x480)."""
  from pipelines.cli import run_plan
  from pipelines.cli.flags import build_parser
  from pipelines.commands.presets import size_for_image

  assert size_for_image(768, 1024, 1280 * 720, 16) == (1104, 816)  # Wan's lat_h 102 x 8, lat_w 138 x 8
  PIL.fromarray(np.zeros((60, 100, 3), np.uint8)).save(tmp_path / "wide.png")
  args = build_parser().parse_args(["--model", pass_through_folder, "--preset", "wan2.1-i2v-14b-480p",
                                    "--image", str(tmp_path / "wide.png"), "--prompt", "a fox",
                                    "--out", str(tmp_path / "x.npy"), "--no-checkpoint"])
  checked = run_plan.check_plan(run_plan.plan_run(args))
  assert (checked.request.width, checked.request.height) == (800, 480)
  assert checked.request.steps == 40 and checked.request.image is not None


def test_image_inputs_checked_and_in_the_identity(pass_through_folder):
  """The request's image checks (no compute) and the digests in its settings and resume identity:
  another image is another run."""
  from pipelines.pipeline.checked.model_facts import ModelFacts
  from pipelines.pipeline.checked.request import GenerationRequest

  facts = ModelFacts.from_folder(pass_through_folder, "float32")
  assert facts.image_to_video
  build = lambda **kw: GenerationRequest.build(facts, "a fox", height=48, width=80, num_frames=5,  # noqa: E731
                                               num_inference_steps=1, seed=0, **kw)
  first = _shape_image((220, 40, 40), (8, 10))
  a, b = build(image=first), build(image=first.astype(np.float32) / 255)
  c = build(image=PIL.fromarray(_shape_image((40, 40, 220), (8, 10))))
  identity = lambda r: r.identity("fingerprint", np.zeros(1, np.float32))  # noqa: E731
  assert identity(a) == identity(build(image=first.copy())) and a.settings()["image_sha256"]
  assert identity(a)["image_sha256"] != identity(b)["image_sha256"] != identity(c)["image_sha256"]
  for kwargs, message in [
      ({}, "image=None: this image-to-video model needs"),
      (dict(image=first[..., :2]), r"image has shape \(48, 80, 2\)"),
      (dict(image=first.astype(np.float32)), r"must hold finite values in \[0, 1\]"),
      (dict(image="first.png"), "must be a PIL image"),
      (dict(image=first, last_image=first), "embeds one frame; first-last-frame needs an FLF2V folder"),
      (dict(image=first, image_embeds=np.zeros((1, 17, 5), np.float32)), r"image_embeds has shape \(1, 17, 5\)"),
  ]:
    with pytest.raises(ValueError, match=message):
      build(**kwargs)
  t2v = ModelFacts.tiny_random("float32")
  with pytest.raises(ValueError, match=r"this is a text-to-video model; .* or the tiny one shipped here, "
                     r"WanPipeline.tiny\(image=True\) \(generate --model tiny-i2v\)"):
    GenerationRequest.build(t2v, "a fox", image=first, seed=0)
