"""Attention for Wan-style video transformers: dense reference, blockwise local attention with the
LSE and fixed-m paths, and 2D Unified Sequence Parallel attention over a (cfg, ring, ulysses) mesh
(`MeshSpec`: the one owner of the mesh)."""

from attention.blockwise import local_attention, merge_partials
from attention.fixed_m import GateResult, KeyStats, fixed_m_gate
from attention.mesh import (CFG_AXIS, MESH_AXES, RING_AXIS, SEQUENCE_SPEC, ULYSSES_AXIS, MeshSpec, make_mesh,
                            mesh_degrees, request_cpu_devices, sequence_spec)
from attention.reference import attention_reference
from attention.settings import BACKENDS, IMPLEMENTATIONS, BlockSizes, resolve_backend
from attention.usp import check_heads, cross_attention, usp_attention, workable_degrees

__all__ = [
    "BACKENDS", "CFG_AXIS", "IMPLEMENTATIONS", "BlockSizes", "GateResult", "KeyStats", "MESH_AXES", "MeshSpec", "RING_AXIS",
    "SEQUENCE_SPEC", "ULYSSES_AXIS", "request_cpu_devices", "sequence_spec",
    "attention_reference", "check_heads", "cross_attention", "fixed_m_gate", "local_attention",
    "make_mesh", "merge_partials", "mesh_degrees", "resolve_backend", "usp_attention", "workable_degrees",
]
