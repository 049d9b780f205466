"""`pipelines.wan.pretrained.hub`: Hugging Face Hub ids, downloaded through huggingface_hub from a local
stand-in of the Hub (`hub_server.FakeHub`, its requests logged): only the files the pipeline loads,
the same video as the local folder, the cache read offline with no request, an interrupted transfer
resumed, a wrong repo refused before any weight, one-line errors, `generate --model org/name@rev`
and its records, two processes downloading once.
"""

from __future__ import annotations

import json
import multiprocessing
import pathlib

import numpy as np
import pytest
from flax import nnx

from pipelines.cli import generate
from pipelines.pipeline import WanImageToVideoPipeline, WanPipeline
from pipelines.storage.weights import CheckpointError
from pipelines.wan.pretrained import download_snapshot, hub, hub_id, saving
from tests.pipelines.wan.pretrained.hub_server import FakeHub, download_in_child, point_huggingface_hub_at

REPO = "test-org/tiny-wan"
PROMPT = "a red square moving right"
CALL = dict(height=32, width=32, num_frames=5, num_inference_steps=2, max_sequence_length=8, seed=0,
            progress=False)
# Files a repo may hold that the pipeline never reads: weight variants, pickle / Flax / ONNX files, a
# component model_index.json does not name (image_encoder/), one it names as unused (transformer_2/).
DECOYS = {
    "transformer/diffusion_pytorch_model.fp16.safetensors": b"a variant",
    "transformer/diffusion_pytorch_model.fp16-00001-of-00002.safetensors": b"a variant's shard",
    "transformer/diffusion_pytorch_model.fp16.safetensors.index.json": b"{}",
    "transformer/diffusion_pytorch_model.bin": b"pickle",
    "text_encoder/pytorch_model.bin": b"pickle",
    "text_encoder/flax_model.msgpack": b"flax",
    "tokenizer/tokenizer.onnx": b"onnx",
    "image_encoder/config.json": b"{}",
    "image_encoder/model.safetensors": b"a component WanPipeline does not load",
    "transformer_2/config.json": b"{}",
    "transformer_2/diffusion_pytorch_model.safetensors": b"named [null, null] in model_index.json",
    "README.md": b"# tiny wan",
    ".gitattributes": b"*.safetensors filter=lfs",
}
FLUX = {"model_index.json": json.dumps({"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"],
                                        "vae": ["diffusers", "AutoencoderKL"]}).encode(),
        "transformer/config.json": b"{}", "transformer/diffusion_pytorch_model.safetensors": b"weights",
        "vae/config.json": b"{}", "vae/diffusion_pytorch_model.safetensors": b"weights"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, dict[str, bytes]]:
  """The random tiny pipeline written as a diffusers folder, and its files by repo path."""
  folder = tmp_path_factory.mktemp("tiny-wan")
  pipe = WanPipeline.tiny(random=True)
  saving.save_pipeline(str(folder), transformer=nnx.merge(pipe._graphdef, pipe._experts[0]),
                       text_encoder=(pipe.text_encoder_config, pipe._text_params), vae=pipe.vae,
                       tokenizer=pipe.tokenizer, scheduler_config=pipe.scheduler_config)
  return str(folder), {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def server(tiny, tmp_path, monkeypatch):
  """The Hub stand-in: REPO (main with decoys; tag v1 without), a truncated copy, a Flux repo."""
  files = tiny[1]
  vae = "vae/diffusion_pytorch_model.safetensors"
  repos = {REPO: {"main": {**files, **DECOYS}, "v1": files},
           "test-org/truncated": {"main": {**files, vae: files[vae][:1000]}},
           "test-org/no-text-encoder": {"main": {k: v for k, v in files.items() if not k.startswith("text_encoder/")}},
           "test-org/flux": {"main": FLUX}, "test-org/no-index": {"main": {"README.md": b"# a model"}}}
  with FakeHub(repos) as hub_server:
    point_huggingface_hub_at(hub_server.url, str(tmp_path / "hub-cache"), monkeypatch)
    yield hub_server


def _expected(files: dict[str, bytes], repo: str = REPO) -> list[str]:
  return sorted(f"{repo}:{path}" for path in files)


@pytest.mark.filterwarnings("ignore:prompt.* longer than max_sequence_length")
def test_first_load_downloads_only_what_the_pipeline_loads_and_makes_the_same_video(server, tiny):
  folder, files = tiny
  pipe = WanPipeline.from_pretrained(REPO)
  gets = server.file_gets()
  assert sorted(gets) == _expected(files)  # each needed file once; no decoy, no README
  assert gets[0] == f"{REPO}:model_index.json"  # first, before any weight
  assert pipe.name == REPO
  local = WanPipeline.from_pretrained(folder)
  from_hub, from_folder = pipe(PROMPT, **CALL), local(PROMPT, **CALL)
  assert from_hub.shape == (1, 5, 32, 32, 3) and np.array_equal(from_hub, from_folder)


def test_the_cache_is_read_offline_without_a_request(server, tiny, monkeypatch):
  from huggingface_hub import constants

  snapshot = download_snapshot(REPO)
  assert snapshot.commit == server.commit(REPO) and snapshot.revision is None
  server.requests.clear()
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 at import
  pipe = WanPipeline.from_pretrained(REPO)
  assert pipe.name == REPO and server.requests == []
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
  again = download_snapshot(REPO, snapshot.commit, local_files_only=True)
  assert (again.folder, again.commit) == (snapshot.folder, snapshot.commit) and server.requests == []
  with pytest.raises(CheckpointError) as caught:  # a revision never downloaded
    WanPipeline.from_pretrained(REPO + "@v1", local_files_only=True)
  assert str(caught.value) == (
      f"Hub repo '{REPO}@v1' is not (or not wholly) in the cache {constants.HF_HUB_CACHE} and downloads are off "
      "(HF_HUB_OFFLINE=1 or local_files_only=True); run once online to download it")
  assert server.requests == []


def test_an_interrupted_transfer_resumes_where_it_stopped(server, tiny, monkeypatch):
  """The connection drops after 1 MB of the transformer's weights: huggingface_hub asks for the rest
  (a Range request) and the file is whole."""
  from huggingface_hub import constants

  monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)  # (10 MiB: more than the tiny file)
  name = "transformer/diffusion_pytorch_model.safetensors"
  assert len(tiny[1][name]) > 2_000_000
  server.cut[name] = 1_000_000
  snapshot = download_snapshot(REPO)
  ranges = [r for method, path, r in server.requests if method == "GET" and path.endswith("/" + name)]
  assert len(ranges) == 2 and ranges[0] is None and ranges[1].startswith("bytes="), ranges
  assert 0 < int(ranges[1][len("bytes="):].rstrip("-")) <= 1_000_000
  assert (pathlib.Path(snapshot.folder) / name).read_bytes() == tiny[1][name]


