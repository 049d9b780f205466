"""Tests for pipelines/wan/vae/config.py: the released Wan 2.1 VAE `config.json` reads as the "wan2.1"
preset, whose parameter shapes are diffusers' `AutoencoderKLWan`'s (built on the meta device)."""

import diffusers
import pytest
import torch

from pipelines.wan import vae as V

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


def test_config_reads_released_wan21_config():
  raw = {"_class_name": "AutoencoderKLWan", "_diffusers_version": "0.33.0.dev0", "attn_scales": [],
         "base_dim": 96, "dim_mult": [1, 2, 4, 4], "dropout": 0.0,
         "latents_mean": list(V.WAN21_LATENTS_MEAN), "latents_std": list(V.WAN21_LATENTS_STD),
         "num_res_blocks": 2, "temperal_downsample": [False, True, True], "z_dim": 16}
  cfg = V.WanVAEConfig.from_diffusers(raw)
  assert cfg == V.VAE_PRESETS["wan2.1"]
  assert (cfg.spatial_factor, cfg.temporal_factor) == (8, 4)
  with torch.device("meta"):  # shapes only, no 127M-parameter allocation
    ref = diffusers.AutoencoderKLWan(**{k: v for k, v in raw.items() if not k.startswith("_")})
  ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
  assert cfg.param_shapes() == ref_shapes
  with pytest.raises(ValueError, match="unknown AutoencoderKLWan config keys"):
    V.WanVAEConfig.from_diffusers({**raw, "clip_outputs": True})
