"""Tests for pipelines/wan/lora/fuse.py: LoRA loading against diffusers, exact unfuse, refusals, experts.

Reference: the tiny diffusers Wan 2.1 pipeline of tests/pipelines/pipeline/test_wan_pipeline.py with a peft LoRA (rank 4,
lora_alpha 8, `blocks.1.attn1.to_q` at rank 2 through rank_pattern; random non-zero lora_A and
lora_B) on every block's attn1 / attn2 to_q, to_k, to_v, to_out.0 and ffn, plus
condition_embedder.time_proj and proj_out. It is saved with diffusers' `save_lora_weights` (with
the adapter metadata that carries the alphas) and written again in the original Wan key format
(lora_down / lora_up / alpha); diffusers loads each (peft layers, unfused) and runs it with
`attention_kwargs={"scale": s}`; we load the same files and fuse them into the weights.

The other tests use `WanPipeline.tiny(random=True)` (the same architecture) and LoRAs drawn in numpy, so only
the parity test builds torch models.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.numerics import FP32_VIDEO_PSNR_DB, assert_psnr_at_least
from pipelines import WanPipeline
from pipelines.wan import lora, pretrained
from pipelines.wan.lora import fuse as lora_fuse
from pipelines.storage.weights import CheckpointError
from pipelines.wan.transformer import init_transformer
from tests.harness import step_compiles

PROMPT = "a red fox running through snow"
# One prompt, CFG on: the transformer runs on 2 rows. Latents [1, 16, 3, 6, 10] (45 tokens).
CALL = dict(height=48, width=80, num_frames=9, num_inference_steps=2, guidance_scale=4.0,
            max_sequence_length=32)
LATENTS = np.random.default_rng(2).standard_normal((1, 16, 3, 6, 10)).astype(np.float32)
SCALES = (0.5, 1.0)
# diffusers module names of the adapted layers (peft target_modules match name suffixes).
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2", "time_proj", "proj_out"]
RANK, ALPHA, RANK_PATTERN = 4, 8, {"blocks.1.attn1.to_q": 2}

# diffusers module name -> original Wan module name (the inverse of diffusers' conversion).
_WAN_NAMES = [("attn1.to_out.0", "self_attn.o"), ("attn2.to_out.0", "cross_attn.o"),
              ("attn1.to_", "self_attn."), ("attn2.to_", "cross_attn."), ("ffn.net.0.proj", "ffn.0"),
              ("ffn.net.2", "ffn.2"), ("condition_embedder.time_proj", "time_projection.1"),
              ("proj_out", "head.head")]


def _wan_format(state: dict[str, np.ndarray], alphas: dict[str, float]) -> dict[str, np.ndarray]:
  """A diffusers-format LoRA (scaling alpha / rank per module) as the original Wan key format.

  diffusers' conversion reads `alpha` only inside the blocks, so outside them the scaling is folded
  into lora_up (scaling 1, as there)."""
  out = {}
  for key, value in state.items():
    module, part = key.removeprefix("transformer.").split(".lora_")
    wan = module
    for ours, theirs in _WAN_NAMES:
      wan = wan.replace(ours, theirs)
    rank = state[f"transformer.{module}.lora_A.weight"].shape[0]
    in_blocks = module.startswith("blocks.")
    if part == "A.weight":
      out[f"diffusion_model.{wan}.lora_down.weight"] = value
      if in_blocks:
        out[f"diffusion_model.{wan}.alpha"] = np.asarray(alphas[module], np.float32)
    else:
      fold = 1 if in_blocks else alphas[module] / rank
      out[f"diffusion_model.{wan}.lora_up.weight"] = value * np.float32(fold)
  return out


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
  """The saved pipeline, the two LoRA files and diffusers' videos (no LoRA; each format x scale)."""
  diffusers = pytest.importorskip("diffusers")
  peft = pytest.importorskip("peft")
  import torch
  from tests.pipelines.pipeline.test_wan_pipeline import _save_diffusers_pipeline

  root = tmp_path_factory.mktemp("lora")
  folder = str(root / "wan21")
  _save_diffusers_pipeline(folder, two_experts=False)
  pipe = diffusers.WanPipeline.from_pretrained(folder)
  pipe.set_progress_bar_config(disable=True)

  def run(**kwargs):
    with torch.no_grad():
      return pipe(PROMPT, **CALL, latents=torch.from_numpy(LATENTS.copy()), output_type="np", **kwargs).frames

  out = {"folder": folder, "refs": {"base": run()}}
  config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, rank_pattern=RANK_PATTERN, target_modules=TARGETS,
                           init_lora_weights=False)
  pipe.transformer.add_adapter(config, adapter_name="made")
  gen = torch.Generator().manual_seed(3)
  with torch.no_grad():
    for name, p in pipe.transformer.named_parameters():
      if "lora_" in name:  # |B @ A| ~ 0.1 x the layer's weights: a visible but tame change
        p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if "lora_B" in name else 1 / np.sqrt(p.shape[1])))
  state = peft.get_peft_model_state_dict(pipe.transformer, adapter_name="made")
  metadata = pipe.transformer.peft_config["made"].to_dict()
  pipe.transformer.delete_adapters("made")
  diffusers.WanPipeline.save_lora_weights(str(root / "diffusers_lora"), transformer_lora_layers=state,
                                          transformer_lora_adapter_metadata=metadata)
  out["diffusers"] = str(root / "diffusers_lora")
  numpy_state = {f"transformer.{k}": v.numpy() for k, v in state.items()}
  alphas = {k.split(".lora_")[0].removeprefix("transformer."): ALPHA for k in numpy_state}
  out["wan"] = str(root / "wan_lora.safetensors")
  save_file(_wan_format(numpy_state, alphas), out["wan"])
  for fmt in ("diffusers", "wan"):
    pipe.load_lora_weights(out[fmt], adapter_name=fmt)
  for fmt in ("diffusers", "wan"):
    pipe.set_adapters(fmt)
    for scale in SCALES:
      out["refs"][fmt, scale] = run(attention_kwargs={"scale": scale})
  return out


@pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute")  # peft: a second adapter
def test_diffusers_parity(parity):
  """Both formats x scales 0.5 and 1 against diffusers (fp32, same latents), and the positive control:
  the LoRA moves the video far more than the parity bar allows."""
  pipe = WanPipeline.from_pretrained(parity["folder"])
  # The alphas come from diffusers' adapter metadata: alpha / r = 8 / 4, and 8 / 2 for the
  # rank_pattern module (without them the scaling would be 1, diffusers' default).
  layers = lora.parse_lora(*lora.read_lora(parity["diffusers"])[:2], pipe.transformer_config)
  assert {x.module: x.scaling for x in layers if x.scaling != ALPHA / RANK} == {"blocks.1.attn1.to_q": 4.0}
  assert len(layers) == 2 * 10 + 2  # 2 blocks x (2 x 4 attention + 2 ffn) + time_proj + proj_out
  refs = parity["refs"]
  base = pipe(PROMPT, **CALL, latents=LATENTS, progress=False)
  assert_psnr_at_least(base, refs["base"], FP32_VIDEO_PSNR_DB, name="no LoRA vs diffusers")
  for fmt in ("diffusers", "wan"):
    for scale in SCALES:
      if fmt == "diffusers":  # the scale as the adapter's weight
        pipe.load_lora_weights(parity[fmt], scale=scale)
      else:  # as attention_kwargs={"scale": s} maps onto ours
        pipe.load_lora_weights(parity[fmt])
        pipe.set_lora_scale(scale)
      frames = pipe(PROMPT, **CALL, latents=LATENTS, progress=False)
      value = assert_psnr_at_least(frames, refs[fmt, scale], FP32_VIDEO_PSNR_DB,
                                   name=f"{fmt}-format LoRA at scale {scale} vs diffusers")
      print(f"{fmt} scale {scale}: {value:.1f} dB vs diffusers")
      pipe.unload_lora_weights()
  # Positive control: the LoRA changes diffusers' video by far more than the bar (< 40 dB apart).
  rms = float(np.sqrt(np.mean((refs["diffusers", 1.0] - refs["base"]) ** 2)))
  assert rms > 10 ** (-40 / 20), f"the LoRA barely changes the video (RMS {rms:.2g})"
  np.testing.assert_array_less(0, np.abs(refs["diffusers", 1.0] - refs["diffusers", 0.5]).max())
  print(f"LoRA at scale 1 vs no LoRA: {-20 * np.log10(rms):.1f} dB")


@pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute")
def test_call_scale_equals_diffusers_and_restores_the_pipeline_scale(parity):
  """A peft LoRA loaded at weight 1, then a call with attention_kwargs={"scale": 0.5}: diffusers'
  video at that call scale; afterwards the pipeline's own scale is what it was (not 1.0), and a
  call without attention_kwargs is diffusers' scale-1 video again."""
  pipe = WanPipeline.from_pretrained(parity["folder"])
  pipe.load_lora_weights(parity["diffusers"])
  refs = parity["refs"]
  frames = pipe(PROMPT, **CALL, latents=LATENTS, progress=False, attention_kwargs={"scale": 0.5})
  value = assert_psnr_at_least(frames, refs["diffusers", 0.5], max(50.0, FP32_VIDEO_PSNR_DB),
                               name="attention_kwargs scale 0.5 vs diffusers")
  print(f"call scale 0.5: {value:.1f} dB vs diffusers")
  assert pipe.lora_scale == 1.0
  again = pipe(PROMPT, **CALL, latents=LATENTS, progress=False)
  assert_psnr_at_least(again, refs["diffusers", 1.0], FP32_VIDEO_PSNR_DB, name="after the call: scale 1")
  pipe.set_lora_scale(0.8)
  pipe(PROMPT, **CALL, latents=LATENTS, progress=False, output_type="latent", attention_kwargs={"scale": 0.5})
  assert pipe.lora_scale == 0.8  # restored to the pipeline's scale, not to 1.0
  # Positive control: the two diffusers videos differ by more than the bar allows.
  from tests.pipelines.pipeline.test_wan_pipeline import psnr
  assert psnr(refs["diffusers", 0.5], refs["diffusers", 1.0]) < 45


# --- cheap checks on the embedded tiny model (numpy LoRAs, no torch) -------------------------------

def _numpy_lora(config, seed: int = 0, rank: int = 2, modules=None) -> dict[str, np.ndarray]:
  """A diffusers-format LoRA on `modules` (default: every Linear of the model), random A and B."""
  rng = np.random.default_rng(seed)
  layers = lora.linear_layers(config)
  state = {}
  for module in modules or layers:
    (out_dim, in_dim), _, _ = layers[module]
    state[f"transformer.{module}.lora_A.weight"] = rng.standard_normal((rank, in_dim), np.float32)
    state[f"transformer.{module}.lora_B.weight"] = rng.standard_normal((out_dim, rank), np.float32) * 0.1
  return state


def _leaves(pipe: WanPipeline, expert: int = 0) -> dict:
  leaves = jax.tree_util.tree_flatten_with_path(pipe._experts[expert])[0]
  return {lora_fuse._state_path(k): np.asarray(v) for k, v in leaves}


