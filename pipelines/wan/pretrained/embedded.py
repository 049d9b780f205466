"""Where the embedded trained tiny models' folders are (JAX-free: the commands read their
`generation_defaults.json` before JAX starts). "tiny" is the text-to-video default (written by
`python -m end_to_end.train.tiny`); "tiny-i2v" that folder trained further by
`end_to_end.train.long_clips` (a TI2V folder: `expand_timesteps`, `image=`)."""

import os

TINY_DEFAULT_FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_default")
TINY_I2V_FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_i2v")
TINY_FOLDERS = {"tiny": TINY_DEFAULT_FOLDER, "tiny-i2v": TINY_I2V_FOLDER}
