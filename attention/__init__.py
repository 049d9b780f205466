"""Attention for Wan-style video transformers: dense reference, blockwise local attention with the
LSE and fixed-m paths, and 2D Unified Sequence Parallel attention over a (ring, ulysses) mesh."""

from attention.blockwise import BlockSizes, local_attention, merge_partials
from attention.fixed_m import GateResult, KeyStats, fixed_m_gate
from attention.mesh import RING_AXIS, SEQUENCE_SPEC, ULYSSES_AXIS, make_mesh
from attention.reference import attention_reference

__all__ = [
    "BlockSizes", "GateResult", "KeyStats", "RING_AXIS", "SEQUENCE_SPEC", "ULYSSES_AXIS",
    "attention_reference", "fixed_m_gate", "local_attention", "make_mesh", "merge_partials",
]
