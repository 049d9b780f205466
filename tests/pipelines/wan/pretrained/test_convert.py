"""`wan.pretrained.convert`: the command's argument rules (the round trip of a folder is in
tests/pipelines/pipeline/load/test_single_file.py, where the videos are compared)."""

import json
import os

import numpy as np
import pytest

from pipelines.storage import weights
from pipelines.wan.pretrained import TINY_DEFAULT_FOLDER, convert
from pipelines.wan.transformer import wan_key
from tests.pipelines.wan.pretrained import writers


@pytest.mark.parametrize("argv,why", [
    (["{dst}"], "only DST '{dst}' given: convert takes SOURCE DST"),
    (["{src}", "{dst}", "--transformer", "t.safetensors"], "pass SOURCE '{src}' or --transformer, not both: "),
    (["{dst}", "--transformer", "t.safetensors"], "--vae, --text-encoder missing beside --transformer: "),
    (["{tiny}", "{dst}"], "'{tiny}' is a diffusers-format folder already (it has model_index.json): load it as "
                          "it is (generate --model FOLDER, WanPipeline.from_pretrained(FOLDER)); convert takes "),
    (["{src}", "{dst}"], "SOURCE '{src}' has no config.json, so it is not a folder in the official Wan layout: "),
], ids=["only-dst", "source-and-files", "files-missing", "a-diffusers-folder", "no-config-json"])
def test_arguments_it_does_not_take_are_one_line_errors(tmp_path, capsys, argv, why):
  """Each wrong set of arguments: exit 2 and one `convert: error:` line (no traceback) naming what is
  wrong and what convert takes; nothing written. (The control, files that convert: below.)"""
  names = {"dst": str(tmp_path / "dst"), "src": str(tmp_path), "tiny": TINY_DEFAULT_FOLDER}
  assert convert.main([a.format(**names) for a in argv]) == 2
  err = capsys.readouterr().err
  assert err.startswith("convert: error: " + why.format(**names)) and err.count("\n") == 1, err
  assert "DST --transformer F --vae F --text-encoder F (single files)" in err, err
  assert not (tmp_path / "dst").exists()


def test_missing_source_file_is_an_error(tmp_path, capsys):
  code = convert.main([str(tmp_path / "dst"), "--transformer", str(tmp_path / "t.safetensors"), "--vae", "v",
                       "--text-encoder", "e", "--tokenizer", str(tmp_path)])
  assert code == 1 and "t.safetensors' does not exist" in capsys.readouterr().err
  assert not (tmp_path / "dst").exists()


def test_per_channel_scales_are_written_row_by_row(tmp_path, capsys):
  """A scaled-fp8 transformer with one scale per output row is written as q * scale of each row (the
  VAE and text encoder are the tiny default's own files, its folder the config)."""
  folder = {c: os.path.join(TINY_DEFAULT_FOLDER, c) for c in ("transformer", "vae", "text_encoder")}
  state = weights.read_safetensors_folder(folder["transformer"])
  scaled = writers.scaled_fp8(state, form="[out, 1]", suffix="weight_scale")
  path = writers.write(scaled, str(tmp_path / "t_fp8.safetensors"))
  code = convert.main([str(tmp_path / "dst"), "--transformer", path,
                       "--vae", os.path.join(folder["vae"], "diffusion_pytorch_model.safetensors"),
                       "--text-encoder", os.path.join(folder["text_encoder"], "model.safetensors"),
                       "--tokenizer", TINY_DEFAULT_FOLDER, "--config", TINY_DEFAULT_FOLDER])
  assert code == 0, capsys.readouterr().err
  written = weights.read_safetensors_folder(str(tmp_path / "dst" / "transformer"))
  want = writers.without_fp8_scales(scaled)
  assert written.keys() == state.keys()
  for key, value in written.items():
    np.testing.assert_array_equal(value, want[writers.COMFY_PREFIX + wan_key(key)], err_msg=key)
  key = "blocks.0.ffn.net.0.proj.weight"
  scale = scaled[writers.COMFY_PREFIX + wan_key(key)[:-len("weight")] + "weight_scale"]
  assert np.unique(scale).size > 1 and not np.array_equal(written[key], state[key])  # the controls


def test_shapes_of_no_known_config_are_refused(tmp_path, capsys):
  """The trained tiny's own files without --config: refused (its VAE's shapes are two shipped folders'
  with different latent statistics), nothing written; with --config they convert."""
  folder = {c: os.path.join(TINY_DEFAULT_FOLDER, c) for c in ("transformer", "vae", "text_encoder")}
  files = ["--transformer", os.path.join(folder["transformer"], "diffusion_pytorch_model.safetensors"),
           "--vae", os.path.join(folder["vae"], "diffusion_pytorch_model.safetensors"),
           "--text-encoder", os.path.join(folder["text_encoder"], "model.safetensors"),
           "--tokenizer", TINY_DEFAULT_FOLDER]
  assert convert.main([str(tmp_path / "dst"), *files]) == 1
  assert "pass the model's config: --config FOLDER (CLI)" in capsys.readouterr().err
  assert not os.listdir(tmp_path)
  assert convert.main([str(tmp_path / "dst"), *files, "--config", TINY_DEFAULT_FOLDER]) == 0
  index = json.loads((tmp_path / "dst" / "model_index.json").read_text())
  assert index["tokenizer"] == ["transformers", "ByT5Tokenizer"]  # a class diffusers can load, as the source's
