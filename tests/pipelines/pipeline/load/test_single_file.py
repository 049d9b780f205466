"""`pipeline.single_file`: `WanPipeline.from_single_file` (ComfyUI's layouts, its scaled fp8) and
`from_pretrained` of a folder in the official Wan layout give the diffusers folder's video.

The files are the tiny models written in those layouts by inverting the key maps
(`tests/pipelines/wan/pretrained/writers.py`); diffusers' own `from_single_file` reading the written
transformer file to the folder's tensors shows the writer matches the real layout.
"""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

from pipelines.pipeline import WanPipeline
from pipelines.wan.encoders import TokenizerNotFoundError
from pipelines.wan.pretrained import TINY_DEFAULT_FOLDER, GenerationDefaults
from tests import numerics
from tests.pipelines.wan.pretrained import writers

CALL = dict(height=32, width=32, num_frames=5, num_inference_steps=2, max_sequence_length=8, seed=0, output_type="np")
PROMPT = "a red square moving right"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """The random tiny pipeline as a diffusers folder and as ComfyUI single files."""
  base = str(tmp_path_factory.mktemp("single"))
  pipe = WanPipeline.tiny(random=True)
  return dict(pipe=pipe, base=base, **writers.write_single_files(pipe, base))


def test_diffusers_reads_the_written_transformer_file(files):
  """The independent reference: diffusers' `WanTransformer3DModel.from_single_file` of our ComfyUI file."""
  from diffusers import WanTransformer3DModel

  model = WanTransformer3DModel.from_single_file(files["transformer"], config=files["folder"], subfolder="transformer")
  theirs = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  ours = files["states"]["transformer"]
  assert set(theirs) == set(ours) and all(np.array_equal(theirs[k], ours[k]) for k in ours)


def test_single_files_give_the_folders_video(files):
  """With `config=` the files make the folder's video and take the folder's own sampling defaults
  (generation_defaults.json, written here with values no other source has)."""
  own = GenerationDefaults(guidance_scale=3.5, num_inference_steps=3, height=48, width=32)
  config = os.path.join(files["base"], "config_with_defaults")
  shutil.copytree(files["folder"], config)
  with open(os.path.join(config, "generation_defaults.json"), "w") as f:
    json.dump({k: v for k, v in own.to_dict().items() if k != "source"}, f)
  got = WanPipeline.from_single_file(files["transformer"], files["vae"], files["text_encoder"],
                                     tokenizer=files["folder"], config=config).generation_defaults
  assert dataclasses.replace(got, source=own.source) == own and config in got.source
  single = WanPipeline.from_single_file(files["transformer"], files["vae"], files["text_encoder"],
                                        tokenizer=files["folder"], config=files["folder"])
  assert single.generation_defaults == WanPipeline.from_pretrained(files["folder"]).generation_defaults
  reference = WanPipeline.from_pretrained(files["folder"])(PROMPT, **CALL)
  video = single(PROMPT, **CALL)
  assert video.std() > 0.01 and np.array_equal(video, reference)


def test_single_files_without_config_give_the_folders_video(files):
  """The random tiny's files without `config=`: their shapes are its configs' (8 heads of 16), so the
  video is the folder's; the trained tiny's files are refused (tests/pipelines/wan/pretrained/test_sources.py)."""
  single = WanPipeline.from_single_file(files["transformer"], files["vae"], files["text_encoder"],
                                        tokenizer=files["folder"])
  assert single.transformer_config == files["pipe"].transformer_config
  assert single.generation_defaults == GenerationDefaults()  # no folder: diffusers' defaults
  video = single(PROMPT, **CALL)
  assert video.std() > 0.01 and np.array_equal(video, WanPipeline.from_pretrained(files["folder"])(PROMPT, **CALL))


def test_official_layout_gives_the_folders_video(files):
  official = writers.write_official(files["pipe"], os.path.join(files["base"], "official"),
                                    os.path.join(files["folder"], "tokenizer"))
  pipe = WanPipeline.from_pretrained(official)
  assert pipe.transformer_config == files["pipe"].transformer_config  # heads from config.json
  assert np.array_equal(pipe(PROMPT, **CALL), WanPipeline.from_pretrained(files["folder"])(PROMPT, **CALL))


