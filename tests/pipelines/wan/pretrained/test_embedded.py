"""`pretrained.embedded`: the trained tiny models' folders are in the package, each a diffusers
pipeline with its own generation_defaults.json, and the module loads without JAX (the commands read
the folders' defaults before JAX starts)."""

import os
import pathlib
import subprocess
import sys

from pipelines.wan.pretrained import TINY_DEFAULT_FOLDER, TINY_FOLDERS, TINY_I2V_FOLDER


def test_the_folders_are_shipped_with_their_defaults():
  assert TINY_FOLDERS == {"tiny": TINY_DEFAULT_FOLDER, "tiny-i2v": TINY_I2V_FOLDER}
  for folder in TINY_FOLDERS.values():
    for name in ("model_index.json", "generation_defaults.json", "transformer/config.json"):
      assert os.path.isfile(os.path.join(folder, name)), (folder, name)


def _imports_jax(code: str) -> bool:
  root = pathlib.Path(__file__).resolve().parents[4]
  out = subprocess.run([sys.executable, "-c", code + "; import sys; print('jax' in sys.modules)"], capture_output=True,
                       text=True, check=True, cwd=root)
  return out.stdout.split()[-1] == "True"


def test_reading_the_folders_and_their_defaults_imports_no_jax():
  """Positive control: importing the transformer's config does import JAX, and the check sees it."""
  assert not _imports_jax("from pipelines.wan.pretrained import TINY_FOLDERS, GenerationDefaults; "
                          "GenerationDefaults.read(TINY_FOLDERS['tiny']); import pipelines.commands.presets")
  assert _imports_jax("from pipelines.wan.pretrained import TINY_TRANSFORMER")
