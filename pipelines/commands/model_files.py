"""A model given as single files instead of --model: `--transformer FILE --vae FILE --text-encoder FILE
[--tokenizer FOLDER] [--config FOLDER]` (ComfyUI's files, the official release's; what
`WanPipeline.from_single_file` loads).

Three steps, each before the next costs more:
- `single_files`: the flags together, not with --model, files and folders that exist (no JAX);
- `read_facts`: the files' headers (safetensors: no tensor data) give the layouts and the configs
  (`wan.pretrained.read_sources`), so the request is checked before any weight loads;
- `describe`: each file's path, layout, size, mtime and SHA-256 for the run's records. Hashing reads
  every byte (a 28 GB transformer: minutes on a slow disk), so it is done once per run, by the
  process that writes, after every other check; a digest recorded for the same path, size and mtime
  is reused (`known`), and `changed` tells a resumed run whether a file is still the one it ran on.
Imports no JAX.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any

from pipelines.commands.flags import UsageError
from pipelines.storage import weights
from pipelines.wan.pretrained import EXPECTED_FILES, Sources

# (Sources field, flag): the three files and the two folders.
FILES = (("transformer", "--transformer"), ("vae", "--vae"), ("text_encoder", "--text-encoder"))
FOLDERS = (("tokenizer", "--tokenizer"), ("config", "--config"))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model", "tokenizer")
_ANNOUNCE_BYTES = 1 << 30  # a file this large gets a line before it is hashed


def add_single_file_flags(p: argparse.ArgumentParser) -> None:
  """--transformer, --vae, --text-encoder, --tokenizer and --config, in their own --help group."""
  g = p.add_argument_group("a model as single files (instead of --model)")
  g.add_argument("--transformer", metavar="FILE", default=None,
                 help="the Wan transformer file (.safetensors: ComfyUI's models/diffusion_models/, its scaled fp8 "
                      "too, the official names or diffusers'); needs --vae and --text-encoder (default: none)")
  g.add_argument("--vae", metavar="FILE", default=None,
                 help="the Wan VAE file (wan_2.1_vae.safetensors or wan2.2_vae.safetensors) (default: none)")
  g.add_argument("--text-encoder", metavar="FILE", default=None,
                 help="the UMT5-XXL encoder file (umt5_xxl_fp16.safetensors, or Wan's own T5 names) (default: none)")
  g.add_argument("--tokenizer", metavar="FOLDER", default=None,
                 help="a folder with the google/umt5-xxl tokenizer, or a pipeline folder holding tokenizer/ "
                      "(none ships with this package) (default: --config's)")
  g.add_argument("--config", metavar="FOLDER", default=None,
                 help="a diffusers-format folder whose config.json files describe the model (default: none, the "
                      "shapes are matched to a released Wan model's or a shipped tiny one's, diffusers' UniPC "
                      "scheduler; other shapes are refused)")


def single_files(args: argparse.Namespace) -> Sources | None:
  """The single files of the flags (None: none given), checked without reading them.

  Raises:
    UsageError: the files with --model, one of the three missing, a path that is no file (or no
      folder), no tokenizer.
  """
  given = [(flag, getattr(args, field)) for field, flag in FILES + FOLDERS if getattr(args, field) is not None]
  if not given:
    return None
  if args.model is not None:
    raise UsageError(f"--model {args.model!r} and {given[0][0]} {given[0][1]!r} both name the model; give "
                     "--model (a diffusers or official Wan folder, or tiny) or the single files --transformer, "
                     "--vae and --text-encoder, not both")
  missing = [flag for field, flag in FILES if getattr(args, field) is None]
  if missing:
    listed = " and ".join([", ".join(missing[:-1]), missing[-1]] if len(missing) > 1 else missing)
    raise UsageError(f"{' '.join(f'{f} {p!r}' for f, p in given)} needs {listed} too: a model as "
                     "single files is --transformer FILE --vae FILE --text-encoder FILE (or pass --model FOLDER)")
  for field, flag in FILES:
    if not os.path.isfile(getattr(args, field)):
      raise UsageError(f"{flag} {getattr(args, field)!r} is not a file; pass {EXPECTED_FILES[field]}")
  for field, flag in FOLDERS:
    if getattr(args, field) is not None and not os.path.isdir(getattr(args, field)):
      raise UsageError(f"{flag} {getattr(args, field)!r} is not a folder; pass "
                       + ("a folder holding the google/umt5-xxl tokenizer" if field == "tokenizer"
                          else "a diffusers-format Wan folder (transformer/config.json, vae/config.json, ...)"))
  tokenizer = args.tokenizer if args.tokenizer is not None else args.config
  if tokenizer is None:
    raise UsageError("--transformer, --vae and --text-encoder need --tokenizer FOLDER: no UMT5 tokenizer ships with "
                     "this package; pass a local folder holding the google/umt5-xxl tokenizer (e.g. the tokenizer/ "
                     "folder of Wan-AI/Wan2.1-T2V-1.3B-Diffusers)")
  if not any(os.path.exists(os.path.join(tokenizer, name)) for name in TOKENIZER_FILES):
    flag = "--tokenizer" if args.tokenizer is not None else "--config (the tokenizer's folder without --tokenizer)"
    raise UsageError(f"{flag} {tokenizer!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); pass "
                     "--tokenizer FOLDER with the google/umt5-xxl tokenizer")
  return Sources(transformer=args.transformer, vae=args.vae, text_encoder=args.text_encoder, tokenizer=tokenizer,
                 config=args.config)


def read_facts(files: Sources, dtype: str) -> tuple[Any, dict[str, str]]:
  """(the `ModelFacts` of the files, component -> layout), from their headers and configs only.

  Raises:
    weights.CheckpointError: a truncated or foreign file, shapes that match no Wan config, an
      image-to-video transformer (its CLIP encoder is no single file here).
    UsageError: a tokenizer folder transformers cannot read.
  """
  from pipelines.pipeline.checked.model_facts import ModelFacts
  from pipelines.wan.pretrained import check_no_image_branch, read_sources

  try:
    read = read_sources(files)
  except OSError as e:  # the tokenizer: transformers cannot read the folder
    raise UsageError(f"--tokenizer {files.tokenizer!r}: {e}") from e
  check_no_image_branch(read)
  facts = ModelFacts.from_components(read, dtype, name=os.path.abspath(files.transformer))
  return facts, {field: getattr(read, field).layout for field, _ in FILES}


def _stat(path: str) -> dict[str, Any]:
  info = os.stat(path)
  return {"path": os.path.abspath(path), "size": info.st_size, "mtime_ns": info.st_mtime_ns}


def describe(files: Sources, found: Mapping[str, str], known: Mapping[str, Any] | None = None,
             prog: str = "generate") -> dict[str, dict[str, Any]]:
  """Each file's {path, layout, size, mtime_ns, sha256} (component -> that), for the run record and
  the sidecar; a file of 1 GiB or more is announced on stderr before it is hashed.

  Args:
    found: component -> layout (`read_facts`).
    known: an earlier `describe` (a resumed run's record): a digest for the same path, size and
      mtime is taken from it, not computed again.
  """
  out = {}
  for field, flag in FILES:
    stat = _stat(getattr(files, field))
    before = (known or {}).get(field) or {}
    if all(before.get(k) == v for k, v in stat.items()) and before.get("sha256"):
      digest = before["sha256"]
    else:
      if stat["size"] >= _ANNOUNCE_BYTES:
        print(f"{prog}: hashing {flag} {stat['path']} ({stat['size'] / 1e9:.1f} GB) for the run's record (SHA-256, "
              "once per run)", file=sys.stderr)
      digest = weights.file_sha256(stat["path"])
    out[field] = {**stat, "layout": found[field], "sha256": digest}
  return out


def changed(saved: Mapping[str, Any]) -> list[str]:
  """What differs between the files a run recorded (`describe`) and the files at those paths now:
  one line per file that is gone or whose SHA-256 changed (a file of another size or mtime is hashed
  again; the same bytes touched are the same file)."""
  lines = []
  for field, flag in FILES:
    before = saved.get(field)
    if before is None:
      continue
    path = before["path"]
    if not os.path.isfile(path):
      lines.append(f"{flag} {path!r} is gone")
      continue
    stat = _stat(path)
    if all(before.get(k) == v for k, v in stat.items()):
      continue
    digest = weights.file_sha256(path)
    if digest != before.get("sha256"):
      lines.append(f"{flag} {path!r} changed (SHA-256 {before.get('sha256', '')[:12]}... then, {digest[:12]}... now)")
  return lines
