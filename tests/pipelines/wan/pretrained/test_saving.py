"""`pipelines.wan.pretrained.saving`: a written diffusers folder loads back (`WanPipeline.from_pretrained`)
with every weight bit for bit and the same configs."""

import jax
import numpy as np
from flax import nnx

from pipelines.pipeline import WanPipeline
from pipelines.wan.pretrained import GenerationDefaults, saving


def test_saved_folder_loads_back_bit_for_bit(tmp_path):
  pipe = WanPipeline.tiny(random=True)
  saving.save_pipeline(str(tmp_path), transformer=nnx.merge(pipe._graphdef, pipe._experts[0]),
                       text_encoder=(pipe.text_encoder_config, pipe._text_params), vae=pipe.vae,
                       tokenizer=pipe.tokenizer, scheduler_config=pipe.scheduler_config)
  back = WanPipeline.from_pretrained(str(tmp_path))
  assert back.generation_defaults == GenerationDefaults()  # none given, none written: diffusers'
  assert back.transformer_config == pipe.transformer_config
  assert back.text_encoder_config == pipe.text_encoder_config
  assert back.vae.config == pipe.vae.config
  assert back.scheduler_config == pipe.scheduler_config
  for what, a, b in (("transformer", pipe._experts[0], back._experts[0]),
                     ("text encoder", pipe._text_params, back._text_params),
                     ("vae", pipe.vae.params, back.vae.params)):
    la, lb = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb], what
    for (path, x), (_, y) in zip(la, lb):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{what} {jax.tree_util.keystr(path)}")
  ids = back.tokenizer(["a red square moving right"])["input_ids"]
  assert ids == pipe.tokenizer(["a red square moving right"])["input_ids"]


def test_the_model_s_defaults_are_written_and_load_back(tmp_path):
  """`save_pipeline(..., generation_defaults=)` writes the folder's own defaults; the loaded pipeline
  and its request take them (a call without height asks for the written 96)."""
  pipe = WanPipeline.tiny(random=True)
  mine = GenerationDefaults(height=96, width=64, num_frames=9, num_inference_steps=3, guidance_scale=1.5)
  saving.save_pipeline(str(tmp_path), transformer=nnx.merge(pipe._graphdef, pipe._experts[0]),
                       text_encoder=(pipe.text_encoder_config, pipe._text_params), vae=pipe.vae,
                       tokenizer=pipe.tokenizer, scheduler_config=pipe.scheduler_config, generation_defaults=mine)
  back = WanPipeline.from_pretrained(str(tmp_path))
  assert back.generation_defaults == mine
  request = back.check_inputs("x", seed=0)
  assert (request.height, request.width, request.num_frames, request.steps, request.guidance) == (96, 64, 9, 3, (1.5, 1.5))
