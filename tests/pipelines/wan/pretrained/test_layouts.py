"""`wan.pretrained.layouts`: which layout a file or folder is in, and the errors a user can act on
(each names the file and the fix), raised before anything compiles."""

import json
import re

import ml_dtypes
import numpy as np
import pytest

from pipelines.storage.weights import CheckpointError
from pipelines.wan.pretrained import TINY_TRANSFORMER, layouts
from pipelines.wan.transformer import checkpoint_layout, wan_key
from pipelines.wan.vae import VAE_PRESETS, original_keys
from tests.pipelines.wan.pretrained import writers


def _transformer_state() -> dict[str, np.ndarray]:
  return {key: np.zeros(shape, np.float32) for key, shape, *_ in checkpoint_layout(TINY_TRANSFORMER)}


@pytest.mark.parametrize("prefix", ["model.diffusion_model.", "diffusion_model.", ""])
def test_transformer_names_with_or_without_prefix(tmp_path, prefix):
  state = _transformer_state()
  path = writers.write(writers.comfy_transformer(state, prefix), str(tmp_path / "t.safetensors"))
  got = layouts.read_component(path, "transformer")
  assert (got.layout, set(got.tensors), got.scales) == ("wan", set(state), {})


def test_a_causal_generators_training_checkpoint_reads_its_ema_weights(tmp_path):
  """Self-Forcing / CausVid save {"generator": ..., "generator_ema": ...} with each key under the
  wrapper's `model.`: the EMA weights are read (positive control: the plain generator's differ)."""
  torch = pytest.importorskip("torch")
  state = writers.comfy_transformer(_transformer_state(), "model.")
  ema = {k: torch.from_numpy(v + 1) for k, v in state.items()}
  path = str(tmp_path / "self_forcing_dmd.pt")
  torch.save({"generator": {k: torch.from_numpy(v) for k, v in state.items()}, "generator_ema": ema}, path)
  got = layouts.read_component(path, "transformer")
  assert got.layout == "wan" and set(got.tensors) == set(_transformer_state())
  assert all(np.all(np.asarray(v) == 1) for v in got.tensors.values())
  torch.save({"generator": {k: torch.from_numpy(v) for k, v in state.items()}}, path)
  assert all(np.all(np.asarray(v) == 0) for v in layouts.read_component(path, "transformer").tensors.values())


def test_vae_names_renamed_with_the_inferred_config(tmp_path):
  config = VAE_PRESETS["tiny"]
  state = {k: np.zeros(s, np.float32) for k, s in config.param_shapes().items()}
  path = writers.write(writers.comfy_vae(state, config), str(tmp_path / "v.safetensors"))
  got = layouts.read_component(path, "vae")
  assert got.layout == "wan" and got.shapes == config.param_shapes()


def test_scaled_fp8_scales_beside_the_tensors(tmp_path):
  state = _transformer_state()
  state["blocks.0.attn1.to_q.weight"] = np.full(state["blocks.0.attn1.to_q.weight"].shape, 0.5, np.float32)
  path = writers.write(writers.scaled_fp8(state), str(tmp_path / "fp8.safetensors"))
  got = layouts.read_component(path, "transformer")
  assert got.fp8_scaled and set(got.tensors) == set(state)  # no marker, no scale keys among the tensors
  assert got.tensors["blocks.0.attn1.to_q.weight"].dtype == ml_dtypes.float8_e4m3fn
  scale = got.scales["blocks.0.attn1.to_q.weight"]
  assert scale.shape == state["blocks.0.attn1.to_q.weight"].shape and np.all(scale == np.float32(0.5 / 448))
  assert "proj_out.weight" not in got.scales  # the head is not quantized


FFN_IN = "blocks.0.ffn.net.0.proj.weight"  # [ffn_dim, D] = [256, 128]: rows and columns differ