def test_another_pipeline_is_refused_before_any_weight(server):
  with pytest.raises(CheckpointError) as caught:
    WanPipeline.from_pretrained("test-org/flux")
  assert str(caught.value) == (
      "Hub repo 'test-org/flux' is a FluxPipeline (model_index.json _class_name), not a Wan pipeline; only "
      "WanImageToVideoPipeline, WanPipeline, WanVACEPipeline, WanVideoToVideoPipeline repos load")
  with pytest.raises(ValueError, match="'test-org/tiny-wan' is a WanPipeline folder .*load it with "
                                       "WanPipeline.from_pretrained, not WanImageToVideoPipeline"):
    WanImageToVideoPipeline.from_pretrained(REPO)  # the wrong class, known from model_index.json
  paths = [path for _, path, _ in server.requests]
  assert paths and all(path.endswith("/model_index.json") for path in paths), paths


@pytest.mark.parametrize("model,message", [
    ("test-org/nope", "no Hub repo 'test-org/nope' (check the id, or pass token=/HF_TOKEN for a private repo)"),
    (REPO + "@nope", "no revision 'nope' in Hub repo 'test-org/tiny-wan' (give a branch, tag or commit of the repo)"),
    ("test-org/no-index", "Hub repo 'test-org/no-index' has no model_index.json: not a diffusers pipeline"),
    ("test-org/truncated", "(truncated or corrupt safetensors file"),
    ("test-org/no-text-encoder", "has no text_encoder/ folder; a Wan pipeline needs it"),
])
def test_errors_are_one_line_naming_the_repo(server, model, message):
  with pytest.raises(CheckpointError) as caught:
    WanPipeline.from_pretrained(model)
  assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_revision_is_given_once(server):
  with pytest.raises(ValueError, match="'test-org/tiny-wan@v1' names revision 'v1' and revision='v2' another"):
    WanPipeline.from_pretrained(REPO + "@v1", revision="v2")
  assert server.requests == []


