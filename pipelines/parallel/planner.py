"""Which mesh to run a Wan model on: every valid (CFG, U, R, weight sharding), what each costs, one pick.

For a transformer config and its parameter counts (`pipelines.wan.transformer.config.param_counts`,
passed in: this layer imports no model code), how its videos become tokens (`TokenFacts`), a video
size and a device count, `candidates`
enumerates the `MeshSpec`s that can run it (C in {1, 2} with guidance on, U dividing the heads,
C * R * U = the devices, weights replicated or sharded) and models one denoising step of each:

- memory per device (bytes): transformer weights (replicated: all of them; sharded: the block
  weights / devices, plus the rest, plus two layers gathered at a time; quantized block kernels
  at one byte a value plus their fp32 scales) and activations (the
  residual stream and one block's intermediates for this device's rows and tokens: rows/C x T/(R*U)
  x (10 D + 2 ffn) values, the Ulysses-gathered q/k/v and the ring's two K/V buffers; a VACE
  model's V hints, one stream each, held from the VACE scan to the main one) and the
  cross-attention K/V held for the run (`estimate.held_kv_bytes`: text, and image for Wan 2.1 I2V,
  [Z, rows/C, L (+ P), N, H] x 2, replicated over the sequence devices). The text
  encoder runs before the denoising loop and the VAE after it, so neither is counted. This is an
  estimate and says so; `end_to_end.bench.pipeline --aot` gives XLA's own numbers for a TPU topology;
- collective bytes per device per step, by kind: Ulysses all-to-alls (q/k/v out, the output back:
  (U-1)/U of 4 activations per block, VACE blocks included), ring permutes (R-1 K/V buffers per
  block), the CFG exchange
  (one noise prediction), weight all-gathers ((devices-1)/devices of each layer's weights);
- FLOPs per device (`estimate.step_flops` / devices);
- with context windows (`windows`): each forward one window's tokens, ceil(n / W) rounds of W
  windows (one per (cfg, windows) device group; W = 1: the windows one after another), the
  activations of one window, the all-to-alls and permutes once a round, plus one all-reduce of the
  whole video's prediction over W;
- a modelled step time: FLOPs at the chip's dense peak plus collective bytes at its per-device
  link bandwidth, with no overlap (so an upper bound of the model; real runs overlap some of it).

The recommendation is the fitting candidate with the smallest modelled step time (ties: weights
replicated, then the larger U). Chip numbers are the vendors' published specifications (`CHIPS`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from attention.mesh import MeshSpec, heads_fit
from pipelines.parallel import estimate as step_estimate
from pipelines.parallel.token_facts import TokenFacts

GiB = 2 ** 30
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
# Headroom left for XLA's own buffers, fragmentation and the runtime.
FIT_FRACTION = 0.9


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator: memory, dense bf16 peak, and per-device interconnect bandwidth (one direction).

  Attributes:
    name: for reports.
    memory_bytes: HBM per device.
    peak_flops: dense bf16 FLOP/s (fp32 runs are modelled at a quarter).
    link_bytes_per_s: bandwidth of one device into its interconnect (ICI / NVLink), one direction.
    source: where the numbers come from.
  """
  name: str
  memory_bytes: float
  peak_flops: float
  link_bytes_per_s: float
  source: str


CHIPS = {
    "v5e": Chip("TPU v5e", 16 * GiB, 197e12, 200e9, "cloud.google.com TPU v5e: 16 GiB HBM2, 197 TFLOP/s bf16, "
                "1600 Gbps ICI per chip"),
    "v6e": Chip("TPU v6e", 32 * GiB, 918e12, 448e9, "cloud.google.com TPU v6e: 32 GiB HBM, 918 TFLOP/s bf16, "
                "3584 Gbps ICI per chip"),
    "h100": Chip("NVIDIA H100 SXM", 80e9, 989e12, 450e9, "nvidia.com H100 SXM: 80 GB, 989 TFLOP/s dense bf16, "
                 "NVLink 900 GB/s (450 GB/s each way)"),
    "h200": Chip("NVIDIA H200 SXM", 141e9, 989e12, 450e9, "nvidia.com H200 SXM: 141 GB, 989 TFLOP/s dense bf16, "
                 "NVLink 900 GB/s (450 GB/s each way)"),
}


