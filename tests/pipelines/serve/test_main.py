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
  from pipelines.pipeline.checked.model_facts import ModelFacts
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


def test_tiny_i2v_is_served_as_a_model_that_takes_a_first_frame():
  """--model tiny-i2v: its facts take an image (a job's input_reference, `references.py`), and the
  loader gives the trained default run TI2V-style; --model tiny takes none (control)."""
  from pipelines.serve.main import loader, model_facts
  from pipelines.serve.options import ServeConfig

  i2v, text = ServeConfig(model="tiny-i2v"), ServeConfig(model="tiny")
  assert model_facts(i2v).expand_timesteps and not model_facts(text).expand_timesteps
  pipe = loader(i2v)()
  assert (pipe.name, pipe.expand_timesteps) == ("tiny-i2v", True)


def test_a_hub_model_is_fetched_once_and_pinned_to_its_commit(tmp_path, monkeypatch, capsys):
  """serve --model org/name: downloaded before the checks (through huggingface_hub, here from a local
  stand-in of the Hub), then every check and load reads that commit's files without asking again;
  the model is named by its repo id (GET /v1/models); a missing repo is a usage error."""
  import pathlib

  from pipelines.serve.main import fetch_model, loader, main, model_facts
  from pipelines.serve.options import ServeConfig
  from pipelines.wan.pretrained import TINY_DEFAULT_FOLDER
  from tests.pipelines.wan.pretrained.hub_server import FakeHub, point_huggingface_hub_at

  folder = pathlib.Path(TINY_DEFAULT_FOLDER)
  files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
  with FakeHub({"test-org/tiny-wan": {"main": files}}) as hub:
    point_huggingface_hub_at(hub.url, str(tmp_path / "hub-cache"), monkeypatch)
    config = fetch_model(ServeConfig(model="test-org/tiny-wan"))
    assert config.model == "test-org/tiny-wan@" + hub.commit("test-org/tiny-wan")
    asked = len(hub.requests)
    facts = model_facts(config)
    pipe = loader(config)()
    assert facts.name == pipe.name == "test-org/tiny-wan" and pipe.facts == facts
    assert len(hub.requests) == asked and sorted(hub.file_gets()) == sorted(f"test-org/tiny-wan:{p}" for p in files)
    assert main(["--model", "test-org/nope"]) == 2
  assert "serve: error: --model test-org/nope: no Hub repo 'test-org/nope'" in capsys.readouterr().err


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
  from pipelines.pipeline.checked.model_facts import ModelFacts
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


def test_vae_dtype_flag_reaches_the_served_pipeline_s_vae():
  """serve --vae-dtype bfloat16: the config carries it and the loader's VAE is bf16; the default is
  float32 (control)."""
  import jax.numpy as jnp

  from pipelines.serve.main import loader
  from pipelines.serve.options import ServeConfig

  assert ServeConfig().vae_dtype == "float32"
  pipe = loader(ServeConfig(model="tiny-random", vae_dtype="bfloat16"))()
  assert jnp.dtype(pipe.vae.dtype) == jnp.bfloat16
  assert jnp.dtype(loader(ServeConfig(model="tiny-random"))().vae.dtype) == jnp.float32
  from pipelines.serve.options import parse

  assert parse(["--vae-dtype", "bfloat16"]).vae_dtype == "bfloat16" and parse([]).vae_dtype == "float32"
