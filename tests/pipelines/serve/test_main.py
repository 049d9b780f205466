"""Tests for pipelines/serve/main.py: the `serve` command refuses bad flags (exit status 2, the
message naming the fix) before any model is loaded or a server started."""

from __future__ import annotations

import pytest

from pipelines.serve.service import Service


@pytest.mark.parametrize("argv,words", [
    (["--warmup", "64x64"], "--warmup '64x64' is malformed"),
    (["--warmup", "33x32x5"], "width=33 must be a positive multiple of 16"),
    (["--mesh", "U=16"], "--mesh U=16"),
    (["--lora", "no-path-given"], "NAME=PATH"),
    (["--lora", "fox=/no/such.safetensors"], "is not a file or folder"),
    (["--max-batch", "0"], "--max-batch 0 must be an int >= 1"),
    (["--api-key", "short"], "at least 8 characters"),
])
def test_serve_command_refuses_bad_flags_before_loading(argv, words, capsys, monkeypatch):
  import uvicorn

  from pipelines.serve.main import main

  def started(*args, **kwargs):
    raise AssertionError(f"serve {argv} started instead of refusing")

  monkeypatch.setattr(Service, "start", started)
  monkeypatch.setattr(uvicorn, "run", started)
  assert main(argv) == 2
  assert words in capsys.readouterr().err


def test_an_image_to_video_model_is_checked_with_a_first_frame():
  """An image-to-video model is served (its jobs bring their first frame as `input_reference`): the
  startup checks build its requests with an image, so the mesh and --warmup are checked as for
  text-to-video; a bad --warmup size is still refused naming the flag (positive control)."""
  import dataclasses

  from pipelines.commands.flags import UsageError
  from pipelines.pipeline.model_facts import ModelFacts
  from pipelines.serve.main import check
  from pipelines.serve.options import ServeConfig

  text = ModelFacts.tiny_random("float32")
  config = ServeConfig(model="tiny-random", warmup=((32, 32, 5, 2),))
  image = dataclasses.replace(text, transformer=dataclasses.replace(
      text.transformer, in_channels=2 * text.transformer.out_channels + text.temporal_factor), image_to_video=True)
  check(config, text)
  check(config, image)
  with pytest.raises(UsageError, match=r"--warmup 33x32x5x2"):
    check(dataclasses.replace(config, warmup=((33, 32, 5, 2),)), image)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
  from pipelines.pipeline import WanPipeline
  from tests.pipelines.wan.pretrained import writers

  return writers.write_single_files(WanPipeline.tiny(random=True), str(tmp_path_factory.mktemp("single")))


def test_single_files_serve_the_folders_model(single):
  """serve --transformer --vae --text-encoder --config: the folder's facts (named by the transformer
  file) from the headers, and a loader of the same weights (the same model fingerprint)."""
  import dataclasses
  import os

  from pipelines.pipeline import WanPipeline
  from pipelines.pipeline.model_facts import ModelFacts
  from pipelines.serve.main import loader, model_facts
  from pipelines.serve.options import parse

  config = parse(["--transformer", single["transformer"], "--vae", single["vae"], "--text-encoder",
                  single["text_encoder"], "--config", single["folder"], "--dtype", "float32"])
  assert config.model is None and config.files.config == single["folder"]
  facts = model_facts(config)
  assert facts == dataclasses.replace(ModelFacts.from_folder(single["folder"], "float32"),
                                      name=os.path.abspath(single["transformer"]))
  assert loader(config)().fingerprint() == WanPipeline.from_pretrained(single["folder"]).fingerprint()


def test_single_files_refused_before_loading(single, capsys, monkeypatch):
  import uvicorn

  from pipelines.serve.main import main

  monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("serve started"))
  files = ["--transformer", single["transformer"], "--vae", single["vae"], "--text-encoder", single["text_encoder"]]
  for argv, words in ((files + ["--model", "tiny"], "--model 'tiny' and --transformer"),
                      (files[:2], "needs --vae and --text-encoder too"),
                      (files, "need --tokenizer FOLDER"),
                      (files[:3] + [single["transformer"]] + files[4:] + ["--config", single["folder"]],
                       "holds the transformer of a Wan pipeline, not the VAE")):
    assert main(argv) == 2
    assert words in capsys.readouterr().err