def test_generate_takes_a_hub_id_and_records_the_repo_and_commit(server, tiny, tmp_path, capsys):
  out, checkpoint = tmp_path / "hub.npy", tmp_path / "ckpt"
  argv = ["--model", REPO + "@v1", "--prompt", PROMPT, "--size", "32x32", "--frames", "5", "--steps", "1",
          "--seed", "0", "--max-sequence-length", "8", "--dtype", "float32", "--out", str(out),
          "--checkpoint-dir", str(checkpoint), "--keep-checkpoint"]
  assert generate.main(argv) == 0, capsys.readouterr().err
  commit = server.commit(REPO, "v1")
  sidecar = json.loads((tmp_path / "hub.npy.json").read_text())
  assert (sidecar["model"], sidecar["model_commit"]) == (REPO, commit)
  record = json.loads((checkpoint / "generate.json").read_text())
  assert (record["model"], record["model_commit"]) == (REPO + "@v1", commit)
  assert sorted(server.file_gets()) == _expected(tiny[1])  # v1 has no decoys: every file, once
  assert np.load(out).shape == (5, 32, 32, 3)
  capsys.readouterr()
  assert generate.main(["--model", "test-org/nope", "--prompt", PROMPT, "--out", str(tmp_path / "nope.npy")]) == 2
  assert capsys.readouterr().err == ("generate: error: no Hub repo 'test-org/nope' (check the id, or pass "
                                     "token=/HF_TOKEN for a private repo)\n")


def test_two_processes_download_once(server, tiny):
  """Two processes of one host load at the same moment: one downloads, the other waits on the lock
  and reads the cache: the Hub sees one listing, one metadata request and one transfer per file."""
  server.delay_s = 0.5  # every transfer: the first process holds the lock while the second arrives
  context = multiprocessing.get_context("spawn")
  barrier, results = context.Barrier(2), context.Queue()
  children = [context.Process(target=download_in_child, args=(REPO, barrier, results)) for _ in range(2)]
  for child in children:
    child.start()
  for child in children:
    child.join(timeout=180)
  assert [child.exitcode for child in children] == [0, 0]
  first, second = results.get(timeout=5), results.get(timeout=5)
  assert first == second and first[0] == server.commit(REPO)
  assert sorted(server.file_gets()) == _expected(tiny[1])
  heads = [path for method, path, _ in server.requests if method == "HEAD"]
  assert len(heads) == len(set(heads)) == len(tiny[1])
  assert sum("/tree/" in path for _, path, _ in server.requests) == 1


def test_hub_ids_and_the_files_asked_for(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert hub_id("Wan-AI/Wan2.1-T2V-1.3B-Diffusers") == ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", None)
  assert hub_id("org/name@refs/pr/1") == ("org/name", "refs/pr/1") and hub_id("org/name@v1.0") == ("org/name", "v1.0")
  (tmp_path / "org" / "name").mkdir(parents=True)
  assert hub_id("org/name") is None  # an existing folder is a folder
  assert [hub_id(text) for text in ("tiny", "./org/x", "/abs/path", "a/b/c", "org/name@")] == [None] * 5
  index = {"_class_name": "WanImageToVideoPipeline", "transformer": ["diffusers", "X"], "transformer_2": ["diffusers", "X"],
           "boundary_ratio": 0.9, "image_encoder": [None, None], "image_processor": ["transformers", "P"]}
  assert hub.loaded_components(index) == ["image_processor", "scheduler", "text_encoder", "tokenizer", "transformer",
                                          "transformer_2", "vae"]
  assert "transformer" not in hub.loaded_components({**index, "boundary_ratio": 1.0})
  assert "transformer_2" not in hub.loaded_components({**index, "boundary_ratio": None})
  assert "image_processor" not in hub.loaded_components({**index, "_class_name": "WanPipeline"})
  from huggingface_hub.utils import filter_repo_objects
  names = ["text_encoder/model-00001-of-00002.safetensors", "text_encoder/model.safetensors.index.json",
           "text_encoder/model.fp16-00001-of-00002.safetensors", "text_encoder/model-00001-of-00002.fp16.safetensors",
           "vae/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.fp32.safetensors",
           "vae/config.json", "vae/other.json", "tokenizer/spiece.model", "tokenizer/x.bin", "transformer/config.json"]
  kept = filter_repo_objects(names, allow_patterns=hub.allow_patterns(["text_encoder", "tokenizer", "vae"]),
                             ignore_patterns=hub.NEVER)
  assert list(kept) == ["text_encoder/model-00001-of-00002.safetensors", "text_encoder/model.safetensors.index.json",
                        "vae/diffusion_pytorch_model.safetensors", "vae/config.json", "tokenizer/spiece.model"]
