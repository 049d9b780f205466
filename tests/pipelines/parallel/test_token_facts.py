"""`TokenFacts` (pipelines/parallel/token_facts.py): video -> latent grid -> tokens, and the keys of
every cross-attention, from a model's numbers alone."""

import pytest

from pipelines.parallel.token_facts import TokenFacts

WAN21 = TokenFacts(temporal_factor=4, spatial_factor=8, patch_size=(1, 2, 2), latent_channels=16)
TI2V_5B = TokenFacts(temporal_factor=4, spatial_factor=16, patch_size=(1, 2, 2), latent_channels=48)


def test_wan21_480p_is_32760_tokens():
  """81 frames of 480 x 832: 21 latent frames of 60 x 104, patches of 1 x 2 x 2 (DESIGN.md section 1)."""
  assert WAN21.latent_grid(81, 480, 832) == (21, 60, 104)
  assert WAN21.video_tokens(81, 480, 832) == 21 * 60 * 104 // 4 == 32760
  assert WAN21.video_tokens(81, 720, 1280) == 75600  # 720p: the other real size the attention tests use


def test_ti2v_5b_vae_is_16x_spatial():
  assert TI2V_5B.latent_grid(121, 704, 1280) == (31, 44, 80)
  assert TI2V_5B.video_tokens(121, 704, 1280) == 31 * 22 * 40 == 27280
  assert WAN21.video_tokens(121, 704, 1280) == 4 * 27280  # the same video through an 8x VAE


def test_context_is_text_then_image_tokens():
  """I2V's cross-attention reads one CLIP frame's 257 tokens beside the 512 text tokens."""
  i2v = TokenFacts(temporal_factor=4, spatial_factor=8, patch_size=(1, 2, 2), latent_channels=16, image_tokens=257)
  assert (WAN21.context_tokens, i2v.context_tokens) == (512, 769)
  assert i2v.video_tokens(81, 480, 832) == WAN21.video_tokens(81, 480, 832)  # the video's tokens are unchanged


@pytest.mark.parametrize("bad", [dict(spatial_factor=0), dict(patch_size=(1, 2)), dict(patch_size=(1, 0, 2)),
                                 dict(latent_channels=0), dict(text_tokens=0), dict(image_tokens=-1)])
def test_counts_out_of_range_are_refused(bad):
  fields = dict(temporal_factor=4, spatial_factor=8, patch_size=(1, 2, 2), latent_channels=16) | bad
  with pytest.raises(ValueError, match="must be >= 1"):
    TokenFacts(**fields)
