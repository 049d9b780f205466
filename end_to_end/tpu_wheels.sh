#!/usr/bin/env bash
# Downloads (on a machine WITH internet) the wheels end_to_end/tpu_recipe.sh installs on a TPU machine
# whose own index (file:///opt/pypi/simple) lacks them: qwix, ftfy, wcwidth, imageio-ffmpeg (the mp4
# writer, 29 MB with its ffmpeg), and pytest with its small dependencies, for CPython 3.11 on x86-64
# Linux, no dependencies resolved. Into WHEELS (default
# .whl-tpu, ignored by git; carry it to the TPU machine inside the repository folder).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="${WHEELS:-$ROOT/.whl-tpu}"
PIP="${PIP:-$ROOT/.venv/bin/pip}"
mkdir -p "$WHEELS"
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$WHEELS" \
  "qwix>=0.1.8,<0.2" "ftfy>=6.1" wcwidth "imageio-ffmpeg>=0.5" pytest pluggy iniconfig packaging pygments
ls -la "$WHEELS"
