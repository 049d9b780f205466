"""Fused producers of attention-core and block inputs (issue 4), each with a `*_reference` twin.

- `wan_rope_table`: Wan's 3D RoPE half-table for a token grid or one sequence shard of it.
- `rmsnorm_rope`: q/k RMSNorm across heads + Wan RoPE (+ optional pre-scale), [B, T, D] -> [B, T, N, H].
- `layernorm_adaln`: LayerNorm (no affine) + AdaLN `x * (1 + scale) + shift`.
- `layer_norm`: fp32 LayerNorm with affine weight/bias (Wan's cross-attention norm2).
"""

from producers.block_input import layer_norm, layernorm_adaln, layernorm_adaln_reference
from producers.query_key import rmsnorm_rope, rmsnorm_rope_reference
from producers.rope import rope_axis_dims, wan_rope_table, wan_rope_table_reference

__all__ = [
    "layer_norm",
    "layernorm_adaln",
    "layernorm_adaln_reference",
    "rmsnorm_rope",
    "rmsnorm_rope_reference",
    "rope_axis_dims",
    "wan_rope_table",
    "wan_rope_table_reference",
]
