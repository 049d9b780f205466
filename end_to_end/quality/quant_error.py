r"""Where the quantization error comes from: the transformer's one-step noise-prediction error.

  python -m end_to_end.quality.quant_error                          # the trained tiny default, seeds 0, 1
  python -m end_to_end.quality.quant_error --seeds 0,1,2,3 --json quant_error.json
  python -m end_to_end.quality.quant_error --keep ffn.proj_in,ffn.proj_out,attn1.to_v   # + rows with those in bf16

The end-to-end PSNR of `end_to_end.quality.check` is a poor instrument for small weight errors: a video
is a chaotic function of its rounding, so any change of the bf16 rounding pattern (a weight moved
by 2^-12 of itself, 8x below bf16's own rounding) moves one seed's PSNR by up to 8 dB and the mean
of eight seeds by up to 2.4 dB. This tool measures the error where it is made instead: the
transformer's noise prediction eps on the inputs the fp32 reference meets, one step at a time, so
errors do not compound and nothing is drawn.

Inputs: the trained tiny default (`WanPipeline.tiny()`, its own settings: "a red square moving
right", 64x64, 17 frames, 8 steps, guidance 5, negative prompt "") run in float32 from each seed's
latents; every step's input latents and timestep, with the prompt's and the negative prompt's
text states (float32, shared by every candidate: only the transformer differs).

Error of a candidate transformer (a dtype, a mode of `pipelines.wan.transformer.QUANTIZATION_MODES`, the
block Linear layers it quantizes), relative RMS over every input, both CFG branches:
  e = sqrt(sum |eps - eps_ref|^2 / sum |eps_ref|^2),  eps_ref: the float32 checkpoint, unquantized.
The kernels are quantized from the fp32 checkpoint as `WanPipeline.from_pretrained(...,
quantize=...)` does. Rows: bfloat16 unquantized (the error every bf16 setting starts from); each
mode x {float32, bfloat16} with every layer quantized; each layer alone, float32 (only its weight
error shows); with `--keep`, int8 and fp8 in bfloat16 with the named layers unquantized. For a
bfloat16 row, `vs bf16` = 20 log10(e / e_bf16): measured to predict the mean
end-to-end PSNR cost over seeds (int8: +2.2 dB predicted; over 8 seeds 2.3 dB below the mean of four
resampled bf16 runs, docs/measurements/quantization.md).
Uncorrelated errors add in power: e^2 (all layers) ~ sum of the layers' e^2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from pipelines.commands.help import HelpFormatter
from pipelines.storage.video_io import write_json

SETTINGS = dict(prompt="a red square moving right", height=64, width=64, num_frames=17,
                num_inference_steps=8, guidance_scale=5.0, max_sequence_length=64)
ALONE_MODES = ("int8", "fp8")


def step_inputs(pipe: Any, seeds: list[int], steps: int) -> list[tuple[np.ndarray, float]]:
  """(latents float32 [1, C, F, Hl, Wl], timestep) of every step of `pipe`'s float32 runs from
  each seed's initial latents (the pipeline's rule: standard normal from `default_rng(seed)`)."""
  settings = dict(SETTINGS, num_inference_steps=steps)
  inputs = []
  for seed in seeds:
    latents = np.random.default_rng(seed).standard_normal(
        pipe.latent_shape(1, settings["height"], settings["width"], settings["num_frames"]), np.float32)
    seen: list[tuple[np.ndarray, float]] = []

    def record(_pipe, _index, t, kwargs, seen=seen):
      seen.append((np.asarray(kwargs["latents"], np.float32), float(np.asarray(t).reshape(-1)[0])))
      return kwargs
    pipe.run(latents=latents, callback_on_step_end=record, decode=False, progress=False, **settings)
    before = [latents] + [lat for lat, _ in seen[:-1]]  # each step's input: the previous step's output
    inputs += [(lat, t) for lat, (_, t) in zip(before, seen)]
  return inputs


def candidate(config: Any, params: dict[str, Any], dtype: str, mode: str | None,
              layers: tuple[tuple[str, str], ...]) -> Any:
  """A `WanTransformer` of `dtype` from the fp32 `params` with `layers` (paths under `blocks`)
  quantized to `mode` (`quantize_kernel`; w8a8 also quantizes their inputs)."""
  import jax
  import jax.numpy as jnp

  from pipelines.wan.transformer import build_transformer, quantize_kernel

  params = jax.tree.map(lambda a: a, params)  # a new tree: the fp32 one is kept whole
  for path in layers if mode else ():
    layer = params["blocks"]
    for name in path:
      layer = layer[name]
    layer["kernel"] = quantize_kernel(layer["kernel"], mode)
  model = build_transformer(config, params, jnp.dtype(dtype))
  for path in layers if mode == "int8-w8a8" else ():
    layer = model.blocks
    for name in path:
      layer = getattr(layer, name)
    layer.int8_activations = True
  return model


def default_plan(keep: tuple[tuple[str, str], ...] = ()) -> list[tuple[str, str | None, str, tuple]]:
  """The module docstring's rows as (dtype, mode, label, layers); the first is bfloat16 unquantized.
  With `keep` (paths under `blocks`), also int8 and fp8 in bfloat16 with those layers unquantized."""
  from pipelines.wan.transformer import QUANTIZATION_MODES, QUANTIZED_LINEARS

  every = QUANTIZED_LINEARS
  plan = [("bfloat16", None, "all", every)]
  plan += [(dtype, mode, "all", every) for mode in QUANTIZATION_MODES for dtype in ("float32", "bfloat16")]
  rest = tuple(path for path in every if path not in keep)
  plan += [("bfloat16", mode, "all but --keep", rest) for mode in ALONE_MODES if keep]
  return plan + [("float32", mode, ".".join(path), (path,)) for mode in ALONE_MODES for path in every]


def parse_keep(text: str | None) -> tuple[tuple[str, str], ...]:
  """'ffn.proj_in,attn1.to_v' -> (("ffn", "proj_in"), ("attn1", "to_v")); None -> ().

  Raises:
    ValueError: a name that is not one of `QUANTIZED_LINEARS`, naming the choices.
  """
  from pipelines.wan.transformer import QUANTIZED_LINEARS

  names = {".".join(path): path for path in QUANTIZED_LINEARS}
  keep = tuple(name.strip() for name in (text or "").split(",") if name.strip())
  bad = [name for name in keep if name not in names]
  if bad:
    raise ValueError(f"--keep {text!r}: {', '.join(bad)} not among the quantized layers {', '.join(names)}")
  return tuple(names[name] for name in keep)


def measure(pipe: Any, seeds: list[int], steps: int, plan: list | None = None) -> list[dict[str, Any]]:
  """Rows of dtype, mode, layers ('all' or one path) and rel_rms, one per `plan` entry (default:
  `default_plan`); when the first row is bfloat16 unquantized, every bfloat16 row gets vs_bf16_db."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from pipelines.wan.pretrained import TINY_DEFAULT_FOLDER
  from pipelines.wan.transformer import forward, load_transformer

  fp32 = load_transformer(f"{TINY_DEFAULT_FOLDER}/transformer")
  params = nnx.to_pure_dict(nnx.state(fp32, nnx.Param))
  text = jnp.asarray(pipe.encode_prompts([SETTINGS["prompt"], ""], SETTINGS["max_sequence_length"]), jnp.float32)
  inputs = step_inputs(pipe, seeds, steps)
  predict = nnx.jit(lambda model, lat, t: forward(model, jnp.concatenate([lat, lat]), jnp.stack([t, t]), text))

  def eps(model):
    return [np.asarray(predict(model, jnp.asarray(lat), jnp.float32(t)), np.float64) for lat, t in inputs]

  reference = eps(fp32)
  norm = sum(float(np.sum(r ** 2)) for r in reference)
  rows = []
  for dtype, mode, label, layers in plan or default_plan():
    got = eps(candidate(fp32.config, params, dtype, mode, layers))
    error = float(np.sqrt(sum(float(np.sum((g - r) ** 2)) for g, r in zip(got, reference)) / norm))
    rows.append(dict(dtype=dtype, mode=mode, layers=label, rel_rms=error))
    jax.clear_caches()  # each candidate compiles its own forward
  if (rows[0]["dtype"], rows[0]["mode"]) != ("bfloat16", None):
    return rows
  bf16 = rows[0]["rel_rms"]
  for row in rows:
    if row["dtype"] == "bfloat16":
      row["vs_bf16_db"] = 20 * float(np.log10(row["rel_rms"] / bf16))
  return rows


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m end_to_end.quality.quant_error", description=__doc__,
                               formatter_class=HelpFormatter)
  ap.add_argument("--seeds", default="0,1", help="comma-separated seeds of the reference runs' initial latents")
  ap.add_argument("--steps", type=int, default=SETTINGS["num_inference_steps"], help="denoising steps")
  ap.add_argument("--keep", help="comma-separated layers (e.g. ffn.proj_in,ffn.proj_out,attn1.to_v) to leave "
                                  "unquantized in two extra rows, int8 and fp8 in bfloat16")
  ap.add_argument("--json", help="write the rows here")
  args = ap.parse_args(argv)
  try:
    seeds = [int(s) for s in args.seeds.split(",")]
  except ValueError:
    ap.error(f"--seeds {args.seeds!r}: write comma-separated integers such as 0,1,2")
  if args.steps < 1:
    ap.error(f"--steps {args.steps} must be positive")
  try:
    keep = parse_keep(args.keep)
  except ValueError as e:
    ap.error(str(e))
  from pipelines.pipeline.wan_pipeline import WanPipeline

  rows = measure(WanPipeline.tiny("float32"), seeds, args.steps, default_plan(keep))
  print(f"one-step noise-prediction error vs the float32 checkpoint: seeds {seeds}, {args.steps} steps")
  print(f"{'dtype':9s} {'mode':10s} {'layers':16s} {'rel rms':>9s} {'dB':>7s} {'vs bf16':>8s}")
  for row in rows:
    vs = f"{row['vs_bf16_db']:+8.2f}" if "vs_bf16_db" in row else ""
    print(f"{row['dtype']:9s} {row['mode'] or 'none':10s} {row['layers']:16s} {row['rel_rms']:9.5f} "
          f"{20 * np.log10(row['rel_rms']):7.1f} {vs}")
  if args.json:
    write_json(dict(seeds=seeds, steps=args.steps, rows=rows), args.json, overwrite=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
