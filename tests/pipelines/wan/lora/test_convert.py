"""Tests for the LoRA key layouts (pipelines/wan/lora/convert.py) and several adapters at once
(pipelines/pipeline/load/lora_loading.py) against diffusers.

Reference: the tiny diffusers Wan 2.1 pipeline of tests/pipelines/pipeline/test_wan_pipeline.py, saved once for the
module; each LoRA file is written here in its format's key layout, with several ranks and alphas,
and diffusers loads the same file. diffusers drops full deltas other than `head.head.diff`
(block-linear and norm `.diff`, `diff_m`, "not handled yet"); we add them as ComfyUI does, so
for those the reference is diffusers on a transformer whose weights the test modified by hand
(independent names below, not our converter's) plus diffusers' load of the same file.
"""

from __future__ import annotations

import contextlib
import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from pipelines import WanPipeline
from pipelines.wan import lora
from pipelines.wan.lora import fuse as lora_fuse
from pipelines.wan.pretrained import TINY_TRANSFORMER
from tests.pipelines.pipeline.test_wan_pipeline import psnr

PROMPT = "a red fox running through snow"
CALL = dict(height=48, width=80, num_frames=9, num_inference_steps=2, guidance_scale=4.0,
            max_sequence_length=32)
LATENTS = np.random.default_rng(5).standard_normal((1, 16, 3, 6, 10)).astype(np.float32)
BAR_DB = 50.0  # parity bar; fp32 on both sides (measured values are printed)
D, E, T = TINY_TRANSFORMER.dim, TINY_TRANSFORMER.ffn_dim, TINY_TRANSFORMER.text_dim
FREQ, OUT = TINY_TRANSFORMER.freq_dim, TINY_TRANSFORMER.out_channels * TINY_TRANSFORMER.patch_volume
_ATTN = [("self_attn", "attn1"), ("cross_attn", "attn2")]
_PROJ = [("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0")]
# (original Wan module in a block, its (O, I) torch shape)
_BLOCK_LINEARS = [(f"{a}.{o}", (D, D)) for a, _ in _ATTN for o, _ in _PROJ] + [("ffn.0", (E, D)), ("ffn.2", (D, E))]


def _pair(rng, shape, rank):
  """(down [r, I], up [O, r]): |up @ down| ~ 0.1 x a N/sqrt(I) weight."""
  out_dim, in_dim = shape
  return (rng.standard_normal((rank, in_dim)).astype(np.float32) / np.sqrt(in_dim),
          rng.standard_normal((out_dim, rank)).astype(np.float32) * 0.1)


def _musubi(seed=0):
  """kohya / musubi-tuner keys on every block Linear (diffusers' converter wants them all), ranks 2
  and 4, alphas 1, 3 and 8."""
  rng, state = np.random.default_rng(seed), {}
  for i in range(TINY_TRANSFORMER.num_layers):
    for j, (module, shape) in enumerate(_BLOCK_LINEARS):
      name = f"lora_unet_blocks_{i}_{module.replace('.', '_')}"
      rank, alpha = (2, 1.0) if j % 3 == 0 else (4, 8.0) if j % 3 == 1 else (4, 3.0)
      down, up = _pair(rng, shape, rank)
      state |= {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                f"{name}.alpha": np.asarray(alpha, np.float32)}
  return state


