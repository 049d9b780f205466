"""Attention for Wan-style video transformers: dense reference, blockwise local attention with the
LSE and fixed-m paths, and 2D Unified Sequence Parallel attention over a (cfg, ring, ulysses) mesh,
or (cfg, windows, ring, ulysses) with a windows split (`MeshSpec`: the one owner of the mesh).

The names below are imported on first use (`lazy_facade`), so that `attention.mesh_spec` (the mesh
spec, parsed and checked by the command line before JAX starts) loads without importing JAX.
"""

from lazy_facade import lazy_facade

_HOMES = (
    ("attention.blockwise", ("local_attention",)),
    ("attention.carry", ("merge_partials",)),
    ("attention.fixed_m", ("GateResult", "KeyStats", "fixed_m_gate")),
    ("attention.mesh", ("CFG_AXIS", "MESH_AXES", "RING_AXIS", "SEQUENCE_SPEC", "ULYSSES_AXIS", "WINDOWS_AXIS",
                        "MeshSpec", "make_mesh", "mesh_degrees", "request_cpu_devices", "sequence_spec")),
    ("attention.reference", ("attention_reference",)),
    ("attention.settings", ("BACKENDS", "IMPLEMENTATIONS", "BlockSizes", "resolve_backend")),
    ("attention.usp", ("check_heads", "cross_attention", "usp_attention", "workable_degrees")),
)

__all__, __getattr__ = lazy_facade(__name__, _HOMES)