def _same(a: dict, b: dict) -> bool:
  return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def tiny():
  return WanPipeline.tiny(random=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fuse_is_one_rounding_and_unfuse_is_exact(dtype):
  pipe = WanPipeline.tiny(dtype, random=True) if dtype == "bfloat16" else WanPipeline.tiny(random=True)
  config = pipe.transformer_config
  base = _leaves(pipe)
  state = _numpy_lora(config)
  state["transformer.blocks.1.attn1.to_q.lora_B.bias"] = np.ones(config.dim, np.float32)
  pipe.load_lora_weights(state, scale=0.7)
  fused = _leaves(pipe)
  # blocks.{i}.attn1.to_q: W[i] = round(base + 0.7 * (B @ A).T), b[1] = round(b + 0.7 * bias) (peft merge).
  kernel = ("blocks", "attn1", "to_q", "kernel")
  want = base[kernel].astype(np.float32)
  for i in range(config.num_layers):
    module = f"transformer.blocks.{i}.attn1.to_q"
    want[i] += np.float32(0.7) * (state[f"{module}.lora_B.weight"] @ state[f"{module}.lora_A.weight"]).T
  np.testing.assert_array_equal(fused[kernel], want.astype(base[kernel].dtype))
  bias = ("blocks", "attn1", "to_q", "bias")
  want_bias = (base[bias][1].astype(np.float32) + np.float32(0.7)).astype(base[bias].dtype)
  np.testing.assert_array_equal(fused[bias][1], want_bias)
  np.testing.assert_array_equal(fused[bias][0], base[bias][0])
  assert fused[("scale_shift_table",)].dtype == np.float32  # kept-fp32 parameters stay fp32
  # The time embedder is kept in fp32 and adapted in fp32.
  assert not np.array_equal(fused[("condition_embedder", "time_embedder", "linear_1", "kernel")],
                            base[("condition_embedder", "time_embedder", "linear_1", "kernel")])
  pipe.unfuse_lora()
  assert _same(_leaves(pipe), base)
  pipe.fuse_lora()
  assert _same(_leaves(pipe), fused)
  # A new scale re-fuses from the base (no accumulated rounding): 0.3 then 0.7 == 0.7 directly.
  pipe.set_lora_scale(0.3 / 0.7)
  assert pipe.set_lora_scale(1.0) == pytest.approx(0.3 / 0.7)
  assert _same(_leaves(pipe), fused)
  pipe.unload_lora_weights()
  assert _same(_leaves(pipe), base) and pipe.get_list_adapters() == {}


def test_wan_format_alpha_matches_diffusers_format(tiny, tmp_path):
  """Original Wan keys (lora_down / lora_up / alpha) fuse as the same LoRA in diffusers keys with
  lora_alpha in the metadata: the same scaling alpha / r."""
  config = tiny.transformer_config
  modules = ["blocks.0.attn1.to_q", "blocks.1.ffn.net.2", "blocks.0.attn2.to_out.0"]
  state = _numpy_lora(config, modules=modules)
  wan = _wan_format(state, {m: 3.0 for m in modules})
  ours = lora.parse_lora(wan, None, config)
  ref = lora.parse_lora(state, {"transformer.r": 2, "transformer.lora_alpha": 3.0}, config)
  assert [x.module for x in ours] == [x.module for x in ref]
  for x, y in zip(ours, ref):
    np.testing.assert_allclose(x.delta_kernel(), y.delta_kernel(), rtol=1e-6, atol=1e-7)
    assert y.scaling == 1.5 and x.scaling == 1.5
  # Most published LoRAs are bf16 files: read as fp32 values.
  import ml_dtypes
  path = _write(tmp_path / "bf16.safetensors", {k: v.astype(ml_dtypes.bfloat16) for k, v in wan.items()})
  state, metadata, _ = lora.read_lora(path)
  assert metadata is None and all(v.dtype == np.float32 for v in state.values())
  np.testing.assert_array_equal(state["diffusion_model.blocks.0.self_attn.q.lora_down.weight"],
                                wan["diffusion_model.blocks.0.self_attn.q.lora_down.weight"]
                                .astype(ml_dtypes.bfloat16).astype(np.float32))


def _write(path, state):
  save_file(state, str(path))
  return str(path)


def test_refused_keys_and_shapes_name_them_and_change_nothing(tiny, tmp_path):
  config = tiny.transformer_config
  base = _leaves(tiny)
  traced = tiny.compiled_steps.traces
  good = _numpy_lora(config, modules=["blocks.0.attn1.to_q"])
  bad_key = {**good, "transformer.blocks.0.attn1.to_x.lora_A.weight": np.zeros((2, 128), np.float32),
             "transformer.blocks.7.attn1.to_q.lora_A.weight": np.zeros((2, 128), np.float32)}
  with pytest.raises(ValueError, match=r"blocks\.0\.attn1\.to_x\.lora_A\.weight.*blocks\.7\.attn1"):
    tiny.load_lora_weights(_write(tmp_path / "key.safetensors", bad_key))
  bad_shape = {**good, "transformer.blocks.0.attn1.to_q.lora_B.weight": np.zeros((64, 2), np.float32)}
  with pytest.raises(ValueError, match=r"attn1\.to_q\.lora_B\.weight \(64, 2\) \(model wants \(128, 2\)\)"):
    tiny.load_lora_weights(bad_shape)
  with pytest.raises(ValueError, match="needs both lora_A.weight and lora_B.weight"):
    tiny.load_lora_weights({"transformer.blocks.0.attn1.to_q.lora_A.weight": np.zeros((2, 128), np.float32)})
  wan_i2v = {"diffusion_model.blocks.0.cross_attn.k_img.lora_down.weight": np.zeros((2, 128), np.float32),
             "diffusion_model.blocks.0.cross_attn.k_img.lora_up.weight": np.zeros((128, 2), np.float32)}
  with pytest.raises(ValueError, match=r"diffusion_model\.blocks\.0\.cross_attn\.k_img\.lora_down"):
    tiny.load_lora_weights(wan_i2v)
  with pytest.raises(ValueError, match="load_into_transformer_2=True needs a two-expert"):
    tiny.load_lora_weights(good, load_into_transformer_2=True)
  with pytest.raises(ValueError, match="scale=nan must be a finite number"):
    tiny.load_lora_weights(good, scale=float("nan"))
  (tmp_path / "lora.bin").write_bytes(b"")
  with pytest.raises(CheckpointError, match="pickle"):
    tiny.load_lora_weights(str(tmp_path / "lora.bin"))
  two = tmp_path / "two"
  two.mkdir()
  _write(two / "a.safetensors", good)
  _write(two / "b.safetensors", good)
  with pytest.raises(CheckpointError, match="several safetensors files"):
    tiny.load_lora_weights(str(two))
  with pytest.raises(CheckpointError, match="no such file"):
    tiny.load_lora_weights(str(two), weight_name="c.safetensors")
  assert _same(_leaves(tiny), base) and tiny.get_list_adapters() == {}
  assert tiny.compiled_steps.traces == traced
  # A folder with diffusers' file name loads; a second adapter of the same name is refused.
  _write(two / lora.LORA_WEIGHT_NAME_SAFE, good)
  assert tiny.load_lora_weights(str(two)) == "default_0"
  assert tiny.load_lora_weights(str(two), weight_name="b.safetensors") == "default_1"
  with pytest.raises(ValueError, match="'default_0' is already loaded into transformer"):
    tiny.load_lora_weights(good, adapter_name="default_0")
  tiny.unload_lora_weights()
  assert _same(_leaves(tiny), base)


def test_lora_file_is_read_once(tiny, tmp_path, monkeypatch):
  """`load_lora_weights` opens the file once (one memory map gives its tensors and its digest), and
  the adapter's sha256 is the file's (the digest `lora_digest` computes by reading it again)."""
  import builtins
  import hashlib

  path = _write(tmp_path / "once.safetensors", _numpy_lora(tiny.transformer_config, modules=["blocks.0.attn1.to_q"]))
  opened, real_open = [], builtins.open

  def counting_open(file, *args, **kwargs):
    if isinstance(file, (str, os.PathLike)) and os.fspath(file) == path:
      opened.append(args)
    return real_open(file, *args, **kwargs)

  monkeypatch.setattr(builtins, "open", counting_open)
  tiny.load_lora_weights(path, adapter_name="once")
  monkeypatch.undo()
  try:
    assert len(opened) == 1, opened
    [adapter] = [a for a in tiny.lora_info()["adapters"] if a["name"] == "once"]
    assert adapter["sha256"] == hashlib.sha256(open(path, "rb").read()).hexdigest() == lora.lora_digest(path)
    assert adapter["layers"] == 1
  finally:
    tiny.unload_lora_weights()


def test_two_experts_load_into_transformer_2():
  """diffusers' `load_into_transformer_2=True`: the LoRA goes into the low-noise expert only."""
  tiny = WanPipeline.tiny(random=True)
  config = tiny.transformer_config
  pipe = WanPipeline(tokenizer=tiny.tokenizer, text_encoder=(tiny.text_encoder_config, tiny._text_params),
                     transformers=[init_transformer(config, 0), init_transformer(config, 1)], vae=tiny.vae,
                     scheduler_config=tiny.scheduler_config, boundary_ratio=0.875)
  base = [_leaves(pipe, 0), _leaves(pipe, 1)]
  high, low = _numpy_lora(config, seed=1), _numpy_lora(config, seed=2)
  assert pipe.load_lora_weights(low, adapter_name="low", load_into_transformer_2=True) == "low"
  assert _same(_leaves(pipe, 0), base[0]) and not _same(_leaves(pipe, 1), base[1])
  pipe.load_lora_weights(high, adapter_name="high")
  assert pipe.get_list_adapters() == {"transformer_2": ["low"], "transformer": ["high"]}
  # Each expert holds only its own LoRA: unloading restores both.
  single = WanPipeline(tokenizer=tiny.tokenizer, text_encoder=(tiny.text_encoder_config, tiny._text_params),
                       transformers=[init_transformer(config, 1)], vae=tiny.vae,
                       scheduler_config=tiny.scheduler_config)
  single.load_lora_weights(low)
  assert _same(_leaves(pipe, 1), _leaves(single, 0))
  pipe.unload_lora_weights()
  assert _same(_leaves(pipe, 0), base[0]) and _same(_leaves(pipe, 1), base[1])


def test_generate_lora_flag(tmp_path, capsys, monkeypatch):
  """`generate --lora A:0.8 --lora B:0.5` fuses both LoRAs at once, each with its weight (recorded in
  the sidecar with the files' SHA-256, and in the run record); a LoRA that does not fit is refused
  before compute, naming its keys. Sizes as the in-process run of tests/pipelines/cli/test_output.py (one program)."""
  import json

  from pipelines.cli import generate

  config = pretrained.TINY_TRANSFORMER
  path = _write(tmp_path / "fox_lora.safetensors", _numpy_lora(config, modules=["blocks.0.attn1.to_q"]))
  other = _write(tmp_path / "snow_lora.safetensors", _numpy_lora(config, seed=1, modules=["blocks.1.attn2.to_k"]))
  argv = ["--prompt", PROMPT, "--size", "80x48", "--frames", "9", "--steps", "2", "--seed", "1",
          "--max-sequence-length", "32"]
  out = tmp_path / "fox.npy"
  argv_two = argv + ["--lora", f"{path}:0.8", "--lora", f"{other}:0.5", "--out", str(out), "--checkpoint-dir",
                     str(tmp_path / "ckpt"), "--keep-checkpoint"]
  assert generate.main(argv_two) == 0, capsys.readouterr().err
  sidecar = json.loads((tmp_path / "fox.npy.json").read_text())
  assert sidecar["lora"]["adapters"] == [
      {"name": f"default_{i}", "transformer": "transformer", "weight": w, "active": True, "layers": 1,
       "source": p, "sha256": lora.lora_digest(p)} for i, (p, w) in enumerate(((path, 0.8), (other, 0.5)))]
  record = json.loads((tmp_path / "ckpt" / "generate.json").read_text())
  assert record["lora"] == [f"{path}:0.8", f"{other}:0.5"] and record["lora_2"] == []
  from pipelines.pipeline.run import resume as resume_state
  identity = resume_state.read(str(tmp_path / "ckpt")).identity["lora"]
  assert [(a["weight"], a["sha256"]) for a in identity["adapters"]] == [
      (0.8, lora.lora_digest(path)), (0.5, lora.lora_digest(other))]
  # The same command resumed after one LoRA file changed is refused, naming the LoRAs.
  _write(tmp_path / "snow_lora.safetensors", _numpy_lora(config, seed=2, modules=["blocks.1.attn2.to_k"]))
  assert generate.main(["--resume", str(tmp_path / "ckpt"), "--overwrite"]) != 0
  err = capsys.readouterr().err
  assert "is from another run; lora: checkpoint" in err, err
  compiles = step_compiles(monkeypatch)
  bad = _write(tmp_path / "bad.safetensors", {"transformer.blocks.0.attn1.to_x.lora_A.weight":
                                              np.zeros((2, 128), np.float32)})
  for extra, message in ((["--lora", bad], "blocks.0.attn1.to_x.lora_A.weight"),
                         (["--lora", f"{path}:nan"], "must be a finite number"),
                         (["--lora", str(tmp_path / "none.safetensors")], "is not a file or folder"),
                         (["--lora-2", path], "--lora-2 " + repr(path) + " needs a two-expert")):
    assert generate.main(argv + extra + ["--out", str(tmp_path / "x.npy")]) == 2
    err = capsys.readouterr().err
    assert message in err, err
  assert compiles == [] and not os.path.exists(tmp_path / "x.npy")
