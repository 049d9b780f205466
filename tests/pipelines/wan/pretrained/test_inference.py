"""`wan.pretrained.inference`: configs from shape-only state dicts at the real sizes of the released
Wan models (nothing allocated, no downloads); names in original Wan / ComfyUI keys are renamed by
the key maps first, as a single file's are."""

import pytest

from pipelines.storage.weights import CheckpointError
from pipelines.wan.encoders import umt5
from pipelines.wan.pretrained import inference
from pipelines.wan.transformer import PRESETS, checkpoint_layout, diffusers_key, wan_key
from pipelines.wan.vae import VAE_PRESETS, encoder_key, original_keys

REAL = ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.1-i2v-14b", "wan2.1-flf2v-14b", "wan2.2-ti2v-5b",
        "wan2.1-vace-1.3b", "wan2.1-vace-14b")


def _wan_named(config) -> dict[str, tuple[int, ...]]:
  """A transformer's shapes under original Wan names, then renamed back as `layouts` does."""
  original = {wan_key(key): shape for key, shape, *_ in checkpoint_layout(config)}
  return {diffusers_key(key): shape for key, shape in original.items()}


@pytest.mark.parametrize("name", REAL)
def test_transformer_config_at_real_sizes(name):
  got = inference.transformer_config(_wan_named(PRESETS[name]), name)
  assert got == PRESETS[name]


def test_real_sizes_are_what_they_are():
  """Positive control on the dicts: the 14B's are the 14B's (a D of 5120, 40 layers, 40 heads)."""
  shapes = _wan_named(PRESETS["wan2.1-t2v-14b"])
  assert shapes["patch_embedding.weight"] == (5120, 16, 1, 2, 2) and shapes["blocks.39.ffn.net.0.proj.weight"][0] == 13824
  assert inference.transformer_config(shapes).num_attention_heads == 40
  assert inference.transformer_config(_wan_named(PRESETS["wan2.2-ti2v-5b"])).num_attention_heads == 24


@pytest.mark.parametrize("name", ["wan2.1", "wan2.2", "tiny"])
def test_vae_config_from_shapes(name):
  config = VAE_PRESETS[name]
  assert inference.vae_config(config.param_shapes(), name) == config
  # from the original names' encoder keys alone (what `layouts` reads before it knows the config)
  original = {o: config.param_shapes()[d] for d, o in original_keys(config).items()}
  partial = {encoder_key(k): s for k, s in original.items() if encoder_key(k)}
  partial["decoder.conv_out.weight"] = original["decoder.head.2.weight"]
  assert inference.vae_config(partial, name) == config


def test_umt5_config_from_shapes():
  assert inference.umt5_config(umt5.checkpoint_shapes(umt5.UMT5_PRESETS["umt5-xxl"])) == umt5.UMT5_PRESETS["umt5-xxl"]
  assert inference.umt5_config(umt5.checkpoint_shapes(umt5.UMT5_PRESETS["tiny"])) == umt5.UMT5_PRESETS["tiny"]


def test_shapes_that_match_no_wan_config():
  shapes = _wan_named(PRESETS["wan2.1-t2v-1.3b"])
  shapes["patch_embedding.weight"] = (1000, 16, 1, 2, 2)
  with pytest.raises(CheckpointError, match=r"'x.safetensors': model width D=1000 is no multiple of the head dim "
                                            r"128.*pass config= a diffusers-format folder"):
    inference.transformer_config(shapes, "x.safetensors")
  vae = dict(VAE_PRESETS["wan2.1"].param_shapes())
  vae["post_quant_conv.weight"] = (20, 20, 1, 1, 1)
  with pytest.raises(CheckpointError, match=r"z_dim=20 latent channels; only Wan 2.1's 16 and Wan 2.2's 48"):
    inference.vae_config(vae, "v.safetensors")
