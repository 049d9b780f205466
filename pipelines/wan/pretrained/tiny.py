"""The embedded tiny models: the random-weight model's configs and the trained ones' video size (their
folders: `pretrained.embedded`).

The random-weight tiny model (`WanPipeline.tiny(random=True)`) runs every code path with random
weights from `TINY_SEED`: 8 heads so that every Ulysses degree in {1, 2, 4, 8} divides N; text_dim =
the tiny UMT5's d_model. The embedded default (`WanPipeline.tiny()`) is the trained folder
`TINY_DEFAULT_FOLDER` (written by `python -m end_to_end.train.tiny`); "tiny-i2v" is `TINY_I2V_FOLDER`
(that folder trained further by `end_to_end.train.long_clips`).
"""

from __future__ import annotations

from pipelines.wan import schedulers
from pipelines.wan.transformer import WanTransformerConfig

TINY_TRANSFORMER = WanTransformerConfig(num_attention_heads=8, attention_head_dim=16, text_dim=32,
                                        ffn_dim=256, num_layers=2)
TINY_SEED = 0
TINY_SCHEDULER = schedulers.UniPCConfig(flow_shift=3.0)
# (height, width, frames): the one video size the trained default saw (end_to_end/train/tiny.py);
# `model_facts.ModelFacts.trained_video` warns for any other.
TINY_TRAINED_VIDEO = (64, 64, 17)
# The trained tiny models: "tiny" (text-to-video, `TINY_DEFAULT_FOLDER`) and "tiny-i2v"
# (`TINY_I2V_FOLDER`: the default trained further by end_to_end/train/long_clips.py on slow motions
# in 65-frame clips and with the first frame given, a TI2V folder: `expand_timesteps`, `image=`).
TINY_TRAINED_NAMES = ("tiny", "tiny-i2v")
