"""Where one Wan transformer block's time goes on the device at hand, measured: the whole block, its
matmuls alone, its self-attention and cross-attention alone, and the rest (norms, modulation, RoPE,
the activation, residual adds, the copies around the attention kernels), each with TFLOP/s and the
chip's bf16 peak.

  python -m end_to_end.bench.block                      # Wan 2.1 1.3B, 480p x 81, CFG (2 rows), bf16
  python -m end_to_end.bench.block --preset wan2.1-t2v-14b --height 720 --width 1280 --layers 1,2

The block's time is the difference of two whole forwards (`transformer.forward`, random weights, one
device) with `--layers` blocks each, divided by the difference in blocks: embedding, head and
unpatchify cancel. The matmuls are a chain of bf16 [rows x T, D] products of the block's weight
shapes (self-attention q, k, v, o; cross-attention q, o; the FFN's two) plus the cross-attention's k
and v of the text; the attention is `attention.local_attention` as the block calls it (the plan's
implementation, "auto": the fixed-m gate and a cond between two kernels; the backend's default
blocks; q pre-scaled) at [rows, T, N, H], the cross-attention the same queries against [rows, text,
N, H] text K/V (`attention_parts`). The rest is what the block takes beyond the three. Times are
medians over --repeats calls after a warm-up (compile excluded), taken round-robin
(`bench.int8.time_median`) in two groups: the two forwards, then the matmuls and attentions, whose
operands are made once the forwards' weights are freed (a 14B block at 720p fits a 16-GB chip so).
Numbers for one chip in docs/performance.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from attention import local_attention
from end_to_end.bench.int8 import time_median
from pipelines.commands.help import HelpFormatter
from pipelines.parallel.plan import ParallelPlan
from pipelines.parallel.planner import chip_of
from pipelines.wan.transformer import PRESETS, forward, init_transformer


def weight_shapes(D: int, F: int) -> dict[str, tuple[int, int]]:
  """The block's linear weights by name ([in, out]) for width D and FFN width F (`matmul_chain`)."""
  return dict(q=(D, D), k=(D, D), v=(D, D), o=(D, D), cross_q=(D, D), cross_o=(D, D), cross_k=(D, D),
              cross_v=(D, D), ffn_in=(D, F), ffn_out=(F, D))


def matmul_chain(x: jax.Array, text: jax.Array, w: dict) -> tuple[jax.Array, jax.Array]:
  """The block's linear layers in sequence: x [M, D] through q, k, v, o, cross_q, cross_o and the
  FFN ([M, D] out), text [Mt, D] through cross_k and cross_v ([Mt, D] out, their sum); `w` the
  weights by name ([D, D], ffn_in [D, F], ffn_out [F, D]), all one dtype."""
  h = x
  for name in ("q", "k", "v", "o", "cross_q", "cross_o"):
    h = (h @ w[name]).astype(x.dtype)
  h = (jax.nn.gelu((h @ w["ffn_in"]).astype(x.dtype)) @ w["ffn_out"]).astype(x.dtype)
  kv = (text @ w["cross_k"]).astype(x.dtype) + (text @ w["cross_v"]).astype(x.dtype)
  return h, kv


def matmul_flops(rows: int, tokens: int, text_len: int, D: int, F: int) -> float:
  """`matmul_chain`'s FLOPs (2 M K N a product) for `rows` x `tokens` video and `text_len` text rows."""
  return 2.0 * rows * (tokens * (6 * D * D + 2 * D * F) + text_len * 2 * D * D)


