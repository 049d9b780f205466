"""The attention settings every path shares: the kernels' block sizes, the backends, the paths.

`BlockSizes` (static, hashable) and its measured or seeded defaults per (backend, platform),
`resolve_backend` ("auto" -> "pallas" on TPU / GPU, "xla" elsewhere) and the implementation names
("auto" | "fixed_m" | "lse", DESIGN.md section 4). No compute; re-exported by `attention.blockwise`
and `attention`.
"""

from __future__ import annotations

import dataclasses

import jax

IMPLEMENTATIONS = ("auto", "fixed_m", "lse")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tunables of the blockwise kernels (static; hashable).

  Attributes:
    block_q: query rows per block (XLA: outer `lax.map`; Pallas: the grid's query axis). Bounds the
      live logits to [B, N, block_q, block_kv].
    block_kv: keys per block (XLA: inner `lax.scan`; Pallas: the key loop).
  The Pallas kernels need multiples of 128 (TPU lanes) and, on GPU, powers of two.
  `get_default(backend, platform)` gives the measured (CPU / XLA) or seeded (Pallas) defaults,
  `DEFAULT_BLOCKS`; `python -m end_to_end.tune_blocks` measures a grid and prints the winners.
  """

  block_q: int = 1024
  block_kv: int = 512

  def __post_init__(self):
    for name in ("block_q", "block_kv"):
      val = getattr(self, name)
      if not isinstance(val, int) or val <= 0:
        raise ValueError(f"BlockSizes.{name} must be a positive int, got {name}={val!r}")

  @classmethod
  def get_default(cls, backend: str = "xla", platform: str | None = None) -> "BlockSizes":
    """The default blocks for `backend` ("xla" | "pallas") on `platform` ("cpu" | "tpu" | "gpu";
    None: JAX's default backend)."""
    platform = jax.default_backend() if platform is None else platform
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    return DEFAULT_BLOCKS.get((backend, platform), DEFAULT_BLOCKS[(backend, "cpu")])


# (backend, platform) -> defaults. XLA on CPU: measured at T = S = 4096, N = 12, H = 128 on 2 cores
# (end_to_end/bench_attention.py). Pallas: TPU the splash-attention-like 512 x 1024 (VMEM per step
# ~ bq*bk*4 B of logits + double-buffered K/V tiles, well inside v5e's 16 MiB scoped VMEM); GPU
# the 128 x 128 tile of jax's Pallas GPU flash attention family; the CPU entry is interpret mode
# (tests), small so that padding stays cheap. `end_to_end.tune_blocks` re-measures them.
DEFAULT_BLOCKS = {
    ("xla", "cpu"): BlockSizes(1024, 512),
    ("pallas", "cpu"): BlockSizes(128, 128),
    ("pallas", "tpu"): BlockSizes(512, 1024),
    ("pallas", "gpu"): BlockSizes(128, 128),
}

BACKENDS = ("auto", "xla", "pallas")


def resolve_backend(backend: str, platform: str | None = None) -> str:
  """"auto" -> "pallas" on TPU and GPU, "xla" elsewhere; "xla" / "pallas" as given.

  Args:
    platform: the platform the program is compiled for (None: JAX's default backend). AOT
      compiles for a TPU topology from a CPU host pass "tpu".

  Raises:
    ValueError: an unknown backend.
  """
  if backend not in BACKENDS:
    raise ValueError(f"unknown attention {backend=}; expected one of {BACKENDS}")
  if backend != "auto":
    return backend
  platform = jax.default_backend() if platform is None else platform
  return "pallas" if platform in ("tpu", "gpu", "cuda", "rocm") else "xla"
