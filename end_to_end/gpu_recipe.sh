#!/usr/bin/env bash
# Per-step time of the real Wan 2.1 T2V 1.3B architecture at 480x832 x 81 frames on ONE GPU:
# ours (JAX) and diffusers' WanPipeline (PyTorch) side by side, same random weights, same settings,
# in one process. Run from anywhere:  bash end_to_end/gpu_recipe.sh
#
# Needs: an NVIDIA GPU with >= 40 GB (A100 / H100 / L40S; both pipelines hold their bf16 weights,
# UMT5-XXL included, at the same time), CUDA 12 driver, Python 3.10+, ~40 GB host RAM and ~20 GB
# disk (the random-weight pipeline is saved once in bf16 and reused on reruns).
# Knobs (environment): STEPS (default 10), RUNS (2: cold + warm), OUT (JSON report path),
# FOLDER (where the random pipeline is saved), VENV (virtualenv to create / reuse), PYTHON,
# JAX_MEM_FRACTION (share of GPU memory JAX preallocates; torch gets the rest; default 0.45).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STEPS="${STEPS:-10}"
RUNS="${RUNS:-2}"
OUT="${OUT:-$PWD/gpu_bench_wan13b_480p.json}"
FOLDER="${FOLDER:-${XDG_CACHE_HOME:-$HOME/.cache}/wan_bench/wan2.1-1.3b-random-bf16}"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv-gpu}"
PYTHON="${PYTHON:-python3}"

command -v nvidia-smi >/dev/null || { echo "error: nvidia-smi not found; this recipe needs an NVIDIA GPU" >&2; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  # The project with its GPU extra (jax[cuda12]) and the comparison's packages (a CUDA torch).
  "$VENV/bin/pip" install -q -e "$ROOT[gpu]" torch "diffusers>=0.33" accelerate
fi
"$VENV/bin/python" - <<'EOF'
import jax, torch
assert jax.default_backend() == "gpu", f"JAX sees {jax.default_backend()!r}, not the GPU: install jax[cuda12]"
assert torch.cuda.is_available(), "torch sees no CUDA device: install a CUDA build of torch"
print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; torch {torch.__version__} on "
      f"{torch.cuda.get_device_name(0)}")
EOF

mkdir -p "$(dirname "$FOLDER")"
# JAX preallocates 75% of GPU memory by default, which would starve torch in the same process.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${JAX_MEM_FRACTION:-0.45}"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" -m end_to_end.benchmark \
  --preset wan2.1-1.3b --height 480 --width 832 --frames 81 --steps "$STEPS" --runs "$RUNS" \
  --dtype bfloat16 --compare diffusers --torch-device cuda --folder "$FOLDER" --json "$OUT"
echo "report: $OUT  (the denoise_step_median row is the per-step time; ours/diffusers < 1: ours is faster)"
