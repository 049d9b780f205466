"""How long loading a diffusers Wan folder takes, and how much host memory it needs: ours vs diffusers.

  python -m end_to_end.bench.load --preset 1.3b-width [--folder DIR] [--rounds 3] [--mesh U=2,R=2]
      [--shard-weights] [--json F]

Each load runs in a fresh Python process (so one load's memory cannot hide in another's), after
that process has imported its library (ours: `pipelines.pipeline` and transformers'
`AutoTokenizer`, which imports torch; theirs: diffusers, torch and transformers): the timed part is `from_pretrained`
only, with the weights on their devices when it returns (ours: `block_until_ready` on every
array). The folder is written once with `bench.presets.save_diffusers_pipeline` when `--folder` is
not given or empty, and read once before the first round so that both sides find it in the page
cache. Rounds alternate the order (ours first, then theirs first) so that drift of a noisy
machine falls on both sides. Per side: median load seconds and the peak of the process's
anonymous resident memory above its level before the load (`RssAnon` in /proc/self/status,
sampled every 2 ms), next to the folder's weight bytes (what a loader must at least hold on a CPU
"device"). Prints the table and the ratio ours / diffusers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, os, sys, threading, time

def rss_anon():
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("RssAnon:"):
        return int(line.split()[1]) * 1024
  return 0

side, folder, dtype, mesh, shard = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1"
if side == "ours":
  if mesh:
    from attention.mesh import MeshSpec, request_cpu_devices
    request_cpu_devices(MeshSpec.parse(mesh).devices)
  import jax
  import transformers
  transformers.AutoTokenizer  # the tokenizer's lazy import (it pulls in torch): diffusers' side has it
  from pipelines.pipeline import WanPipeline
  jax.numpy.zeros(1).block_until_ready()
  mesh_obj = mesh or None
else:
  import diffusers, torch, transformers
  torch.set_num_threads(os.cpu_count() or 1)

peak, stop = [0], [False]
def sample():
  while not stop[0]:
    peak[0] = max(peak[0], rss_anon())
    time.sleep(0.002)

base = rss_anon()
thread = threading.Thread(target=sample, daemon=True)
thread.start()
start = time.perf_counter()
if side == "ours":
  pipe = WanPipeline.from_pretrained(folder, dtype=dtype, mesh=mesh_obj, shard_weights=shard)
  jax.block_until_ready((pipe._experts, pipe._text_params, pipe.vae))
else:
  torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  vae = diffusers.AutoencoderKLWan.from_pretrained(folder, subfolder="vae", torch_dtype=torch.float32)
  pipe = diffusers.WanPipeline.from_pretrained(folder, vae=vae, torch_dtype=torch_dtype)
seconds = time.perf_counter() - start
stop[0] = True
thread.join()
peak[0] = max(peak[0], rss_anon())
print("RESULT " + json.dumps(dict(seconds=seconds, peak_anon_bytes=peak[0] - base)))
"""


def weight_bytes(folder: str) -> int:
  """Sum of the tensor bytes of every safetensors file under `folder` (headers excluded)."""
  from pipelines.storage import weights
  total = 0
  for sub in sorted(os.listdir(folder)):
    path = os.path.join(folder, sub)
    if os.path.isdir(path) and any(n.endswith(".safetensors") for n in os.listdir(path)):
      total += sum(t.nbytes for t in weights.open_safetensors_folder(path).values())
  return total


def _warm_page_cache(folder: str) -> None:
  for root, _, names in os.walk(folder):
    for name in names:
      with open(os.path.join(root, name), "rb") as f:
        while f.read(1 << 24):
          pass


def _one(side: str, folder: str, dtype: str, mesh: str, shard: bool) -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                       env.get("PYTHONPATH", "")])
  out = subprocess.run([sys.executable, "-c", _CHILD, side, folder, dtype, mesh, "1" if shard else "0"],
                       capture_output=True, text=True, env=env, check=False)
  for line in out.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT "):])
  raise RuntimeError(f"the {side} load failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> int:
  from end_to_end.bench.presets import PRESETS

  ap = argparse.ArgumentParser(prog="bench_load", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", choices=list(PRESETS), default="1.3b-width")
  ap.add_argument("--folder", help="a diffusers folder of the preset (written there when missing or empty)")
  ap.add_argument("--rounds", type=int, default=3, help="pairs of loads, alternating which side goes first")
  ap.add_argument("--mesh", default="", help="ours: load straight onto this mesh (fake CPU devices), e.g. U=2,R=2")
  ap.add_argument("--shard-weights", action="store_true", help="ours: with --mesh, split the block weights")
  ap.add_argument("--no-diffusers", action="store_true", help="time ours only")
  ap.add_argument("--json", help="write the measurements here")
  args = ap.parse_args(argv)
  if args.rounds < 1:
    ap.error("--rounds must be >= 1")
  if args.shard_weights and not args.mesh:
    ap.error("--shard-weights needs --mesh")

  from end_to_end.bench import presets as bench_presets

  preset = PRESETS[args.preset]
  folder = args.folder or tempfile.mkdtemp(prefix="wan_load_bench_")
  if not os.path.isfile(os.path.join(folder, "model_index.json")):
    bench_presets.save_diffusers_pipeline(preset, folder, seed=0)
  else:
    bench_presets.check_saved_pipeline(preset, folder)
  _warm_page_cache(folder)
  sides = ["ours"] + ([] if args.no_diffusers else ["diffusers"])
  results: dict[str, list[dict]] = {s: [] for s in sides}
  for r in range(args.rounds):
    for side in (sides if r % 2 == 0 else sides[::-1]):
      results[side].append(_one(side, folder, preset.dtype, args.mesh, args.shard_weights))
      print(f"  round {r + 1} {side}: {results[side][-1]['seconds']:.2f} s, "
            f"peak +{results[side][-1]['peak_anon_bytes'] / 2**20:.0f} MiB", flush=True)
  size = weight_bytes(folder)
  summary = {side: dict(median_s=statistics.median(x["seconds"] for x in runs),
                        peak_anon_mib=max(x["peak_anon_bytes"] for x in runs) / 2**20, runs=runs)
             for side, runs in results.items()}
  print(f"\n{args.preset}: weights {size / 2**20:.0f} MiB in {folder}"
        + (f", ours onto {args.mesh}{' (sharded)' if args.shard_weights else ''}" if args.mesh else ""))
  print(f"{'side':10s} {'median load s':>14s} {'peak anon MiB':>14s}")
  for side, s in summary.items():
    print(f"{side:10s} {s['median_s']:14.2f} {s['peak_anon_mib']:14.0f}")
  report = dict(preset=args.preset, folder=folder, weight_mib=size / 2**20, mesh=args.mesh,
                shard_weights=args.shard_weights, sides=summary)
  if "diffusers" in summary:
    report["ratio_load"] = summary["ours"]["median_s"] / summary["diffusers"]["median_s"]
    print(f"ours / diffusers load time: {report['ratio_load']:.2f}")
  if args.json:
    from pipelines.storage.video_io import write_json
    write_json(report, args.json, overwrite=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