def chip_of(device_kind: str) -> Chip | None:
  """The `CHIPS` entry of JAX's `Device.device_kind` (e.g. "TPU v5 lite" -> v5e), or None."""
  kind = device_kind.lower()
  return next((CHIPS[name] for name, words in (("v6e", ("v6",)), ("v5e", ("v5 lite", "v5e")),
                                               ("h200", ("h200",)), ("h100", ("h100",)))
               if any(w in kind for w in words)), None)


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One mesh and its modelled cost (module docstring).

  Attributes:
    mesh: the `MeshSpec`.
    bytes_per_device: estimated peak memory of one denoising step per device.
    weight_bytes, activation_bytes, kv_bytes: its three parts (kv: the cross-attention K/V held for
      the run, `estimate.held_kv_bytes`).
    collective_bytes: per device per step, by kind ("all_to_all", "ring_permute", "cfg_exchange",
      "weight_all_gather").
    flops_per_device: per step.
    step_s_model: modelled step time (seconds).
    fits: bytes_per_device <= FIT_FRACTION x the chip's memory.
    memory: "estimate" (this module's model) or "xla" (`end_to_end.plan --topology`: XLA's memory
      analysis of the step compiled for a TPU topology; then `weight_bytes` / `activation_bytes`
      remain the estimate's split).
    memory_note: for "xla", the compile time or why the candidate did not compile.
  """
  mesh: MeshSpec
  bytes_per_device: float
  weight_bytes: float
  activation_bytes: float
  collective_bytes: dict[str, float]
  flops_per_device: float
  step_s_model: float
  fits: bool
  memory: str = "estimate"
  memory_note: str = ""
  kv_bytes: float = 0.0

  def to_dict(self) -> dict[str, Any]:
    return {"mesh": str(self.mesh), "shard_weights": self.mesh.shard_weights, "fits": self.fits,
            "bytes_per_device": None if math.isnan(self.bytes_per_device) else self.bytes_per_device, "weight_bytes": self.weight_bytes,
            "activation_bytes": self.activation_bytes, "kv_bytes": self.kv_bytes,
            "collective_bytes": dict(self.collective_bytes),
            "flops_per_device": self.flops_per_device, "step_s_model": self.step_s_model,
            "memory": self.memory, "memory_note": self.memory_note}


def candidates(config, token_facts: TokenFacts, *, param_counts: tuple[int, int], devices: int, frames: int,
               height: int, width: int, cfg: bool = True, dtype: str = "bfloat16", experts: int = 1,
               chip: Chip, quantized: tuple[int, int] = (0, 0), windows: tuple[int, int] | None = None
               ) -> list[Candidate]:
  """Every valid mesh for this model, video and device count, with its modelled cost.

  Args:
    config: the `WanTransformerConfig` (its shape fields: dim, heads, layers, ffn).
    token_facts: how its videos become tokens, and L (`TokenFacts`: VAE, patch, image and text tokens).
    param_counts: (block, other) parameters of one transformer (`transformer.param_counts`).
    devices, frames, height, width: devices in the mesh; the video's size.
    cfg: classifier-free guidance on (2 rows per step; CFG=2 meshes only then).
    dtype: the transformer's dtype.
    experts: transformers resident (2 for Wan 2.2 A14B).
    chip: the accelerator (`CHIPS`).
    quantized: (one-byte block values, fp32 scales) of int8 / fp8 weights (`wan.transformer.quantization`).
    windows: None (one clip of `frames`), or context windows as (a window's video frames, the
      windows' count n): each forward sees one window's tokens, and meshes with W in 2..n groups run
      ceil(n / W) rounds of W windows (their padding slots cost as windows), plus one all-reduce of
      the video's prediction a step.

  Raises:
    ValueError: devices < 1, bad counts, or no valid mesh (heads no divisor of the devices splits).
  """
  if devices < 1:
    raise ValueError(f"devices={devices} must be >= 1")
  size = DTYPE_BYTES[dtype]
  block_bytes = _block_bytes(_check_counts(param_counts)[0], size, quantized)
  forward_frames, count = (frames, 1) if windows is None else windows
  tokens = token_facts.video_tokens(forward_frames, height, width)
  rows = 2 if cfg else 1
  facts = dict(block_bytes=block_bytes, other_bytes=param_counts[1] * size, size=size, tokens=tokens, rows=rows,
               flops=step_estimate.step_flops(config, tokens, token_facts.text_tokens, rows),
               latent_bytes=4 * token_facts.latent_channels * math.prod(token_facts.latent_grid(frames, height, width)),
               kv=lambda rows_local: step_estimate.held_kv_bytes(config, token_facts, rows=rows_local, dtype_bytes=size))
  out = [_candidate(config, spec, devices, experts, chip, dtype, count, **facts)
         for spec in _meshes(devices, config.num_attention_heads, cfg, max_windows=count)]
  if not out:
    raise ValueError(f"no mesh of {devices} devices splits the model's {config.num_attention_heads} heads")
  return out


def _candidate(config, spec: MeshSpec, devices: int, experts: int, chip: Chip, dtype: str, count: int, *,
               block_bytes: int, other_bytes: int, size: int, tokens: int, rows: int, flops: float,
               latent_bytes: int, kv: Any) -> Candidate:
  """One mesh's modelled cost (`candidates`; count: the forwards a step runs, `rounds` of W)."""
  c, u, r, w, shard = spec.cfg, spec.ulysses, spec.ring, spec.windows, spec.shard_weights
  d, rounds = config.dim, -(-count // w)
  blocks_run = step_estimate.forward_blocks(config)  # a VACE model's VACE blocks too
  rows_local = rows // c
  t_local = -(-tokens // spec.sequence_devices)  # tokens per device: T over the R * U sequence devices
  stream = rows_local * t_local * d * size  # one [rows, T_local, D] activation
  activations = (rows_local * t_local * (10 * d + 2 * config.ffn_dim) * size  # one block's temps
                 + 3 * stream  # q/k/v gathered over Ulysses (T_g = U T_local, D/U heads)
                 + (2 * 2 * stream if r > 1 else 0)  # ring: K/V buffer and the one in flight
                 + len(config.vace_layers or ()) * stream)  # VACE: every VACE block's hint, held at once
  per_layer = block_bytes / blocks_run
  weights = ((block_bytes / devices + 2 * per_layer) if shard else block_bytes) * experts + other_bytes * experts
  comm = {
      "all_to_all": rounds * blocks_run * 4 * stream * (u - 1) / u,
      "ring_permute": rounds * blocks_run * (r - 1) * 2 * stream,
      "cfg_exchange": latent_bytes if c == 2 else 0.0,
      "weight_all_gather": rounds * (block_bytes * (devices - 1) / devices) if shard else 0.0,
      "windows_all_reduce": 2 * latent_bytes if w > 1 else 0.0,
  }
  flops_device = rounds * w * flops / devices  # each (cfg, windows) group: one window's forward a round
  peak = chip.peak_flops if dtype == "bfloat16" else chip.peak_flops / 4
  step_s = flops_device / peak + sum(comm.values()) / chip.link_bytes_per_s
  kv_bytes = kv(rows_local)
  total = weights + activations + kv_bytes
  return Candidate(spec, total, weights, activations, comm, flops_device, step_s,
                   total <= FIT_FRACTION * chip.memory_bytes, kv_bytes=kv_bytes)


def _check_counts(param_counts: tuple[int, int]) -> tuple[int, int]:
  """(block, other) parameter counts, checked (`candidates`' `param_counts`)."""
  blocks, other = param_counts
  if not (isinstance(blocks, int) and isinstance(other, int) and blocks >= 1 and other >= 0):
    raise ValueError(f"param_counts={param_counts!r} must be (block parameters >= 1, other parameters >= 0)")
  return blocks, other


def _block_bytes(blocks: int, size: int, quantized: tuple[int, int]) -> int:
  """Bytes of one transformer's block weights: `size` a parameter, one byte a quantized value,
  four a scale (`candidates`' `quantized`)."""
  one_byte, scales = quantized
  if not 0 <= one_byte <= blocks or scales < 0:
    raise ValueError(f"quantized={quantized!r} must be (0..{blocks} one-byte block parameters, scales >= 0)")
  return (blocks - one_byte) * size + one_byte + 4 * scales


def _meshes(devices: int, heads: int, cfg: bool, max_windows: int = 1):
  """Every valid `MeshSpec` of `devices`: C in {1, 2} (2 only with guidance and an even count), W
  from 1 to `max_windows` (the context windows' count), U dividing the heads, C * W * R * U =
  devices, weights replicated or (with several devices) sharded."""
  for c in ((1, 2) if cfg and devices % 2 == 0 else (1,)):
    for w in (w for w in range(1, min(max_windows, devices // c) + 1) if devices // c % w == 0):
      seq = devices // c // w
      for u in (u for u in range(1, seq + 1) if seq % u == 0 and heads_fit(u, heads, heads)):
        for shard in ((False, True) if devices > 1 else (False,)):
          yield MeshSpec(ulysses=u, ring=seq // u, cfg=c, windows=w, shard_weights=shard)


def recommend(found: list[Candidate]) -> Candidate | None:
  """The fitting candidate with the smallest modelled step (ties: weights replicated, larger U);
  None when nothing fits."""
  fitting = [c for c in found if c.fits]
  if not fitting:
    return None
  return min(fitting, key=lambda c: (round(c.step_s_model, 9), c.mesh.shard_weights, -c.mesh.ulysses))
