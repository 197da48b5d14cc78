#!/usr/bin/env bash
# Installs the Python test dependencies into a virtual environment and builds + installs the
# package into it. For .ci/run (and developers): afterwards run
#     "$VENV/bin/python" -m pytest tests/python
# from the repository root.
#
#   VENV                 where the environment goes (default: build-py/venv)
#   FLASHATTN_CUDA       AUTO | ON | OFF for the extension's build (default: OFF in CI, where no GPU
#                        runs it and the CUDA build only costs time; AUTO elsewhere)
#   FLASHATTN_PY_TORCH   1 (default) installs torch from PyPI (the Linux wheel is CUDA-enabled and
#                        pulls ~3 GB of nvidia-* wheels: ~40 s here); 0 skips it, and the torch
#                        tests then skip.
#
# Every pip call passes --no-cache-dir: the torch wheels would otherwise stay in ~/.cache/pip as a
# second ~3 GB copy (a CI run on 2026-12-05 stopped here with "No space left on device").
#
# Measured on the 2-core machine (2026-11-30): venv + numpy/nanobind/scikit-build-core/pytest/jax
# ~15 s, torch ~40 s, building the extension (CPU only) ~1-2 min.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-build-py/venv}
if [[ -n "${CI:-}" ]]; then
  FLASHATTN_CUDA=${FLASHATTN_CUDA:-OFF}
else
  FLASHATTN_CUDA=${FLASHATTN_CUDA:-AUTO}
fi
PYTHON=${PYTHON:-python3}

start=$(date +%s)
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --no-cache-dir --upgrade pip
# Build requirements too: the package is built without isolation, against these.
"$PY" -m pip install --quiet --no-cache-dir numpy pytest "nanobind>=2.4" "scikit-build-core>=0.10" "jax[cpu]>=0.4.36"
if [[ "${FLASHATTN_PY_TORCH:-1}" == "1" ]]; then
  "$PY" -m pip install --quiet --no-cache-dir "torch>=2.4"
fi
echo "python deps: $(( $(date +%s) - start )) s"

start=$(date +%s)
"$PY" -m pip install --quiet --no-cache-dir --no-build-isolation --no-deps \
  -C cmake.define.FLASHATTN_CUDA="$FLASHATTN_CUDA" \
  -C build-dir=build-py/ci-wheel \
  .
echo "flashattn extension: $(( $(date +%s) - start )) s"
"$PY" -c "import flashattn; print(flashattn.build_info())"