def _lightx2v(seed=1):
  """ComfyUI / lightx2v keys: lora_A / lora_B with alphas and diff_b on the block Linears, norm and
  modulation deltas, a block-Linear `.diff`, `head.head.diff` + `diff_b`, time / text embedding
  and time projection LoRAs with deltas. Returns (state, deltas diffusers drops: diffusers
  parameter -> torch-layout delta)."""
  rng, state, dropped = np.random.default_rng(seed), {}, {}
  small = lambda *shape: (0.05 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
  for i in range(TINY_TRANSFORMER.num_layers):
    for j, (module, shape) in enumerate(_BLOCK_LINEARS):
      key = f"diffusion_model.blocks.{i}.{module}"
      if (i, module) == (1, "cross_attn.v"):  # a full delta instead of a LoRA
        state[f"{key}.diff"] = dropped["blocks.1.attn2.to_v.weight"] = small(D, D) / np.sqrt(D)
        continue
      rank = 2 + j % 3
      down, up = _pair(rng, shape, rank)
      state |= {f"{key}.lora_A.weight": down, f"{key}.lora_B.weight": up, f"{key}.diff_b": small(shape[0]),
                f"{key}.alpha": np.asarray(2.0 * rank if j % 2 else 1.0, np.float32)}
    b = f"diffusion_model.blocks.{i}"
    state[f"{b}.norm3.diff"] = dropped[f"blocks.{i}.norm2.weight"] = small(D)
    state[f"{b}.norm3.diff_b"] = dropped[f"blocks.{i}.norm2.bias"] = small(D)
    state[f"{b}.self_attn.norm_q.diff"] = dropped[f"blocks.{i}.attn1.norm_q.weight"] = small(D)
    state[f"{b}.cross_attn.norm_k.diff"] = dropped[f"blocks.{i}.attn2.norm_k.weight"] = small(D)
    state[f"{b}.diff_m"] = dropped[f"blocks.{i}.scale_shift_table"] = small(1, 6, D)
  state["diffusion_model.head.head.diff"] = small(OUT, D) / np.sqrt(D)
  state["diffusion_model.head.head.diff_b"] = small(OUT)
  for module, shape in (("time_projection.1", (6 * D, D)), ("text_embedding.0", (D, T)),
                        ("time_embedding.0", (D, FREQ))):
    down, up = _pair(rng, shape, 3)
    state |= {f"diffusion_model.{module}.lora_A.weight": down, f"diffusion_model.{module}.lora_B.weight": up,
              f"diffusion_model.{module}.diff_b": small(shape[0])}
  state["diffusion_model.time_embedding.0.diff"] = dropped["condition_embedder.time_embedder.linear_1.weight"] = \
      small(D, FREQ) / np.sqrt(FREQ)
  state["diffusion_model.time_projection.1.diff"] = dropped["condition_embedder.time_proj.weight"] = \
      small(6 * D, D) / np.sqrt(D)
  return state, dropped


def _peft(seed=2):
  """diffusers / peft keys (scaling 1: no metadata), rank 3, on every block's attention."""
  rng, state = np.random.default_rng(seed), {}
  for i in range(TINY_TRANSFORMER.num_layers):
    for _, attn in _ATTN:
      for _, proj in _PROJ:
        down, up = _pair(rng, (D, D), 3)
        state |= {f"transformer.blocks.{i}.{attn}.{proj}.lora_A.weight": down,
                  f"transformer.blocks.{i}.{attn}.{proj}.lora_B.weight": up * 2}
  return state


@contextlib.contextmanager
def _modified(transformer, deltas):
  """diffusers' transformer with `deltas` (parameter name -> torch-layout array) added, restored after."""
  import torch

  params = dict(transformer.named_parameters())
  saved = {k: params[k].detach().clone() for k in deltas}
  with torch.no_grad():
    for k, v in deltas.items():
      params[k].add_(torch.from_numpy(v))
  try:
    yield
  finally:
    with torch.no_grad():
      for k, v in saved.items():
        params[k].copy_(v)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  """The saved pipeline, the LoRA files and diffusers' videos."""
  diffusers = pytest.importorskip("diffusers")
  pytest.importorskip("peft")
  import torch
  from tests.pipelines.pipeline.test_wan_pipeline import _save_diffusers_pipeline

  root = tmp_path_factory.mktemp("lora_formats")
  folder = str(root / "wan21")
  _save_diffusers_pipeline(folder, two_experts=False)
  pipe = diffusers.WanPipeline.from_pretrained(folder)
  pipe.set_progress_bar_config(disable=True)

  def run(**kwargs):
    with torch.no_grad():
      return pipe(PROMPT, **CALL, latents=torch.from_numpy(LATENTS.copy()), output_type="np", **kwargs).frames

  light, dropped = _lightx2v()
  diff_m = {k: v for k, v in light.items() if k.endswith("diff_m")}
  files = {}
  for name, state in (("musubi", _musubi()), ("lightx2v", light), ("peft", _peft()), ("diff_m", diff_m)):
    files[name] = str(root / f"{name}.safetensors")
    save_file(state, files[name])
  refs = {"base": run()}
  pipe.load_lora_weights(files["musubi"], adapter_name="musubi")
  refs["musubi"] = run()
  pipe.load_lora_weights(files["peft"], adapter_name="peft")
  pipe.set_adapters(["musubi", "peft"], [0.7, 0.4])
  refs["two"] = run()
  refs["two", 0.5] = run(attention_kwargs={"scale": 0.5})
  pipe.unload_lora_weights()
  with _modified(pipe.transformer, dropped):
    pipe.load_lora_weights(files["lightx2v"], adapter_name="lightx2v")
    refs["lightx2v"] = run()
    pipe.unload_lora_weights()
    refs["lightx2v_dropped_only"] = run()
  with _modified(pipe.transformer, {k: v for k, v in dropped.items() if k.endswith("scale_shift_table")}):
    refs["diff_m"] = run()
  ours = WanPipeline.from_pretrained(folder)
  ours.set_progress_bar_config(disable=True)
  return {"folder": folder, "files": files, "refs": refs, "ours": ours, "dropped": dropped}


def _video(pipe, **kwargs):
  return pipe(PROMPT, **CALL, latents=LATENTS, **kwargs)


def _leaves(pipe, expert=0):
  leaves = jax.tree_util.tree_flatten_with_path(pipe._experts[expert])[0]
  return {lora_fuse._state_path(k): np.asarray(v) for k, v in leaves}


def _same(a, b):
  return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def test_each_format_equals_diffusers(world):
  """kohya / musubi and ComfyUI / lightx2v files against diffusers' load of the same file (plus, for
  the deltas diffusers drops, the hand-modified weights); controls: each LoRA moves the video far
  beyond the bar, and the dropped deltas alone move it too (so they are applied, not skipped)."""
  ours, refs, files = world["ours"], world["refs"], world["files"]
  assert psnr(_video(ours), refs["base"]) > 80  # the shared pipeline matches without a LoRA
  for fmt in ("musubi", "lightx2v"):
    ours.load_lora_weights(files[fmt], adapter_name=fmt)
    value = psnr(_video(ours), refs[fmt])
    print(f"{fmt}: {value:.1f} dB vs diffusers; the LoRA moves diffusers' video to "
          f"{psnr(refs[fmt], refs['base']):.1f} dB from the base")
    assert value >= BAR_DB, f"{fmt}: {value:.1f} dB vs diffusers"
    assert psnr(refs[fmt], refs["base"]) < 40
    ours.unload_lora_weights()
  assert psnr(refs["lightx2v_dropped_only"], refs["base"]) < 45  # the hand-added deltas matter
  # LoRA layers: 10 Linears per block less the one with a `.diff`, and 3 outside. Full deltas: per
  # block a diff_b per LoRA'd Linear or the `.diff`, 4 norm deltas and diff_m; outside, head.head's
  # diff and diff_b, 3 diff_b and 2 `.diff`.
  layers = lora.parse_lora(*lora.read_lora(files["lightx2v"])[:2], ours.transformer_config)
  low_rank = [x for x in layers if isinstance(x, lora.LoraLayer)]
  assert len(low_rank) == 2 * 10 - 1 + 3 and len(layers) - len(low_rank) == 2 * (10 + 5) + 7


def test_diff_m_is_the_modulation_delta(world):
  """`blocks.N.diff_m` is added to block N's modulation table (diffusers' scale_shift_table): the
  fused table is round(base + w * diff_m) exactly, and the video equals diffusers' with the table
  modified by hand."""
  ours, refs = world["ours"], world["refs"]
  base = _leaves(ours)
  ours.load_lora_weights(world["files"]["diff_m"], scale=0.5)
  table = _leaves(ours)[("blocks", "scale_shift_table")]
  for i in range(2):
    want = base[("blocks", "scale_shift_table")][i] + np.float32(0.5) * world["dropped"][f"blocks.{i}.scale_shift_table"][0]
    np.testing.assert_array_equal(table[i], want)
  ours.set_adapters("default_0", 1.0)
  value = psnr(_video(ours), refs["diff_m"])
  print(f"diff_m: {value:.1f} dB vs the hand-modified diffusers model; the delta moves it to "
        f"{psnr(refs['diff_m'], refs['base']):.1f} dB from the base")
  assert value >= BAR_DB and psnr(refs["diff_m"], refs["base"]) < 60
  ours.unload_lora_weights()
  assert _same(_leaves(ours), base)


def test_two_adapters_equal_set_adapters_and_unfuse_is_exact(world):
  """Two LoRAs (musubi and peft files) at weights 0.7 / 0.4 against diffusers' `set_adapters`, also
  under attention_kwargs={"scale": 0.5} (it scales the sum); unfuse restores the base bit for bit."""
  ours, refs, files = world["ours"], world["refs"], world["files"]
  base = _leaves(ours)
  assert ours.load_lora_weights(files["musubi"], adapter_name="musubi") == "musubi"
  ours.load_lora_weights(files["peft"], adapter_name="peft")
  assert ours.get_active_adapters() == ["peft"]  # as diffusers: the last loaded is the active one
  ours.set_adapters(["musubi", "peft"], [0.7, 0.4])
  assert ours.get_active_adapters() == ["musubi", "peft"]
  for key, kwargs in (("two", {}), (("two", 0.5), {"attention_kwargs": {"scale": 0.5}})):
    value = psnr(_video(ours, **kwargs), refs[key])
    print(f"two adapters {kwargs}: {value:.1f} dB vs diffusers")
    assert value >= BAR_DB
  assert psnr(refs["two"], refs["musubi"]) < 45 and psnr(refs["two"], refs["two", 0.5]) < 45  # controls
  fused = _leaves(ours)
  ours.unfuse_lora()
  assert _same(_leaves(ours), base)
  ours.fuse_lora()
  assert _same(_leaves(ours), fused)
  ours.delete_adapters("peft")
  assert ours.get_active_adapters() == ["musubi"] and ours.get_list_adapters() == {"transformer": ["musubi"]}
  ours.unload_lora_weights()
  assert _same(_leaves(ours), base)


def test_wan22_experts_take_their_own_loras(tmp_path):
  """Wan 2.2: a LoRA in each expert (diffusers' `load_into_transformer_2=True`) with its own weight,
  against diffusers; control: the low-noise expert's LoRA changes the video."""
  diffusers = pytest.importorskip("diffusers")
  pytest.importorskip("peft")
  import torch
  from tests.pipelines.pipeline.test_wan_pipeline import _save_diffusers_pipeline

  folder = str(tmp_path / "wan22")
  _save_diffusers_pipeline(folder, two_experts=True)
  files = {"high": str(tmp_path / "high.safetensors"), "low": str(tmp_path / "low.safetensors")}
  save_file(_musubi(seed=7), files["high"])
  save_file(_peft(seed=8), files["low"])
  ref = diffusers.WanPipeline.from_pretrained(folder)
  ref.set_progress_bar_config(disable=True)
  ref.load_lora_weights(files["high"], adapter_name="high")

  def run():
    with torch.no_grad():
      return ref(PROMPT, **CALL, latents=torch.from_numpy(LATENTS.copy()), output_type="np").frames

  high_only = run()
  ref.load_lora_weights(files["low"], adapter_name="low", load_into_transformer_2=True)
  ref.set_adapters(["high", "low"], [0.7, 0.4])
  want = run()
  ours = WanPipeline.from_pretrained(folder)
  ours.set_progress_bar_config(disable=True)
  ours.load_lora_weights(files["high"], adapter_name="high")
  ours.load_lora_weights(files["low"], adapter_name="low", load_into_transformer_2=True)
  assert ours.get_list_adapters() == {"transformer": ["high"], "transformer_2": ["low"]}
  ours.set_adapters(["high", "low"], [0.7, 0.4])
  value = psnr(_video(ours), want)
  print(f"Wan 2.2, a LoRA per expert: {value:.1f} dB vs diffusers")
  assert value >= BAR_DB and psnr(want, high_only) < 45


def test_key_rules_and_refusals():
  """Name rules (kohya names back to Wan's, Wan's to diffusers'), alphas outside the blocks, and the
  refusals: text-encoder keys, a non-zero delta for a parameter the model lacks (a zero one is
  dropped, as the zero norm deltas of lightx2v files), a mis-shaped delta, LoHa parts."""
  from pipelines.wan.lora import convert as lora_convert
  from pipelines.wan.transformer import original_names

  assert lora_convert.musubi_to_wan("blocks_12_cross_attn_norm_k_img") == "blocks.12.cross_attn.norm_k_img"
  assert lora_convert.musubi_to_wan("blocks_0_ffn_2") == "blocks.0.ffn.2"
  assert lora_convert.musubi_to_wan("time_projection_1") == "time_projection.1"
  assert original_names.wan_module("blocks.3.norm3") == "blocks.3.norm2"
  assert original_names.wan_module("head.head") == "proj_out" and original_names.wan_module("blocks.0.foo") is None
  config = TINY_TRANSFORMER
  rng = np.random.default_rng(0)
  down, up = _pair(rng, (D, FREQ), 4)
  head = {"diffusion_model.time_embedding.0.lora_down.weight": down,
          "diffusion_model.time_embedding.0.lora_up.weight": up,
          "diffusion_model.time_embedding.0.alpha": np.asarray(2.0, np.float32)}
  (layer,) = lora.parse_lora(head, None, config)
  assert layer.module == "condition_embedder.time_embedder.linear_1" and layer.scaling == 0.5
  np.testing.assert_allclose(layer.delta_kernel(), 0.5 * (up @ down).T, rtol=1e-6)
  with pytest.raises(ValueError, match=r"text encoder \(2 keys: \['lora_te_encoder_0.lora_down.weight', "
                                       r"'text_encoder.layer.0.q.lora_A.weight'\]\)"):
    lora.parse_lora({**head, "lora_te_encoder_0.lora_down.weight": down,
                     "text_encoder.layer.0.q.lora_A.weight": down}, None, config)
  zero = {"diffusion_model.blocks.0.norm2.diff": np.zeros(D, np.float32)}  # Wan's norm2: no parameter
  assert len(lora.parse_lora({**head, **zero}, None, config)) == 1
  bad = {**head, "diffusion_model.blocks.0.norm2.diff": np.ones(D, np.float32),
         "diffusion_model.blocks.0.diff_m": np.ones((1, 2, D), np.float32),
         "diffusion_model.blocks.1.self_attn.q.hada_w1_a": down}
  with pytest.raises(ValueError) as error:
    lora.parse_lora(bad, None, config)
  for needle in ("diffusion_model.blocks.0.norm2.diff", "blocks.0.diff_m (1, 2, 128) (model wants (1, 6, 128)",
                 "diffusion_model.blocks.1.self_attn.q.hada_w1_a"):
    assert needle in str(error.value), str(error.value)


def test_set_adapters_refusals(world):
  ours = world["ours"]
  ours.load_lora_weights(world["files"]["diff_m"], adapter_name="m")
  fused = _leaves(ours)
  for args, message in (((["x"],), r"adapter_names \['x'\] are not loaded; loaded: \['m'\]"),
                        ((["m"], [1.0, 2.0]), "1 adapter_names"),
                        ((["m"], [float("inf")]), "must be a finite number"),
                        ((["m"], {"unet": 1.0}), r"components \['unet'\] are not LoRA components")):
    with pytest.raises(ValueError, match=message):
      ours.set_adapters(*args)
  with pytest.raises(ValueError, match="a LoRA scale goes in lora_scale="):
    ours.fuse_lora(0.5)  # diffusers' first parameter is `components`
  assert _same(_leaves(ours), fused)
  ours.unload_lora_weights()


def test_vace_block_loras_equal_diffusers(tmp_path):
  """LoRAs on the VACE blocks (Wan 2.1 VACE / VACE-Fun community files): the ComfyUI / Wan layout
  (`diffusion_model.vace_blocks.N.self_attn.q`, `before_proj`, `after_proj`, `alpha`) and kohya's
  (`lora_unet_vace_blocks_N_...`) against diffusers' peft load of the same update written in
  diffusers' names (alpha folded into lora_B: diffusers does not convert VACE keys of the Wan
  layout). Control: the LoRA moves diffusers' video far beyond the bar."""
  diffusers = pytest.importorskip("diffusers")
  pytest.importorskip("peft")
  import torch
  from pipelines.pipeline.vace_pipeline import WanVACEPipeline
  from tests.pipelines.pipeline.test_video_pipeline import _video as control_video
  from tests.pipelines.pipeline.vace_folder import build_vace_folder

  folder = build_vace_folder(str(tmp_path / "vace"))
  with open(os.path.join(folder, "transformer", "config.json")) as f:
    config = json.load(f)
  d, e = config["num_attention_heads"] * config["attention_head_dim"], config["ffn_dim"]
  rng, wan, kohya, peft_state = np.random.default_rng(11), {}, {}, {}
  modules = [("self_attn.q", "attn1.to_q", (d, d)), ("cross_attn.o", "attn2.to_out.0", (d, d)),
             ("ffn.0", "ffn.net.0.proj", (e, d)), ("after_proj", "proj_out", (d, d))]
  for i in range(2):
    for j, (module, diffusers_module, shape) in enumerate(modules + ([("before_proj", "proj_in", (d, d))] if i == 0 else [])):
      down, up = _pair(rng, shape, 2 + j % 2)
      alpha = float(1 + j)
      wan |= {f"diffusion_model.vace_blocks.{i}.{module}.lora_down.weight": down,
              f"diffusion_model.vace_blocks.{i}.{module}.lora_up.weight": 3 * up,
              f"diffusion_model.vace_blocks.{i}.{module}.alpha": np.asarray(alpha, np.float32)}
      name = f"lora_unet_vace_blocks_{i}_{module.replace('.', '_')}"
      kohya |= {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": 3 * up,
                f"{name}.alpha": np.asarray(alpha, np.float32)}
      peft_state |= {f"transformer.vace_blocks.{i}.{diffusers_module}.lora_A.weight": down,
                     f"transformer.vace_blocks.{i}.{diffusers_module}.lora_B.weight": 3 * up * alpha / down.shape[0]}
  files = {name: str(tmp_path / f"{name}.safetensors") for name in ("wan", "kohya", "peft")}
  for name, state in (("wan", wan), ("kohya", kohya), ("peft", peft_state)):
    save_file(state, files[name])
  video = control_video(9)
  call = dict(height=32, width=48, num_frames=9, num_inference_steps=2, guidance_scale=4.0, max_sequence_length=32)
  latents = np.random.default_rng(6).standard_normal((1, 16, 3, 4, 6)).astype(np.float32)
  ref = diffusers.WanVACEPipeline.from_pretrained(folder)
  ref.set_progress_bar_config(disable=True)

  def run():
    import PIL.Image
    with torch.no_grad():
      return ref(PROMPT, video=[PIL.Image.fromarray(f) for f in video], latents=torch.from_numpy(latents.copy()),
                 output_type="np", **call).frames

  base = run()
  ref.load_lora_weights(files["peft"], adapter_name="vace")
  want = run()
  ours = WanVACEPipeline.from_pretrained(folder)
  ours.set_progress_bar_config(disable=True)
  for name in ("wan", "kohya", "peft"):
    ours.load_lora_weights(files[name], adapter_name=name)
    value = psnr(ours(PROMPT, video=video, latents=latents, **call), want)
    print(f"VACE-block LoRA, {name} layout: {value:.1f} dB vs diffusers")
    assert value >= BAR_DB, f"{name}: {value:.1f} dB"
    ours.unload_lora_weights()
  assert psnr(want, base) < 45