def parts(config, rows: int, frames: int, height: int, width: int, text_len: int, dtype, layers: tuple[int, int],
          repeats: int) -> dict:
  """{name: seconds} of the block, its matmuls and its attention, with the FLOPs of each.

  Raises: ValueError: a size that is not the VAE's (frames 4k + 1, height and width multiples of 16).
  """
  if (frames - 1) % 4 or height % 16 or width % 16:
    raise ValueError(f"frames={frames}, height={height}, width={width}: frames must be 4k + 1 and height, "
                     "width multiples of 16 (the VAE's 4x time and 8x space, the 2x2 patches)")
  latent_shape = (rows, config.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8)
  T = latent_shape[2] * (height // 16) * (width // 16)
  D, F, N, H = config.dim, config.ffn_dim, config.num_attention_heads, config.attention_head_dim
  plan = ParallelPlan.build(None, heads=config.num_attention_heads)
  rng = np.random.default_rng(0)
  # Two groups, each timed round-robin, the second's arrays made after the first's are freed (a 14B
  # block at 720p: the forwards' weights and the parts' operands together leave a 16-GB chip too
  # little room for a forward's temp).
  t = time_median(*forward_parts(config, plan, latent_shape, text_len, dtype, layers, rng), repeats)
  t |= time_median(*kernel_parts(plan, rows, T, text_len, D, F, N, H, dtype, rng), repeats)
  block = (t[layers[1]] - t[layers[0]]) / (layers[1] - layers[0])
  linear = matmul_flops(rows, T, text_len, D, F)
  self_attention, cross_attention = 4.0 * rows * N * T * T * H, 4.0 * rows * N * T * text_len * H
  return dict(tokens=T, block=block, matmuls=t["matmuls"], attention=t["attention"], cross=t["cross"],
              rest=block - t["matmuls"] - t["attention"] - t["cross"],
              flops=dict(block=linear + self_attention + cross_attention, matmuls=linear, attention=self_attention,
                         cross=cross_attention))


def forward_parts(config, plan, latent_shape, text_len: int, dtype, layers: tuple[int, int], rng) -> tuple[dict, dict]:
  """The two whole forwards (`transformer.forward`, random weights) with `layers` blocks each, keyed
  by their block counts: ({n: fn}, {n: args})."""
  rows = latent_shape[0]
  latents = jnp.asarray(rng.standard_normal(latent_shape, np.float32))
  text = jnp.asarray(rng.standard_normal((rows, text_len, config.text_dim), np.float32))
  step = jax.jit(lambda model, x, t, c: forward(model, x, t, c, plan=plan))
  timestep = jnp.full((rows,), 500.0, jnp.float32)
  fns, args = {}, {}
  for n in layers:  # whole forwards: the block is their difference
    fns[n] = step
    args[n] = (init_transformer(dataclasses.replace(config, num_layers=n), seed=0, dtype=dtype), latents, timestep,
               text)
  return fns, args


def kernel_parts(plan, rows: int, T: int, text_len: int, D: int, F: int, N: int, H: int, dtype,
                 rng) -> tuple[dict, dict]:
  """The block's matmuls ("matmuls", `matmul_chain` on [rows T, D]) and its two attentions
  (`attention_parts`): ({name: fn}, {name: args})."""
  fns, args = {}, {}
  w = {n: jnp.asarray(rng.standard_normal(s, np.float32) / np.sqrt(s[0]), dtype)
       for n, s in weight_shapes(D, F).items()}
  x = jnp.asarray(rng.standard_normal((rows * T, D), np.float32), dtype)
  text_d = jnp.asarray(rng.standard_normal((rows * text_len, D), np.float32), dtype)
  fns["matmuls"], args["matmuls"] = jax.jit(matmul_chain), (x, text_d, w)
  attention_parts(fns, args, rng, (rows, T, N, H), text_len, dtype, plan.attention_implementation)
  return fns, args


def attention_parts(fns: dict, args: dict, rng, shape: tuple[int, int, int, int], text_len: int, dtype,
                    implementation: str) -> None:
  """Adds the block's self-attention ("attention", q, k, v [B, T, N, H]) and cross-attention
  ("cross", the same q against [B, text_len, N, H] text K/V) to `fns` / `args`, as the block calls
  them: `implementation` (the plan's; "auto" runs the fixed-m gate and a cond between the two kernels),
  the backend's default blocks, q pre-scaled by H^-1/2 log2(e) as its RMSNorm producer writes it
  (unit-variance q / k, so the logits are unit-variance too and the gate passes, as in the model)."""
  B, T, N, H = shape
  draw = lambda *s, scale=1.0: jnp.asarray(rng.standard_normal(s, np.float32) * scale, dtype)  # noqa: E731
  q = draw(B, T, N, H, scale=H ** -0.5 * math.log2(math.e))
  attend = lambda q, k, v: local_attention(q, k, v, implementation=implementation, q_prescaled=True)  # noqa: E731
  fns["attention"], args["attention"] = jax.jit(attend), (q, draw(B, T, N, H), draw(B, T, N, H))
  fns["cross"], args["cross"] = jax.jit(attend), (q, draw(B, text_len, N, H), draw(B, text_len, N, H))


def report(result: dict, peak: float | None) -> str:
  """The parts as lines of ms, share of the block, TFLOP/s and fraction of `peak` (FLOP/s)."""
  lines = []
  for name in ("block", "matmuls", "attention", "cross", "rest"):
    sec, flops = result[name], result["flops"].get(name)
    line = f"  {name:10s} {sec * 1e3:9.2f} ms {sec / result['block']:6.1%} of the block"
    if flops and sec > 0:
      line += f"  {flops / sec / 1e12:7.1f} TFLOP/s" + (f" ({flops / sec / peak:.0%} of peak)" if peak else "")
    lines.append(line)
  return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m end_to_end.bench.block", description=__doc__,
                               formatter_class=HelpFormatter)
  ap.add_argument("--preset", default="wan2.1-t2v-1.3b", choices=sorted(PRESETS))
  ap.add_argument("--frames", type=int, default=81)
  ap.add_argument("--height", type=int, default=480)
  ap.add_argument("--width", type=int, default=832)
  ap.add_argument("--rows", type=int, default=2, help="batch rows (2: one video with CFG)")
  ap.add_argument("--text-len", type=int, default=512)
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  ap.add_argument("--layers", default="1,3", help="the two forwards' block counts, e.g. 1,3")
  ap.add_argument("--repeats", type=int, default=5)
  return ap


def main(argv=None) -> dict:
  ap = build_parser()
  args = ap.parse_args(argv)
  try:
    layers = tuple(int(n) for n in args.layers.split(","))
  except ValueError:
    layers = ()
  if len(layers) != 2 or not 1 <= layers[0] < layers[1]:
    ap.error(f"--layers {args.layers!r}: give two block counts, the first >= 1 and below the second, e.g. 1,3")
  config = PRESETS[args.preset]
  device = jax.devices()[0]
  try:
    result = parts(config, args.rows, args.frames, args.height, args.width, args.text_len, jnp.dtype(args.dtype),
                   layers, args.repeats)
  except ValueError as e:
    ap.error(str(e))
  chip = chip_of(device.device_kind)
  print(f"{args.preset} block, {args.rows} x {result['tokens']} tokens ({args.frames} x {args.height} x {args.width}),"
        f" text {args.text_len}, {args.dtype}; {device.device_kind}, JAX {jax.__version__}")
  print(report(result, chip.peak_flops if chip is not None and args.dtype == "bfloat16" else None))
  return result


if __name__ == "__main__":
  main()