def test_tokenizer_is_required(files):
  with pytest.raises(TokenizerNotFoundError, match=r"tokenizer=None: no UMT5 tokenizer ships with this package; "
                                                   r"pass tokenizer= \(--tokenizer\) a local folder holding the google/umt5-xxl"):
    WanPipeline.from_single_file(files["transformer"], files["vae"], files["text_encoder"], config=files["folder"])


def _psnr(a, b) -> float:
  return float(10 * np.log10(1.0 / np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)))


def test_scaled_fp8_file_loads_into_fp8_weights(tmp_path):
  """The trained default as a ComfyUI scaled-fp8 file: with quantize="fp8" the block kernels are
  placed as the file's e4m3 bytes (1 byte a value) and the video, at the model's own settings (its
  folder's guidance 2, which `config=` brings along), stays within 35 dB of fp32's (measured 46.9 dB;
  at guidance 5, where this model swaps colours anyway, guidance amplifies the weights' rounding:
  32.4 dB)."""
  default = WanPipeline.tiny()
  states = writers.pipeline_states(default)
  path = writers.write(writers.scaled_fp8(states["transformer"]), str(tmp_path / "fp8_scaled.safetensors"))
  vae = writers.write(writers.comfy_vae(states["vae"], default.vae.config), str(tmp_path / "vae.safetensors"))
  te = writers.write(states["text_encoder"], str(tmp_path / "umt5.safetensors"))
  fp8 = WanPipeline.from_single_file(path, vae, te, tokenizer=TINY_DEFAULT_FOLDER, config=TINY_DEFAULT_FOLDER,
                                     quantize="fp8")
  kernel = fp8.weights.experts[0]["blocks"]["ffn"]["proj_in"]["kernel"].get_value()
  assert kernel.qvalue.dtype == jax.numpy.float8_e4m3fn and kernel.qvalue.nbytes == kernel.qvalue.size
  assert kernel.scale.shape == (default.transformer_config.num_layers, 1, default.transformer_config.ffn_dim)
  assert fp8.generation_defaults == default.generation_defaults and fp8.generation_defaults.guidance_scale == 2.0
  call = dict(height=64, width=64, num_frames=17, num_inference_steps=8, seed=0, output_type="np")
  reference = default(PROMPT, **call)
  video = fp8(PROMPT, **call)
  dequantized = WanPipeline.from_single_file(path, vae, te, tokenizer=TINY_DEFAULT_FOLDER, config=TINY_DEFAULT_FOLDER)
  assert not isinstance(dequantized.weights.experts[0]["blocks"]["ffn"]["proj_in"]["kernel"].get_value(), type(kernel))
  print(f"fp8 scaled vs fp32: {_psnr(video, reference):.2f} dB; dequantized fp32 vs fp32: "
        f"{_psnr(dequantized(PROMPT, **call), reference):.2f} dB")
  assert 35.0 <= _psnr(video, reference) < 200  # < 200: the fp8 weights did change the video


# The trained size; guidance 1: (x q) s and x (q s) differ by fp32 roundings, which guidance 5 would
# amplify toward the 120 dB bound (measured 117-122 dB at 2 steps, 132-134 dB at 8) with no weight wrong.
TRAINED_CALL = dict(height=64, width=64, num_frames=17, num_inference_steps=2, guidance_scale=1.0, seed=0,
                    output_type="np")


@pytest.fixture(scope="module")
def trained():
  """The trained default and its float32 state dicts."""
  default = WanPipeline.tiny()
  return dict(pipe=default, states=writers.pipeline_states(default))


