"""LoRA adapters for the Wan transformer: files and their key layouts (`format`, `convert`) and fusing
them into the weights (`fuse`).

The names below are imported on first use (`lazy_facade`), so that importing the package
imports none of its modules, and a JAX-free module among them loads without JAX.
"""

from lazy_facade import lazy_facade

_HOMES = (
    ("pipelines.wan.lora.convert", ("TRANSFORMER_PREFIX", "WAN_PREFIX", "musubi_to_wan", "normalize",
                                    "text_encoder_keys")),
    ("pipelines.wan.lora.format", ("LORA_ADAPTER_METADATA_KEY", "LORA_WEIGHT_NAME_SAFE", "LoraSource",
                                   "load_lora", "lora_digest", "lora_file", "read_lora")),
    ("pipelines.wan.lora.fuse", ("Adapter", "EXPERT_NAMES", "LoraLayer", "LoraWeights", "check_scale",
                                 "linear_layers", "parse_lora")),
)

__all__, __getattr__ = lazy_facade(__name__, _HOMES)
