"""`vae.encoding`: the encode as its chunks (frame 0, then 4 frames a chunk, the cache carried), and
the videos it refuses. Its values against diffusers: test_model.py (`test_encode_matches_diffusers`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelines.wan import vae as V

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


def test_encode_is_its_chunks_with_the_cache_carried():
  """A 9-frame video: `encode` equals frame 0 then two 4-frame chunks through `encode_chunk`, the
  cache carried, split by `latent_distribution` (the same layer functions: to fp32 rounding, 1e-5
  of the output's scale). Positive control: the last chunk without the cache differs."""
  cfg = V.VAE_PRESETS["tiny"]
  vae = V.init_vae(cfg, jax.random.key(0))
  video = jax.random.uniform(jax.random.key(1), (1, 3, 9, 32, 48), minval=-1, maxval=1)
  whole = V.encode(vae, video)
  x = jnp.transpose(video, (0, 2, 3, 4, 1))
  h0, cache = V.encode_chunk(vae, None, x[:, :1])
  h1, cache = V.encode_chunk(vae, cache, x[:, 1:5])
  h2, _ = V.encode_chunk(vae, cache, x[:, 5:9])
  pieces = V.latent_distribution(jnp.concatenate([h0, h1, h2], axis=1))
  scale = float(jnp.max(jnp.abs(whole.mean)))
  np.testing.assert_allclose(pieces.mean, whole.mean, atol=1e-5 * scale)
  np.testing.assert_allclose(pieces.logvar, whole.logvar, atol=1e-5 * float(jnp.max(jnp.abs(whole.logvar))))
  assert whole.mean.shape == (1, cfg.z_dim, 3, 4, 6)
  fresh, _ = V.encode_chunk(vae, None, x[:, 5:9])
  assert float(jnp.max(jnp.abs(fresh - h2))) > 1e-3


@pytest.mark.parametrize("shape, match", [((1, 3, 6, 32, 48), "frames=6 must be 1 \\+ 4k"),
                                          ((1, 4, 5, 32, 48), "channels"),
                                          ((1, 3, 5, 30, 48), "multiples of 8"), ((3, 5, 32, 48), "5-D|must be")])
def test_videos_the_vae_cannot_encode_are_refused(shape, match):
  with pytest.raises(ValueError, match=match):
    V.check_video(V.VAE_PRESETS["tiny"], jnp.zeros(shape))
