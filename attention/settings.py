"""The attention settings every path shares: the kernels' block sizes, the backends, the paths.

`BlockSizes` (static, hashable) and its measured or seeded defaults per (backend, platform), the
platform being a TPU generation where one has its own entry (`platform_key`),
`resolve_backend` ("auto" -> "pallas" on TPU / GPU, "xla" elsewhere) and the implementation names
("auto" | "fixed_m" | "lse", DESIGN.md section 4). No compute, and no JAX until a default is asked
for without naming the platform; the `attention` package names its public names.
"""

from __future__ import annotations

import dataclasses

IMPLEMENTATIONS = ("auto", "fixed_m", "lse")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tunables of the blockwise kernels (static; hashable).

  Attributes:
    block_q: query rows per block (XLA: outer `lax.map`; Pallas: the grid's query axis). Bounds the
      live logits to [B, N, block_q, block_kv].
    block_kv: keys per block (XLA: inner `lax.scan`; Pallas: the key loop).
    block_kv_compute: None (the whole block at once) or keys per chunk of the TPU kernel's key
      block, a multiple of 128 dividing block_kv: each block's logits, probabilities and P V are
      computed that many keys at a time (splash attention's `block_kv_compute`); XLA and the GPU
      kernel ignore it.
  The Pallas kernels need multiples of 128 (TPU lanes) and, on GPU, powers of two.
  `get_default(backend, platform)` gives the measured (CPU / XLA) or seeded (Pallas) defaults,
  `DEFAULT_BLOCKS`; `python -m end_to_end.bench.tune_blocks` measures a grid and prints the winners.
  """

  block_q: int = 1024
  block_kv: int = 512
  block_kv_compute: int | None = None

  def __post_init__(self):
    for name in ("block_q", "block_kv", "block_kv_compute"):
      val = getattr(self, name)
      if name == "block_kv_compute" and val is None:
        continue
      if not isinstance(val, int) or val <= 0:
        raise ValueError(f"BlockSizes.{name} must be a positive int, got {name}={val!r}")
    if self.block_kv_compute is not None and self.block_kv % self.block_kv_compute:
      raise ValueError(f"BlockSizes.block_kv_compute={self.block_kv_compute} must divide block_kv={self.block_kv}")

  @classmethod
  def get_default(cls, backend: str = "xla", platform: str | None = None,
                  device_kind: str | None = None) -> "BlockSizes":
    """The default blocks for `backend` ("xla" | "pallas") on `platform` ("cpu" | "tpu" | "gpu",
    or "cuda" / "rocm") of device kind `device_kind` (JAX's `Device.device_kind`, e.g. "TPU v5
    lite"; AOT topology devices have one too). None for both: JAX's default backend and its first
    device. The first entry of `DEFAULT_BLOCKS` found, in the order (backend, "tpu-v5e") (the
    generation's, `platform_key`), (backend, "tpu"), (backend, "cpu").
    """
    if platform is None:
      import jax  # noqa: PLC0415 (only a default for "this process's devices" starts JAX)

      platform, device_kind = jax.default_backend(), jax.devices()[0].device_kind
    key = platform_key(platform, device_kind)
    base = key.split("-")[0]
    for candidate in (key, base, "cpu"):
      if (backend, candidate) in DEFAULT_BLOCKS:
        return DEFAULT_BLOCKS[(backend, candidate)]
    raise ValueError(f"no default block sizes for {backend=}; expected one of "
                     f"{sorted({b for b, _ in DEFAULT_BLOCKS})}")


# JAX's TPU device kinds (real chips and AOT topologies report the same names; jax's own table:
# jax/_src/pallas/mosaic/tpu_info.py `chip_version_from_device_kind`) -> the generation that keys
# its own DEFAULT_BLOCKS entries. Other TPUs (v4, v5p, TPU7x, ...) use the plain "tpu" entry.
TPU_GENERATIONS = {"TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


def platform_key(platform: str, device_kind: str | None = None) -> str:
  """The platform part of a `DEFAULT_BLOCKS` key: "tpu-v5e" / "tpu-v6e" for a TPU whose device kind
  is in `TPU_GENERATIONS`, "gpu" for "cuda" / "rocm", else `platform` as given ("tpu", "cpu").

  E.g. platform_key("tpu", "TPU v6 lite") == "tpu-v6e"; platform_key("tpu", "TPU v4") == "tpu".
  """
  platform = "gpu" if platform in ("cuda", "rocm") else platform
  generation = TPU_GENERATIONS.get(device_kind) if platform == "tpu" else None
  return f"tpu-{generation}" if generation else platform


# (backend, platform) -> defaults. XLA on CPU: measured at T = S = 4096, N = 12, H = 128 on 2 cores
# (end_to_end/bench/attention.py). Pallas: TPU (other than v5e / v6e) the splash-attention-like
# 512 x 1024 (VMEM per step ~ bq*bk*4 B of logits + double-buffered K/V tiles, inside v5e's 16 MiB
# scoped VMEM); GPU the 128 x 128 tile of jax's Pallas GPU flash attention family; the CPU entry
# is interpret mode (tests), small so that padding stays cheap.
# TPU v5e: 4096 x 1024, timed on the chip (`bench.tune_blocks --backend pallas`, JAX 0.10.2, bf16,
# one chip, 2026-12-06; docs/measurements/attention.md "Block sizes per TPU generation"), fixed-m ms:
#   [1, 32768, 12, 128] (1.3B 480p):  4096x2048 36.21, 4096x1024 36.61, 2048x1024 37.34, 1024x1024 38.56
#   [1, 27280, 24, 128] (TI2V-5B 720p): 4096x1024 57.61, 2048x1024 58.55, 1024x1024 58.59, 4096x2048 59.00
# 4096 x 1024 is within 1% of the best at both one-chip shapes (5% and 1.7% faster than 1024 x 1024);
# its scoped VMEM (~30 MiB) is above XLA's 16 MiB default, raised by the kernel itself
# (`kernels.tpu_vmem_limit`). Its 4096-row query blocks pad 14B's 37,800 per-device tokens (U=4,R=2)
# to 40,960 (+8.4% against 37,888 for 1024): pass `BlockSizes` there until that shape is timed.
# With key chunks (`block_kv_compute`, timed 2026-12-07 at [1, 32768, 12, 128], fixed-m with its gate):
# 4096 x 2048 in 512-key chunks 36.59 ms against 4096 x 1024's 37.43 (2.3 % faster, no padded key
# block); at [2, 75600, 5, 128] 173.16 against 165.63 ms, before the padded block masked only its
# chunks past S. Timed again 2026-12-08 at [2, 75600, 5, 128] (`bench.attention`, splash in the same
# run): 4096 x 2048 x 512 173.23 ms, 2048 x 2048 x 512 158.93 (splash's best 170.57). The default keeps
# 4096 x 1024 until 2048 x 2048 x 512 is timed against it at 32,760 too (docs/performance.md).
# TPU v6e: 1024 x 1024, picked from compiles only (`bench.tune_blocks --topology v6e:2x2`, then
# `--pick`; libtpu 0.0.42) at the per-device shapes of Wan 1.3B 480p (U=4: [2, 32760, 3, 128];
# U=2,R=2: [2, 16380, 6, 128]) and 14B 720p (U=4,R=2: [2, 37800, 10, 128]), bf16, grid 256..2048
# squared: it compiles at every shape, pads 37,800 tokens by 0.5% (2048-blocks: 3.2% per axis), and
# its code is within 1.19x of each shape's least, with the most work per grid step among those.
DEFAULT_BLOCKS = {
    ("xla", "cpu"): BlockSizes(1024, 512),
    ("pallas", "cpu"): BlockSizes(128, 128),
    ("pallas", "tpu"): BlockSizes(512, 1024),
    ("pallas", "tpu-v5e"): BlockSizes(4096, 1024),
    ("pallas", "tpu-v6e"): BlockSizes(1024, 1024),
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
  if platform is None:
    import jax  # noqa: PLC0415 (see BlockSizes.get_default)

    platform = jax.default_backend()
  return "pallas" if platform in ("tpu", "gpu", "cuda", "rocm") else "xla"


def matmul_precision(dtype):
  """The `jax.lax.Precision` of the attention matmuls (XLA loops and kernels) for inputs of `dtype`:
  HIGHEST for fp32 (true fp32 matmuls: GPUs would otherwise use TF32, TPUs bf16 passes), DEFAULT
  (the native path) for bf16 / fp16."""
  import jax  # settings import no JAX until compute asks for it (module docstring)
  import jax.numpy as jnp

  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT
