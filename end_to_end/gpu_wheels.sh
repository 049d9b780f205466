#!/usr/bin/env bash
# Downloads (on a machine WITH a package index) the wheels end_to_end/gpu_recipe.sh installs on a GPU
# machine without one: diffusers and the small packages it or this project may miss there, for
# CPython 3.12 on x86-64 Linux, no dependencies resolved (the GPU machine has jax, torch,
# transformers and flax). Into WHEELS (default .wheels, ignored by git; carry it to the GPU machine).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="${WHEELS:-$ROOT/.wheels}"
PY_VERSION="${PY_VERSION:-3.12}"
PIP="${PIP:-$ROOT/.venv/bin/pip}"
mkdir -p "$WHEELS"
"$PIP" download -q --only-binary=:all: --no-deps --python-version "$PY_VERSION" \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d "$WHEELS" \
  "diffusers>=0.33" importlib_metadata zipp pillow einops tqdm safetensors qwix ftfy wcwidth
ls -la "$WHEELS"
