"""The conditioning encoders: the UMT5 text encoder and its tokenizer, and the CLIP vision encoder of
Wan 2.1 I2V / FLF2V. Each is a module of its own (`encoders.umt5`, `encoders.tokenizer`,
`encoders.clip_vision`); the names below are their entry points.

The names below are imported on first use (`lazy_facade`), so that importing the package
imports none of its modules, and a JAX-free module among them loads without JAX.
"""

from lazy_facade import lazy_facade

_HOMES = (
    ("pipelines.wan.encoders.clip_vision", ("CLIPVision", "CLIPVisionConfig", "load_clip_vision", "penultimate_states")),
    ("pipelines.wan.encoders.tokenizer", ("TokenizerNotFoundError", "WAN_TEXT_LENGTH", "default_tokenizer",
                                          "folder_text_length", "load_tokenizer", "prompt_clean",
                                          "text_length", "tokenize")),
    ("pipelines.wan.encoders.umt5", ("UMT5_PRESETS", "UMT5Config", "UMT5Params", "abstract_umt5_params", "encode_text",
                                     "encode_text_layerwise", "init_umt5_params", "load_umt5", "official_keys", "umt5_from_state")),
)

__all__, __getattr__ = lazy_facade(__name__, _HOMES)
