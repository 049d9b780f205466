#!/usr/bin/env bash
# The TPU test pass (tests/tpu: the Pallas kernels compiled for the TPU at Wan shapes, two real-width
# Wan blocks, the tiny default's video and the quality check, each against the CPU backend at fp32;
# docs/numerics.md, "TPU tests"), on a TPU machine that has JAX + libtpu and no internet.
#
# Run from the repository root:  bash end_to_end/tpu_recipe.sh
# 1. Finds what `python3 -c "import X"` shows missing among the packages the project and tests/tpu
#    import, and installs only those into /tmp: from the machine's own index (file:///opt/pypi/simple,
#    when that folder exists) and from the wheels carried in .whl-tpu/ (qwix, ftfy, wcwidth,
#    imageio-ffmpeg, pytest and its small dependencies: `bash end_to_end/tpu_wheels.sh` on a machine with internet), never
#    from the internet. The machine's own JAX stays first on the path (nothing installed shadows it).
# 2. Runs `WAN_TEST_PLATFORM=tpu python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/tpu`: one
#    process (only one may hold the chip), the TPU tests only, logged to ${OUT:-.}/tpu_tests.log.
# Knobs: PYTHON (default python3), WHEELS (default .whl-tpu), LIMIT (seconds for pytest, default 580),
# PYTEST_ARGS (extra pytest arguments, e.g. "-k attention"), COMMAND (run it instead of the tests, with
# the same set-up, e.g. COMMAND="python3 -m end_to_end.bench.pipeline --preset wan2.1-1.3b --steps 50").
# HOST_LIMIT_GIB (unset: none) runs it under end_to_end/host_watchdog.sh, which kills it with its log
# when the host's memory in use passes that many GiB (a lent machine's own out-of-memory kill loses it).
# Exit status: pytest's (124 when LIMIT ran out, 137 when the watchdog killed it).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-$ROOT/.whl-tpu}"
INDEX_DIR=/opt/pypi/simple
SITE="${TMPDIR:-/tmp}/wan_tpu_site"        # the carried wheels
SITE_INDEX="${TMPDIR:-/tmp}/wan_tpu_site2" # the local index's packages and their dependencies
LOG="${OUT:-.}/tpu_tests.log"
mkdir -p "$SITE" "$SITE_INDEX" "$(dirname "$LOG")"
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
# The index's transformers wants huggingface_hub < 2 while its newest hub is 2.x; installed one package
# at a time (below), pip would pair them wrong (measured: transformers then refuses to import).
CONSTRAINTS="${TMPDIR:-/tmp}/wan_tpu_constraints.txt"
echo "huggingface_hub<2" > "$CONSTRAINTS"

# The repository, then the machine's JAX (the site folder it lives in: the local index's flax pulls a
# jax into $SITE_INDEX, which must not shadow it; measured), then what we install.
JAX_SITE="$("$PYTHON" -c 'import jax, os; print(os.path.dirname(os.path.dirname(jax.__file__)))')" \
  || { echo "error: $PYTHON cannot import jax: this recipe needs a machine with JAX + libtpu" >&2; exit 2; }
export PYTHONPATH="$ROOT:$JAX_SITE${PYTHONPATH:+:$PYTHONPATH}:$SITE:$SITE_INDEX"

# module:package, what the project imports at run time (pyproject.toml) and what tests/tpu and pytest need.
PAIRS="flax:flax einops:einops numpy:numpy PIL:pillow safetensors:safetensors imageio:imageio imageio_ffmpeg:imageio-ffmpeg
skimage:scikit-image tqdm:tqdm transformers:transformers optax:optax matplotlib:matplotlib
huggingface_hub:huggingface_hub filelock:filelock opt_einsum:opt_einsum absl:absl-py
qwix:qwix ftfy:ftfy wcwidth:wcwidth pytest:pytest pluggy:pluggy iniconfig:iniconfig packaging:packaging pygments:pygments"
missing() {  # the packages of PAIRS whose module does not import now
  for pair in $PAIRS; do
    "$PYTHON" -c "import ${pair%%:*}" 2>/dev/null || echo "${pair##*:}"
  done
}

todo="$(missing | tr '\n' ' ')"
if [ -n "${todo// }" ]; then
  echo "missing: $todo"
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then  # carried wheels first: the local index lacks them
    "$PYTHON" -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEELS"/*.whl || echo "warning: some wheels in $WHEELS did not install"
  else
    echo "warning: no wheels in $WHEELS (bash end_to_end/tpu_wheels.sh on a machine with internet)"
  fi
  todo="$(missing | tr '\n' ' ')"
fi
if [ -n "${todo// }" ] && [ -d "$INDEX_DIR" ]; then
  echo "from $INDEX_DIR: $todo"
  # shellcheck disable=SC2086  # one argument per package
  if ! "$PYTHON" -m pip install --isolated -q --only-binary=:all: --no-cache-dir --index-url "file://$INDEX_DIR" -c "$CONSTRAINTS" \
       --target "$SITE_INDEX" $todo; then
    for package in $todo; do  # one at a time, so one package the index lacks does not stop the others
      "$PYTHON" -m pip install --isolated -q --only-binary=:all: --no-cache-dir --index-url "file://$INDEX_DIR" -c "$CONSTRAINTS" \
        --target "$SITE_INDEX" "$package" || echo "warning: $package is not in $INDEX_DIR"
    done
  fi
  todo="$(missing | tr '\n' ' ')"
fi
[ -n "${todo// }" ] && echo "warning: still missing: $todo (the tests that import them will fail)"

{
  "$PYTHON" - <<'PY'
import sys
import jax
print(f"python {sys.version.split()[0]}; jax {jax.__version__} from {jax.__file__}; backend {jax.default_backend()}; "
      f"devices {[d.device_kind for d in jax.devices()]}")
PY
  watch=()
  [ -n "${HOST_LIMIT_GIB:-}" ] && watch=(bash "$ROOT/end_to_end/host_watchdog.sh" "$HOST_LIMIT_GIB")
  if [ -n "${COMMAND:-}" ]; then  # another command with the same set-up, e.g. a benchmark
    PYTHONUNBUFFERED=1 "${watch[@]}" timeout "${LIMIT:-580}" bash -c "$COMMAND"
  else
    WAN_TEST_PLATFORM=tpu "${watch[@]}" timeout "${LIMIT:-580}" "$PYTHON" -m pytest -q -p no:xdist -p no:cacheprovider \
      ${PYTEST_ARGS:-} tests/tpu
  fi
  status=$?
  echo "${COMMAND:-tests/tpu}: exit $status"
  exit $status
} 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
echo "log: $LOG"
exit "$status"
