"""Tests for pipelines/wan/transformer/loading.py: diffusers folders whose state dict lacks, adds or
mis-shapes a key are refused naming it; a folder split into several safetensors files loads to the
same parameters; pickle-only folders are refused. Reference: the random diffusers models of
diffusers_folders.py, loaded once per session (shared with test_model.py)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from pipelines.storage.weights import CheckpointError
from pipelines.wan.transformer import load_transformer
from tests.pipelines.wan.transformer.diffusers_folders import _folder, _ours, _torch_model

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


def _broken_copy(tmp_path, edit) -> str:
  """Copies the n2h12 folder with its state dict changed by edit(state)."""
  src = _folder("n2h12")
  dst = tmp_path / "transformer"
  dst.mkdir()
  (dst / "config.json").write_text(open(os.path.join(src, "config.json")).read())
  state = load_file(os.path.join(src, "diffusion_pytorch_model.safetensors"))
  edit(state)
  save_file(state, str(dst / "diffusion_pytorch_model.safetensors"))
  return str(dst)


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.pop("blocks.1.attn2.norm_k.weight"),
     r"missing keys \(1\).*blocks\.1\.attn2\.norm_k\.weight"),
    (lambda s: s.update({"blocks.0.extra.weight": np.ones(3, np.float32)}),
     r"unexpected keys \(1\).*blocks\.0\.extra\.weight"),
    (lambda s: s.update({"proj_out.weight": np.ones((16, 25), np.float32)}),
     r"shape mismatches \(1\).*proj_out\.weight: checkpoint \(16, 25\) vs model \(16, 24\)"),
])
def test_loader_reports_bad_keys(tmp_path, edit, message):
  with pytest.raises(CheckpointError, match=message):
    load_transformer(_broken_copy(tmp_path, edit))


def test_loader_reads_sharded_folder(tmp_path):
  """A folder split into several safetensors files with an index loads to the same parameters."""
  name = "n2h12"
  folder = str(tmp_path / "transformer")
  _torch_model(name, torch.float32).save_pretrained(folder, safe_serialization=True, max_shard_size="20KB")
  assert any(n.endswith(".safetensors.index.json") for n in os.listdir(folder))
  single, sharded = _ours(name, jnp.float32), load_transformer(folder, jnp.float32)
  # Bit-exact: the same stored values, read from two file layouts (no arithmetic).
  for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_loader_refuses_pickle_only(tmp_path):
  (tmp_path / "config.json").write_text(open(os.path.join(_folder("n2h12"), "config.json")).read())
  (tmp_path / "diffusion_pytorch_model.bin").write_bytes(b"not loaded")
  with pytest.raises(CheckpointError, match="pickle"):
    load_transformer(str(tmp_path))
