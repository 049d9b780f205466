"""Hugging Face Hub models: `org/name[@revision]` resolved to a local snapshot folder
(`download_snapshot`), which the folder loader then reads as any diffusers-format folder.

Everything goes through huggingface_hub's API, so its cache, resumed transfers, progress bars and
settings (HF_ENDPOINT, HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN) apply as in any Hugging Face
library. The order keeps a wrong repo cheap: model_index.json first, the repo refused unless it is a
Wan pipeline, then only the files the pipeline loads (`allow_patterns`): the configs, the tokenizer
and the safetensors (with their index) of the components it reads; no weight variants
(`*.fp16.safetensors`), no pickle / ONNX / Flax files, no component it does not load. Processes on
one host share the download: one takes a lock in the cache (per repo and revision) and downloads,
the others wait and then read the same files from the cache without asking the Hub.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

from pipelines.storage import weights
from pipelines.wan.pretrained.folder import PIPELINE_CLASSES
from pipelines.wan.pretrained import generation_defaults

HUB_ID = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)/([A-Za-z0-9][A-Za-z0-9._-]*)(?:@([^\s@]+))?")
# Components the folder loader always reads, and those it reads only when model_index.json names them.
REQUIRED = ("text_encoder", "tokenizer", "vae", "scheduler")
CONFIG_ONLY = ("tokenizer", "scheduler", "image_processor")  # folders of small files, taken whole
WEIGHT_STEMS = ("diffusion_pytorch_model", "model")  # diffusers' and transformers' weight file names
SHARD = "-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9]"  # a sharded file's "-00001-of-00003"
NEVER = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.msgpack", "*.h5", "*.onnx", "*.onnx_data", "*.pb"]
LOCKS = os.path.join(".locks", "wan-usp-jax")  # under the Hub cache: one lock file per repo and revision


def hub_id(text: str) -> tuple[str, str | None] | None:
  """(repo id, revision or None) when `text` names a Hub repo: not an existing local path, and
  `org/name` or `org/name@revision`; None otherwise (a folder, "tiny", a path that is not one, None:
  single files)."""
  match = None if text is None else HUB_ID.fullmatch(text)
  if match is None or os.path.exists(text):
    return None
  return f"{match[1]}/{match[2]}", match[3]


@dataclasses.dataclass(frozen=True)
class HubSnapshot:
  """A Hub repo's files the pipeline loads, in the local cache.

  Attributes:
    repo_id: "org/name".
    revision: the branch, tag or commit asked for (None: the repo's default branch).
    commit: the commit it resolved to (40 hex digits).
    folder: the local snapshot folder (a diffusers-format Wan folder).
  """
  repo_id: str
  revision: str | None
  commit: str
  folder: str

  @property
  def pinned(self) -> str:
    """"org/name@commit": this snapshot again, with no question to the Hub once cached."""
    return f"{self.repo_id}@{self.commit}"


def loaded_components(index: dict[str, Any]) -> list[str]:
  """The component folders of a model_index.json that the folder loader reads: the text encoder,
  tokenizer, VAE and scheduler; the expert(s) named (transformer_2 only with a boundary_ratio,
  transformer unless boundary_ratio is 1: `PipelineIndex.experts`); the image encoder and processor
  of an image-to-video pipeline."""
  named = {k for k, v in index.items() if isinstance(v, list) and v and v[0] is not None}
  wanted = set(REQUIRED)
  boundary = index.get("boundary_ratio")
  try:
    experts = {"transformer"} if boundary is None else {"transformer_2"} | (
        set() if float(boundary) == 1.0 else {"transformer"})
  except (TypeError, ValueError):  # refused by the folder checks, after the configs are read
    experts = {"transformer", "transformer_2"}
  wanted |= experts & named
  if index.get("_class_name") == "WanImageToVideoPipeline":
    wanted |= {"image_encoder", "image_processor"} & named
  return sorted(wanted)


def allow_patterns(components: list[str]) -> list[str]:
  """huggingface_hub `allow_patterns` of exactly the files the pipeline reads from `components`:
  model_index.json and the folder's own sampling defaults (`generation_defaults.FILE`, where it has
  one); each weight component's config.json and its safetensors, one file or shards,
  with their index, under diffusers' or transformers' name (no variants such as
  `diffusion_pytorch_model.fp16.safetensors`); the small config folders whole."""
  patterns = ["model_index.json", generation_defaults.FILE]
  for component in components:
    if component in CONFIG_ONLY:
      patterns.append(f"{component}/*")
      continue
    patterns.append(f"{component}/config.json")
    for stem in WEIGHT_STEMS:
      patterns += [f"{component}/{stem}.safetensors", f"{component}/{stem}{SHARD}.safetensors",
                   f"{component}/{stem}.safetensors.index.json"]
  return patterns


def download_snapshot(repo_id: str, revision: str | None = None, *, token: str | bool | None = None,
             cache_dir: str | None = None, local_files_only: bool = False,
             check_index: Callable[[dict[str, Any]], None] | None = None) -> HubSnapshot:
  """The repo's files the pipeline loads, downloaded into the Hub cache where missing.

  Args:
    repo_id, revision: "org/name" and a branch, tag or commit (None: the default branch).
    token, cache_dir, local_files_only: as huggingface_hub's (None: HF_TOKEN / the saved login,
      HF_HUB_CACHE).
    check_index: called with model_index.json's contents before any weight is asked for; raises to
      refuse the repo (the caller's class does not load it).

  Raises:
    weights.CheckpointError: one line a user can act on: no such repo (or a private one without a
      token), no such revision, not a Wan pipeline (naming its `_class_name`), not cached while
      offline, the Hub unreachable.
  """
  from huggingface_hub import constants

  cache = os.fspath(cache_dir) if cache_dir is not None else constants.HF_HUB_CACHE
  with _download_lock(cache, repo_id, revision) as waited:
    if waited and not local_files_only:  # another process has just downloaded it: read its files
      with contextlib.suppress(weights.CheckpointError):
        return _fetch(repo_id, revision, token, cache, True, check_index)
    return _fetch(repo_id, revision, token, cache, local_files_only, check_index)


def _fetch(repo_id: str, revision: str | None, token: Any, cache_dir: str, local_files_only: bool,
           check_index: Callable[[dict[str, Any]], None] | None) -> HubSnapshot:
  """`download_snapshot` without the lock."""
  import huggingface_hub

  try:
    index_path = huggingface_hub.hf_hub_download(repo_id, "model_index.json", revision=revision, token=token,
                                                 cache_dir=cache_dir, local_files_only=local_files_only)
    index = weights.read_json(index_path, "a Wan pipeline repo needs model_index.json")
    _check_pipeline(repo_id, index)
    if check_index is not None:
      check_index(index)
    commit = os.path.basename(os.path.dirname(index_path))  # the cache's snapshots/<commit>/model_index.json
    folder = huggingface_hub.snapshot_download(
        repo_id, revision=commit, token=token, cache_dir=cache_dir, local_files_only=local_files_only,
        allow_patterns=allow_patterns(loaded_components(index)), ignore_patterns=NEVER)
  except (weights.CheckpointError, ValueError):
    raise
  except Exception as e:  # huggingface_hub's errors (HTTP, offline, cache), one line each
    raise _hub_error(e, repo_id, revision, cache_dir, local_files_only) from e
  return HubSnapshot(repo_id=repo_id, revision=revision, commit=commit, folder=folder)


def _check_pipeline(repo_id: str, index: dict[str, Any]) -> None:
  name = index.get("_class_name", "WanPipeline")
  if name not in PIPELINE_CLASSES:
    raise weights.CheckpointError(f"Hub repo {repo_id!r} is a {name} (model_index.json _class_name), not a Wan "
                                  f"pipeline; only {', '.join(sorted(PIPELINE_CLASSES))} repos load")


def _hub_error(error: Exception, repo_id: str, revision: str | None, cache_dir: str,
               local_files_only: bool) -> Exception:
  """`error` (huggingface_hub's, or one it wraps) as one line naming the repo and what to do; other
  errors as they are."""
  from huggingface_hub import constants, utils as errors  # (the exceptions' address since 0.2x)

  chain = [error]
  while chain[-1].__cause__ is not None and len(chain) < 8:
    chain.append(chain[-1].__cause__)
  kinds = tuple(type(e) for e in chain)
  where = repo_id if revision is None else f"{repo_id}@{revision}"
  if any(issubclass(k, errors.RevisionNotFoundError) for k in kinds):
    return weights.CheckpointError(f"no revision {revision!r} in Hub repo {repo_id!r} (give a branch, tag or "
                                   "commit of the repo)")
  if any(issubclass(k, errors.GatedRepoError) for k in kinds):
    return weights.CheckpointError(f"Hub repo {repo_id!r} is gated: accept its terms on the Hub, then pass "
                                   "token=/HF_TOKEN")
  if any(issubclass(k, errors.RepositoryNotFoundError) for k in kinds):
    return weights.CheckpointError(f"no Hub repo {repo_id!r} (check the id, or pass token=/HF_TOKEN for a "
                                   "private repo)")
  if any(issubclass(k, errors.EntryNotFoundError) and not issubclass(k, errors.LocalEntryNotFoundError) for k in kinds):
    return weights.CheckpointError(f"Hub repo {where!r} has no model_index.json: not a diffusers pipeline (a Wan "
                                   "pipeline repo holds model_index.json, transformer/, text_encoder/, vae/, ...)")
  if isinstance(error, errors.LocalEntryNotFoundError):
    if local_files_only or constants.HF_HUB_OFFLINE:
      return weights.CheckpointError(
          f"Hub repo {where!r} is not (or not wholly) in the cache {cache_dir} and downloads are off "
          "(HF_HUB_OFFLINE=1 or local_files_only=True); run once online to download it")
    return weights.CheckpointError(f"Hub repo {where!r}: the Hub at {constants.ENDPOINT} cannot be reached and "
                                   f"the cache {cache_dir} does not hold it; check the network or HF_ENDPOINT")
  if isinstance(error, errors.HfHubHTTPError):
    return weights.CheckpointError(f"Hub repo {where!r}: {str(error).splitlines()[0]}")
  return error


@contextlib.contextmanager
def _download_lock(cache_dir: str, repo_id: str, revision: str | None) -> Iterator[bool]:
  """Holds this host's download lock of the repo and revision (a file lock in the cache);
  yields whether it had to wait for another process (which then downloaded the files). A cache
  where no lock can be written (read-only) is used without one."""
  from filelock import FileLock, Timeout

  name = urllib.parse.quote(f"{repo_id}@{revision or ''}", safe="") + ".lock"
  path = os.path.join(cache_dir, LOCKS, name)
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lock = FileLock(path)
    lock.acquire(timeout=0)
    waited = False
  except Timeout:
    print(f"waiting for another process downloading {repo_id} (lock {path})", file=sys.stderr, flush=True)
    lock.acquire()
    waited = True
  except OSError:
    yield False
    return
  try:
    yield waited
  finally:
    lock.release()
