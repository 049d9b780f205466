"""`ModelFacts` and `token_facts` (pipelines/pipeline/checked/model_facts.py): a model's `TokenFacts` read from
its configs, the one source of its latent shapes, its token counts and the planner's estimates."""

import dataclasses

import pytest

from pipelines.parallel import estimate, planner
from pipelines.pipeline.checked.model_facts import ModelFacts, image_tokens, token_facts
from pipelines.pipeline.checked.request import GenerationRequest
from pipelines.wan.transformer import PRESETS, param_counts
from pipelines.wan.vae import VAE_PRESETS


def facts_of(model: str, vae: str, text_tokens: int = 512):
  config = VAE_PRESETS[vae]
  return token_facts(PRESETS[model], spatial_factor=config.spatial_factor, temporal_factor=config.temporal_factor,
                     text_tokens=text_tokens)


def test_token_facts_of_the_wan_configs():
  t2v = facts_of("wan2.1-t2v-1.3b", "wan2.1")
  assert (t2v.spatial_factor, t2v.temporal_factor, t2v.patch_size, t2v.latent_channels) == (8, 4, (1, 2, 2), 16)
  assert t2v.video_tokens(81, 480, 832) == 32760 and t2v.image_tokens == 0
  ti2v = facts_of("wan2.2-ti2v-5b", "wan2.2")
  assert (ti2v.spatial_factor, ti2v.latent_channels, ti2v.video_tokens(121, 704, 1280)) == (16, 48, 27280)


def test_image_tokens_of_i2v_and_flf2v():
  """Wan 2.1 I2V attends to one CLIP frame (257 tokens: ViT-H/14 at 224, 16 x 16 + 1) beside the text;
  FLF2V to two (its `pos_embed_seq_len`); the T2V and TI2V models to none."""
  assert [image_tokens(PRESETS[m]) for m in ("wan2.1-i2v-14b", "wan2.1-flf2v-14b", "wan2.1-t2v-14b",
                                             "wan2.2-ti2v-5b")] == [257, 514, 0, 0]
  assert facts_of("wan2.1-i2v-14b", "wan2.1").context_tokens == 512 + 257


def test_the_planner_and_the_estimate_read_the_facts():
  """The memory estimate holds L + P tokens of K/V, and the time estimate the facts' T: the I2V model's
  held K/V are 769 / 512 of the T2V model's; the 16x VAE of TI2V-5B gives a quarter of the 8x tokens."""
  t2v, i2v = facts_of("wan2.1-t2v-14b", "wan2.1"), facts_of("wan2.1-i2v-14b", "wan2.1")
  config = PRESETS["wan2.1-t2v-14b"]
  assert estimate.held_kv_bytes(config, i2v, rows=2, dtype_bytes=2) * 512 == estimate.held_kv_bytes(
      config, t2v, rows=2, dtype_bytes=2) * 769
  ti2v = PRESETS["wan2.2-ti2v-5b"]
  run = dict(frames=121, height=704, width=1280, steps=50, cfg=True, dtype="bfloat16", backend="tpu", devices=8)
  sixteen = estimate.estimate(ti2v, facts_of("wan2.2-ti2v-5b", "wan2.2"), **run)
  assert sixteen.tokens == 27280
  assert estimate.estimate(ti2v, facts_of("wan2.2-ti2v-5b", "wan2.1"), **run).tokens == 4 * 27280
  found = planner.candidates(ti2v, facts_of("wan2.2-ti2v-5b", "wan2.2"), param_counts=param_counts(ti2v),
                             devices=8, frames=121, height=704, width=1280, chip=planner.CHIPS["v6e"])
  cfg_split = next(c for c in found if c.mesh.cfg == 2)
  assert cfg_split.collective_bytes["cfg_exchange"] == 4 * 48 * 31 * 44 * 80  # one float32 noise prediction


def test_model_and_request_shapes_come_from_the_token_facts():
  facts = ModelFacts.tiny_random("float32")
  assert facts.token_facts.text_tokens == facts.max_sequence_length == 512
  assert facts.latent_shape(2, 32, 48, 9) == (2, 16, *facts.token_facts.latent_grid(9, 32, 48)) == (2, 16, 3, 4, 6)
  request = GenerationRequest.build(facts, "a fox", height=32, width=48, num_frames=9, num_inference_steps=1, seed=0,
                                    max_sequence_length=16)
  assert request.tokens == facts.token_facts.video_tokens(9, 32, 48) == 3 * 2 * 3
  assert request.token_facts == dataclasses.replace(facts.token_facts, text_tokens=16)  # the call's L


def test_token_facts_refuse_a_bad_count():
  with pytest.raises(ValueError, match="spatial_factor=0"):
    token_facts(PRESETS["tiny"], spatial_factor=0, temporal_factor=4, text_tokens=512)


def test_of_model_names_the_embedded_models():
  """"tiny-i2v" is the TI2V folder shipped beside the default (expand_timesteps), its one trained
  size kept; "tiny" takes no image; a folder reads its own files."""
  from pipelines.wan.pretrained import TINY_DEFAULT_FOLDER, TINY_TRAINED_VIDEO

  tiny, i2v = ModelFacts.of_model("tiny", "float32"), ModelFacts.of_model("tiny-i2v", "float32")
  assert (tiny.name, tiny.expand_timesteps, i2v.name, i2v.expand_timesteps) == ("tiny", False, "tiny-i2v", True)
  assert tiny.trained_video == i2v.trained_video == TINY_TRAINED_VIDEO
  assert ModelFacts.of_model("tiny-random", "float32").trained_video is None
  folder = ModelFacts.of_model(TINY_DEFAULT_FOLDER, "float32")
  assert folder.transformer == tiny.transformer and not folder.expand_timesteps


def test_the_reach_follows_the_rope_table_patch_and_vae():
  """`max_side` / `max_clip_frames`: the RoPE table's positions x patch x VAE factor (Wan 2.1: 16384
  pixels, 4093 frames; a 16x VAE as TI2V-5B's: 32768; half the table: half the side), and
  `check_reach` refuses one past them. Control: the limit itself passes, as do values that are not
  positive numbers (left to the type checks)."""
  facts = ModelFacts.tiny_random("float32")
  assert (facts.max_side, facts.max_clip_frames) == (16384, 4093)
  assert dataclasses.replace(facts, spatial_factor=16).max_side == 32768
  half = dataclasses.replace(facts, transformer=dataclasses.replace(facts.transformer, rope_max_seq_len=512))
  assert (half.max_side, half.max_clip_frames) == (8192, 2045)
  half.check_reach(8192, 8192, 2045)
  half.check_reach("8193", float("inf"), None)
  with pytest.raises(ValueError, match=r"^width=8208 is too large: .* at most 512 tokens .* at most 8192 pixels"):
    half.check_reach(64, 8208, 5)
  with pytest.raises(ValueError, match=r"^context_frames=2049 is too large: .* at most 2045 frames"):
    half.check_reach(64, 64, 2049, "context_frames")
