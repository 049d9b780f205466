"""`python -m pipelines.wan.pretrained.convert SRC DST`: a diffusers-format Wan folder from a folder
in the official Wan layout, or from single files (`--transformer F --vae F --text-encoder F
--tokenizer DIR [--config DIR]`), so that machines without torch load it (`.pth` files need torch).

The tensors keep their dtype and get diffusers' / transformers' names (a scaled-fp8 weight is
written dequantized, q * scale in float32, row by row). DST must not exist: the folder is written
next to it under a temporary name and renamed when complete, so an interrupted run leaves no half
folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence

import numpy as np

from pipelines.storage import weights
from pipelines.wan.pretrained import layouts, saving
from pipelines.wan.pretrained.sources import Components, Sources, read_sources


def _tensors(component: layouts.ComponentFile) -> dict[str, np.ndarray]:
  out = {}
  for key, value in component.tensors.items():
    array = np.asarray(value)
    if key in component.scales:  # broadcast to the weight: one value, or one per output row
      array = array.astype(np.float32) * component.scales[key]
    out[key] = np.ascontiguousarray(array)
  return out


def _write(read: Components, folder: str) -> None:
  from safetensors.numpy import save_file

  for name, component, file in (("transformer", read.transformer, "diffusion_pytorch_model.safetensors"),
                                ("vae", read.vae, "diffusion_pytorch_model.safetensors"),
                                ("text_encoder", read.text_encoder, "model.safetensors")):
    os.makedirs(os.path.join(folder, name))
    save_file(_tensors(component), os.path.join(folder, name, file), metadata={"format": "pt"})
  saving.write_configs(folder, transformer=read.transformer_config, vae=read.vae_config,
                       text_encoder=read.text_encoder_config, tokenizer=read.tokenizer,
                       scheduler_config=read.scheduler_config, expand_timesteps=read.expand_timesteps)


def convert(sources: Sources, destination: str) -> str:
  """Writes the diffusers folder of `sources` at `destination` (atomically; module docstring).

  Raises:
    weights.CheckpointError: `destination` exists, or the sources' errors (`read_sources`).
  """
  if os.path.exists(destination):
    raise weights.CheckpointError(f"{destination!r} exists; convert writes a new folder: remove it or pick another name")
  read = read_sources(sources)
  parent = os.path.dirname(os.path.abspath(destination))
  temporary = tempfile.mkdtemp(prefix=".convert-", dir=parent)
  try:
    _write(read, temporary)
    os.rename(temporary, destination)
  except BaseException:
    shutil.rmtree(temporary, ignore_errors=True)
    raise
  return destination


# What the command takes, for its argument errors.
TAKES = ("convert takes SOURCE DST (an official Wan folder: config.json beside .pth / .safetensors files) or "
         "DST --transformer F --vae F --text-encoder F (single files), DST the new diffusers folder")


def main(argv: Sequence[str] | None = None) -> int:
  """The command; returns the exit status: 0 written, 1 a source that cannot be read or converted,
  2 arguments it does not take (one `convert: error:` line each, as the unreadable sources')."""
  parser = argparse.ArgumentParser(prog="python -m pipelines.wan.pretrained.convert", description=__doc__.split("\n")[0])
  parser.add_argument("source", nargs="?", help="a folder in the official Wan layout")
  parser.add_argument("destination", help="the diffusers folder to write (must not exist)")
  for flag in ("--transformer", "--vae", "--text-encoder", "--tokenizer", "--config"):
    parser.add_argument(flag, help=f"single files instead of SOURCE: {flag[2:]} ({'folder' if flag in ('--tokenizer', '--config') else 'file'})")
  args = parser.parse_args(argv)
  refused = _refused(args)
  if refused is not None:
    print(f"convert: error: {refused}", file=sys.stderr)
    return 2
  try:
    sources = Sources.official(args.source) if args.source else Sources(
        transformer=args.transformer, vae=args.vae, text_encoder=args.text_encoder, tokenizer=args.tokenizer,
        config=args.config)
    print(f"convert: wrote {convert(sources, args.destination)}")
  except (weights.CheckpointError, OSError) as e:
    print(f"convert: error: {e}", file=sys.stderr)
    return 1
  return 0


def _refused(args: argparse.Namespace) -> str | None:
  """What is wrong with the arguments, with what the command takes (`TAKES`); None when nothing."""
  files = {"--transformer": args.transformer, "--vae": args.vae, "--text-encoder": args.text_encoder}
  given = [flag for flag, value in files.items() if value is not None]
  if args.source is not None and given:
    return f"pass SOURCE {args.source!r} or {', '.join(given)}, not both: {TAKES}"
  if args.source is None:
    missing = [flag for flag in files if flag not in given]
    if not given:
      return f"only DST {args.destination!r} given: {TAKES}"
    return f"{', '.join(missing)} missing beside {', '.join(given)}: {TAKES}" if missing else None
  if os.path.isfile(os.path.join(args.source, "model_index.json")):
    return (f"{args.source!r} is a diffusers-format folder already (it has model_index.json): load it as it is "
            f"(generate --model FOLDER, WanPipeline.from_pretrained(FOLDER)); {TAKES}")
  if not os.path.isfile(os.path.join(args.source, "config.json")):
    return f"SOURCE {args.source!r} has no config.json, so it is not a folder in the official Wan layout: {TAKES}"
  return None


if __name__ == "__main__":
  sys.exit(main())