def _rows_of_different_sizes(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  out, _ = state[FFN_IN].shape
  rng = np.random.default_rng(0)
  state[FFN_IN] = (rng.standard_normal(state[FFN_IN].shape) * np.arange(1, out + 1)[:, None]).astype(np.float32)
  return state


@pytest.mark.parametrize("suffix", ["scale_weight", "weight_scale"])
@pytest.mark.parametrize("form", writers.SCALE_FORMS)
def test_fp8_scales_apply_per_output_row(tmp_path, form, suffix):
  """Every supported scale shape reads as the scale of each weight row: q * scale is the file's
  weight, the per-row scales are not row 0's for every row."""
  state = _rows_of_different_sizes(_transformer_state())
  file_state = writers.scaled_fp8(state, form=form, suffix=suffix)
  got = layouts.read_component(writers.write(file_state, str(tmp_path / "fp8.safetensors")), "transformer")
  q = np.asarray(got.tensors[FFN_IN])
  want = writers.without_fp8_scales(file_state)[writers.COMFY_PREFIX + wan_key(FFN_IN)]
  np.testing.assert_array_equal(q.astype(np.float32) * got.scales[FFN_IN], want)
  rows = np.unique(got.scales[FFN_IN][:, 0]).size
  assert rows == (1 if form in ("[]", "[1]") else len(q))  # the control: per-row forms do differ by row


@pytest.mark.parametrize("shape", [(2,), (128,), (256, 2), (1, 128), (256, 1, 1)])
def test_fp8_scales_of_other_shapes_are_refused(tmp_path, shape):
  file_state = writers.scaled_fp8(_transformer_state())
  key = writers.COMFY_PREFIX + "blocks.0.ffn.0.scale_weight"
  assert key in file_state and file_state[key[:-len("scale_weight")] + "weight"].shape == (256, 128)
  file_state[key] = np.full(shape, 0.01, np.float32)
  path = writers.write(file_state, str(tmp_path / "fp8.safetensors"))
  stripped = key[len(writers.COMFY_PREFIX):]  # named as the loader names it, with the file
  with pytest.raises(ValueError, match=rf"fp8.safetensors': scale '{stripped}' has the shape {re.escape(str(shape))} "
                                       r".*its weight's shape is \(256, 128\).*one value \(\[\] or \[1\]\) or one "
                                       r"per output row \(\[256\] or \[256, 1\]\)"):
    layouts.read_component(path, "transformer")


def test_missing_file(tmp_path):
  with pytest.raises(CheckpointError, match=r"vae='.*nope.safetensors' does not exist; pass a Wan VAE file"):
    layouts.read_component(str(tmp_path / "nope.safetensors"), "vae")


def test_truncated_file(tmp_path):
  path = writers.write(writers.comfy_transformer(_transformer_state()), str(tmp_path / "t.safetensors"))
  data = open(path, "rb").read()
  open(path, "wb").write(data[: len(data) // 2])
  with pytest.raises(CheckpointError, match=r"transformer=: cannot read '.*t.safetensors' \(truncated or corrupt "
                                            r"safetensors file\?\).*; download it again"):
    layouts.read_component(path, "transformer")


def test_a_flux_file_is_named(tmp_path):
  flux = {"double_blocks.0.img_attn.qkv.weight": np.zeros((6, 2), np.float32),
          "single_blocks.0.linear1.weight": np.zeros((4, 2), np.float32)}
  path = writers.write(flux, str(tmp_path / "flux1-dev.safetensors"))
  with pytest.raises(CheckpointError, match=r"transformer='.*flux1-dev.safetensors' holds a Flux / HunyuanVideo "
                                            r"transformer \(keys like 'double_blocks.0.img_attn.qkv.weight'\), not "
                                            r"the transformer of a Wan model; pass a Wan 2.1 / 2.2 diffusion model file"):
    layouts.read_component(path, "transformer")


def test_a_component_in_the_wrong_place(tmp_path):
  config = VAE_PRESETS["tiny"]
  state = {k: np.zeros(s, np.float32) for k, s in config.param_shapes().items()}
  path = writers.write({original_keys(config)[k]: v for k, v in state.items()}, str(tmp_path / "wan_2.1_vae.safetensors"))
  with pytest.raises(CheckpointError, match=r"holds the VAE of a Wan pipeline, not the transformer of a Wan model; "
                                            r"pass it as vae= \(--vae\)"):
    layouts.read_component(path, "transformer")


def test_folder_layouts(tmp_path):
  (tmp_path / "official").mkdir()
  (tmp_path / "official" / "config.json").write_text(json.dumps({"dim": 128, "num_layers": 2, "model_type": "t2v"}))
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel"}))
  assert layouts.folder_layout(str(tmp_path / "official")) == "official"
  assert layouts.folder_layout(str(tmp_path / "other")) == "diffusers"
  with pytest.raises(CheckpointError, match=r"official Wan layout\) is missing the VAE file \(Wan2.1_VAE.pth or "
                                            r"Wan2.2_VAE.pth\); download it next to config.json"):
    layouts.OfficialFolder.read(str(tmp_path / "official"))


def test_wan_key_positive_control():
  """The writers rename (the checks above would pass vacuously on diffusers names)."""
  assert wan_key("blocks.0.attn1.to_q.weight") == "blocks.0.self_attn.q.weight"
