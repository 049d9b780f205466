"""The Wan video transformer (diffusers' `WanTransformer3DModel`) in Flax NNX, sequence-parallel:
its config, layers, the text/image cross-attention K/V, where its tokens and weights live on a mesh,
weight quantization, and loading diffusers folders.

The names below are imported on first use (`lazy_facade`), so that importing the package
imports none of its modules, and a JAX-free module among them loads without JAX.
"""

from lazy_facade import lazy_facade

_HOMES = (
    ("pipelines.wan.transformer.config", ("PRESETS", "WanTransformerConfig", "param_counts", "param_shapes")),
    ("pipelines.wan.transformer.cross_kv", ("TextKV", "text_kv")),
    ("pipelines.wan.transformer.loading", ("checkpoint_layout", "load_transformer", "load_transformer_state",
                                           "to_ours")),
    ("pipelines.wan.transformer.original_names", ("diffusers_key", "wan_key", "wan_module")),
    ("pipelines.wan.transformer.model", ("WanTransformer", "build_transformer", "count_params", "forward",
                                         "init_transformer")),
    ("pipelines.wan.transformer.quantization", ("QUANTIZATION_MODES", "QUANTIZED_LINEARS", "check_quantization",
                                                "dense", "quantize_kernel", "quantize_transformer", "quantized_counts")),
    ("pipelines.wan.transformer.sequence_layout", ("SequenceLayout", "padded_tokens")),
    ("pipelines.wan.transformer.timesteps", ("TokenTimesteps", "select_levels")),
    ("pipelines.wan.transformer.weight_placement", ("large_leaf_shardings", "weight_shardings")),
)

__all__, __getattr__ = lazy_facade(__name__, _HOMES)
