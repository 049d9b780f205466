#!/usr/bin/env bash
# GPU numbers in one run of at most ~10 minutes, on a machine with no package index:
#   0. the Pallas GPU kernels (attention/kernels.py, Triton) against the dense reference on the GPU
#      (fp32 and bf16, GQA, padding, a causal window): correctness before speed;
#   1. attention at Wan 2.1 1.3B 480p size (T = S = 32,760, N = 12, H = 128, bf16): cuDNN
#      (jax.nn.dot_product_attention(implementation="cudnn")) vs our Pallas LSE and fixed-m kernels;
#   2. a small block-size grid for the Pallas kernels (end_to_end/bench/tune_blocks.py);
#   3. the denoise step of the full Wan 2.1 1.3B transformer at 480x832 x 81 frames, ours (JAX) vs
#      diffusers' WanPipeline (PyTorch), same random weights, one process (end_to_end/bench/pipeline.py).
#
# Measured on an H200 (JAX 0.11.2, torch 2.11, diffusers 0.42.1): stages 0-3 take about 5 minutes.
# Run from the repository root:  bash end_to_end/gpu_recipe.sh
# Uses the Python found as PYTHON (default python3) with what it has installed (jax with CUDA, flax,
# torch, transformers); whatever is missing (diffusers and its small dependencies) is installed from
# the wheels in WHEELS (default .wheels, filled beforehand on a machine with an index by
# `bash end_to_end/gpu_wheels.sh`) into a private folder, never from an index.
# Results: JSON files and logs under OUT (default $OUT if set, else ./gpu_results).
# Knobs: STEPS (denoise steps per run, default 3), STAGES (default "0 1 2 3").
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-$ROOT/.wheels}"
OUT="${OUT:-$ROOT/gpu_results}"
STEPS="${STEPS:-3}"
STAGES="${STAGES:-0 1 2 3}"
DEPS="${TMPDIR:-/tmp}/wan_gpu_pydeps"  # outside OUT: only results come back
mkdir -p "$OUT" "$DEPS"
export PYTHONPATH="$ROOT:$DEPS${PYTHONPATH:+:$PYTHONPATH}"

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# Install what is missing, from the carried wheels only.
for pair in diffusers:diffusers importlib_metadata:importlib_metadata zipp:zipp PIL:pillow einops:einops \
            tqdm:tqdm safetensors:safetensors qwix:qwix ftfy:ftfy wcwidth:wcwidth; do
  module="${pair%%:*}"; package="${pair##*:}"
  if ! "$PYTHON" -c "import $module" 2>/dev/null; then
    if ls "$WHEELS"/"${package}"-*.whl >/dev/null 2>&1 || ls "$WHEELS"/"${package^}"-*.whl >/dev/null 2>&1; then
      "$PYTHON" -m pip install -q --no-index --no-deps --find-links "$WHEELS" --target "$DEPS" "$package" \
        || echo "warning: could not install $package from $WHEELS"
    else
      echo "warning: $module is missing and $WHEELS has no $package wheel (bash end_to_end/gpu_wheels.sh)"
    fi
  fi
done

"$PYTHON" - <<'EOF' | tee "$OUT/versions.txt"
import jax, sys
print(f"python {sys.version.split()[0]}; jax {jax.__version__} backend {jax.default_backend()} "
      f"{[d.device_kind for d in jax.devices()]}")
for name in ("torch", "diffusers", "transformers", "flax"):
  try:
    mod = __import__(name)
    print(f"{name} {mod.__version__}" + (f" cuda={mod.cuda.is_available()}" if name == "torch" else ""))
  except Exception as e:  # noqa: BLE001 - a report line, not a failure
    print(f"{name}: not importable ({type(e).__name__}: {e})")
EOF

# JAX preallocates 75% of GPU memory by default, which would starve torch in stage 3.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${JAX_MEM_FRACTION:-0.45}"

stage() {  # stage N SECONDS NAME COMMAND...: runs with a time limit, keeps a log, never stops the recipe
  local n="$1" limit="$2" name="$3"; shift 3
  case " $STAGES " in *" $n "*) ;; *) return 0 ;; esac
  echo "=== stage $n: $name (limit ${limit}s)"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/stage$n.log" | grep -v "^W0000\|^I0000\|^WARNING: All log messages"
  echo "=== stage $n: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}

stage 0 240 "Pallas GPU kernels vs the dense reference" "$PYTHON" - <<'EOF'
import json, os, time
import jax, jax.numpy as jnp, numpy as np
from attention import attention_reference, local_attention
rng = np.random.default_rng(0)
rows = []
for dtype, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)):
  for (T, S, N, K, H, valid, window) in ((1000, 1000, 8, 2, 128, 700, None), (777, 1234, 4, 4, 64, None, 40),
                                         (4096, 4096, 12, 12, 128, 4000, None), (300, 300, 4, 2, 80, 250, None)):
    q = jnp.asarray(rng.standard_normal((2, T, N, H)), dtype)
    k = jnp.asarray(rng.standard_normal((2, S, K, H)) + 0.5, dtype)
    v = jnp.asarray(rng.standard_normal((2, S, K, H)), dtype)
    vl = None if valid is None else jnp.asarray([valid, S], jnp.int32)
    ref = attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), kv_valid_len=vl, window=window)
    for impl in ("lse", "fixed_m") + (("auto",) if dtype == jnp.bfloat16 else ()):  # fp32: ~17 s a compile
      t0 = time.perf_counter()
      try:
        out = local_attention(q, k, v, kv_valid_len=vl, window=window, implementation=impl, backend="pallas")
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
        row = dict(dtype=jnp.dtype(dtype).name, T=T, S=S, N=N, K=K, H=H, impl=impl, err=err, ok=err <= tol,
                   first_call_s=time.perf_counter() - t0)
      except Exception as e:  # noqa: BLE001 - report the lowering error and go on
        row = dict(dtype=jnp.dtype(dtype).name, T=T, S=S, N=N, K=K, H=H, impl=impl,
                   error=f"{type(e).__name__}: {str(e)[:400]}")
      rows.append(row)
      print(row, flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "kernels_correctness.json"), "w"), indent=2)
print("all ok" if all(r.get("ok") for r in rows) else "SOME FAILED")
EOF

stage 1 150 "attention 32760 tokens: cuDNN vs Pallas LSE / fixed-m" "$PYTHON" -m end_to_end.bench.attention \
  --seq 32760 --heads 12 --head-dim 128 --dtypes bfloat16 --backend pallas --repeats 10 --json "$OUT/attention.json"

stage 2 120 "Pallas block sizes" "$PYTHON" -m end_to_end.bench.tune_blocks --backend pallas --seq 32760 \
  --dtype bfloat16 --block-q 128,256 --block-kv 128,256 --repeats 5 --json "$OUT/tune_blocks.json"

stage 3 330 "denoise step, Wan 2.1 1.3B 480p x 81: ours vs diffusers" "$PYTHON" -m end_to_end.bench.pipeline \
  --preset wan2.1-1.3b-step --steps "$STEPS" --runs 2 --compare diffusers --torch-device cuda \
  --folder "$OUT/.wan13b-random" --json "$OUT/denoise_step.json"
rm -rf "$OUT/.wan13b-random"  # ~3 GB of random weights; the JSON keeps the numbers

echo "results in $OUT: kernels_correctness.json attention.json tune_blocks.json denoise_step.json, stage logs"
