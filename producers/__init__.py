"""Fused producers of attention-core and block inputs (issue 4), each with a `*_reference` twin.

- `wan_rope_table`: Wan's 3D RoPE half-table for a token grid or one sequence shard of it.
- `rmsnorm_rope`: q/k RMSNorm across heads + Wan RoPE (+ optional pre-scale), [B, T, D] -> [B, T, N, H].
- `layernorm_adaln`: LayerNorm (no affine) + AdaLN `x * (1 + scale) + shift`.
- `layer_norm`: fp32 LayerNorm with affine weight/bias (Wan's cross-attention norm2).

The names below are imported on first use (`lazy_facade`).
"""

from lazy_facade import lazy_facade

_HOMES = (
    ("producers.block_input", ("layer_norm", "layernorm_adaln", "layernorm_adaln_reference")),
    ("producers.query_key", ("rmsnorm_rope", "rmsnorm_rope_reference")),
    ("producers.rope", ("rope_axis_dims", "wan_rope_table", "wan_rope_table_reference")),
)

__all__, __getattr__ = lazy_facade(__name__, _HOMES)
