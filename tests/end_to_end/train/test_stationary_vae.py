"""end_to_end.train.stationary_vae against the definitions it claims: its encoder's latents are
`long_clips.stationary_latents` of the original encoder, its decoder holds each latent frame's
picture (the first chunk's decode) for 4 frames. Tolerance: fp32 convs of |x| <= ~1 -> 1e-5."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from end_to_end.train import long_clips
from end_to_end.train.stationary_vae import stationary_vae
from pipelines.wan import vae as wan_vae


def _vae():
  return wan_vae.init_vae(wan_vae.VAE_PRESETS["tiny"], jax.random.key(8))


def test_encoder_latents_are_each_4th_frame_encoded_alone():
  """25 random frames: latent frame k is the original encoder's latent of frame 4k alone (every
  k, frame 0 included). Control: the original's own latent frames 1-6 are not."""
  vae = _vae()
  ours = jax.jit(lambda x: long_clips.encode_mean(stationary_vae(vae), x))
  original = jax.jit(lambda x: long_clips.encode_mean(vae, x))
  x = np.random.default_rng(9).uniform(-1, 1, (1, 25, 16, 16, 3)).astype(np.float32)
  target = long_clips.stationary_latents(original, x)
  z = np.asarray(ours(x))
  assert z.shape == target.shape == (1, 7, 2, 2, 16)
  np.testing.assert_allclose(z, target, atol=1e-5)
  assert np.abs(np.asarray(original(x))[:, 1:] - target[:, 1:]).max() > 1e-2


def test_decoder_holds_each_latent_frames_picture_for_4_frames():
  """3 random latent frames -> 9 video frames: frame 0 is the original decoder's frame 0 (the
  first chunk is unchanged), frames 1-4 the picture of latent frame 1 decoded alone, 5-8 of latent
  frame 2. Control: the original decoder's frames 1-4 differ from one another."""
  vae = _vae()
  ours = stationary_vae(vae)
  z = jnp.asarray(np.random.default_rng(10).standard_normal((1, 16, 3, 2, 2)).astype(np.float32))
  video = np.asarray(wan_vae.decode(ours, z, video_layout="BFHWC"))[0]
  before = np.asarray(wan_vae.decode(vae, z, video_layout="BFHWC"))[0]
  assert video.shape == (9, 16, 16, 3)
  np.testing.assert_allclose(video[0], before[0], atol=1e-5)
  for k in (1, 2):
    picture = np.asarray(wan_vae.decode(ours, z[:, :, k:k + 1], video_layout="BFHWC"))[0, 0]
    np.testing.assert_allclose(video[4 * k - 3:4 * k + 1], np.broadcast_to(picture, (4, *picture.shape)), atol=1e-5)
  assert np.abs(np.diff(before[1:5], axis=0)).max() > 1e-3


def test_a_residual_vae_is_refused():
  vae = _vae()
  residual = wan_vae.WanVAE(dataclasses.replace(vae.config, is_residual=True), vae.params)
  with pytest.raises(ValueError, match="is_residual"):
    stationary_vae(residual)