def _fp8_files(trained, base, forms: dict[str, tuple[str, str]]) -> tuple[list[str], list[str]]:
  """(the trained default's scaled-fp8 files, the dequantized float32 files they stand for): each
  component's weights in fp8 with scales of `forms[component]` = (form, key suffix)."""
  states = trained["states"]
  scaled = {"transformer": writers.scaled_fp8(states["transformer"], form=forms["transformer"][0],
                                              suffix=forms["transformer"][1]),
            "vae": writers.scaled_fp8_vae(states["vae"], trained["pipe"].vae.config, *forms["vae"]),
            "text_encoder": writers.scaled_fp8_umt5(states["text_encoder"], *forms["text_encoder"])}
  fp8 = [writers.write(scaled[c], os.path.join(base, f"{c}_fp8.safetensors")) for c in scaled]
  plain = [writers.write(writers.without_fp8_scales(scaled[c]), os.path.join(base, f"{c}.safetensors"))
           for c in scaled]
  return fp8, plain


def _load(files, **kw):
  return WanPipeline.from_single_file(*files, tokenizer=TINY_DEFAULT_FOLDER, config=TINY_DEFAULT_FOLDER, **kw)


def _same_weights(a, b) -> None:
  ours, theirs = writers.pipeline_states(a), writers.pipeline_states(b)
  for component in ours:
    assert ours[component].keys() == theirs[component].keys()
    for key, value in ours[component].items():
      np.testing.assert_array_equal(value, theirs[component][key], err_msg=f"{component} {key}")


def test_per_channel_fp8_files_give_the_dequantized_weights_video(trained, tmp_path):
  """Scales of one value per output row ([out, 1], [out]; both key names) in all three files: the
  loaded weights are q * scale row by row, bit for bit those of the dequantized float32 files, and
  quantize="fp8" (the transformer's e4m3 bytes with their scales per channel) gives their video
  within 120 dB (fp32: (x q) s against x (q s), a few roundings apart; measured 147 dB)."""
  fp8, plain = _fp8_files(trained, str(tmp_path), {"transformer": ("[out, 1]", "scale_weight"),
                                                  "vae": ("[out, 1]", "weight_scale"),
                                                  "text_encoder": ("[out]", "weight_scale")})
  reference = _load(plain)
  loaded = _load(fp8)
  _same_weights(loaded, reference)
  quantized = _load(fp8, quantize="fp8")
  kernel = quantized.weights.experts[0]["blocks"]["ffn"]["proj_in"]["kernel"].get_value()
  assert np.unique(np.asarray(kernel.scale[0])).size > 1  # the control: the rows' scales differ
  video = reference(PROMPT, **TRAINED_CALL)
  plain_db = numerics.assert_psnr_at_least(loaded(PROMPT, **TRAINED_CALL), video, 120.0,
                                           name="per-channel fp8 file")
  fp8_db = numerics.assert_psnr_at_least(quantized(PROMPT, **TRAINED_CALL), video, 120.0,
                                         name="per-channel fp8 file, quantize=fp8")
  print(f"per-channel fp8 files vs the dequantized files: {plain_db:.1f} dB loaded, {fp8_db:.1f} dB quantize=fp8")
  assert video.std() > 0.01


def test_per_tensor_fp8_files_load_exactly(trained, tmp_path):
  """One scale per tensor ([] ComfyUI's, [1]) still gives the dequantized files' weights bit for bit."""
  fp8, plain = _fp8_files(trained, str(tmp_path), {"transformer": ("[]", "scale_weight"),
                                                  "vae": ("[1]", "scale_weight"),
                                                  "text_encoder": ("[1]", "weight_scale")})
  _same_weights(_load(fp8), _load(plain))


def test_convert_round_trips_the_official_layout(files, tmp_path):
  """official -> diffusers folder (`convert`) -> the same video; an existing DST is refused."""
  from pipelines.wan.pretrained import convert

  official = writers.write_official(files["pipe"], str(tmp_path / "official"), os.path.join(files["folder"], "tokenizer"))
  assert convert.main([official, str(tmp_path / "converted")]) == 0
  assert sorted(os.listdir(tmp_path)) == ["converted", "official"]  # no temporary folder left
  video = WanPipeline.from_pretrained(str(tmp_path / "converted"))(PROMPT, **CALL)
  assert np.array_equal(video, WanPipeline.from_pretrained(files["folder"])(PROMPT, **CALL))
  with pytest.raises(Exception, match=r"converted' exists; convert writes a new folder"):
    convert.convert(convert.Sources.official(official), str(tmp_path / "converted"))
