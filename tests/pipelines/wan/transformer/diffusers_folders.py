"""Random diffusers `WanTransformer3DModel`s (TORCH_CONFIGS), each saved once per session with
`save_pretrained(safe_serialization=True)` and loaded once per dtype, by diffusers and by our loader:
shared by test_model.py (parity), test_config.py and test_loading.py. The session fixture that owns
the folder they are saved under (`_saved_models`) is in conftest.py.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from pipelines.wan.transformer import load_transformer
from tests.torch_weights import randomize

diffusers = pytest.importorskip("diffusers")

# Small enough to compile in seconds; N=4 divides every Ulysses degree the sharded tests use.
TORCH_CONFIGS = {
    "n2h12": dict(num_attention_heads=2, attention_head_dim=12, num_layers=2),
    "n3h16": dict(num_attention_heads=3, attention_head_dim=16, num_layers=3),
    "n4h12": dict(num_attention_heads=4, attention_head_dim=12, num_layers=2),
}
COMMON = dict(in_channels=4, out_channels=4, text_dim=20, freq_dim=256, ffn_dim=40)

_FOLDERS: dict[str, str] = {}


def _folder(name: str) -> str:
  if name not in _FOLDERS:
    model = diffusers.WanTransformer3DModel(**TORCH_CONFIGS[name], **COMMON)
    randomize(model, seed=sum(map(ord, name)), spread=1.6)
    _FOLDERS[name] = os.path.join(_FOLDERS["root"], name, "transformer")
    model.save_pretrained(_FOLDERS[name], safe_serialization=True)
  return _FOLDERS[name]


@functools.cache
def _torch_model(name: str, dtype: torch.dtype):
  return diffusers.WanTransformer3DModel.from_pretrained(_folder(name), torch_dtype=dtype).eval()


@functools.cache
def _ours(name: str, dtype) -> object:
  return load_transformer(_folder(name), dtype)
