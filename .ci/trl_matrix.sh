#!/usr/bin/env bash
# The TRL version matrix, without reinstalling the world per version.
#
# Each TRL release goes into its own folder with `pip install --no-deps --target .cache/trl/<v> trl==<v>` (and
# liger-kernel 0.8.2, TRL's minimum, into .cache/liger-kernel/0.8.2); the tests put that folder first on PYTHONPATH
# of the process under test, so torch/transformers/accelerate/datasets stay the ones installed once.
#
#   .ci/trl_matrix.sh            # unpack the `always` releases, run tests/test_versions.py + tests/test_matrix.py
#   LIGER_DDP_PATCH_FULL_MATRIX=1 .ci/trl_matrix.sh   # every release in liger_ddp_patch/patches/trl_versions.py (plan: tests/matrix.py)
#   .ci/trl_matrix.sh --prepare-only                   # only unpack (e.g. to warm a CI cache)
#
# Env: LIGER_DDP_PATCH_TRL_DIRS (default .cache/trl), LIGER_DDP_PATCH_LIGER_DIRS (default .cache/liger-kernel),
# LIGER_DDP_PATCH_MATRIX_OUT (optional folder for each run's JSON). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

export LIGER_DDP_PATCH_TRL_DIRS="${LIGER_DDP_PATCH_TRL_DIRS:-$PWD/.cache/trl}"
export LIGER_DDP_PATCH_LIGER_DIRS="${LIGER_DDP_PATCH_LIGER_DIRS:-$PWD/.cache/liger-kernel}"
PY="${PYTHON:-python}"

prepare_only=0
if [[ "${1:-}" == "--prepare-only" ]]; then prepare_only=1; shift; fi

full=
if [[ "${LIGER_DDP_PATCH_FULL_MATRIX:-}" == "1" ]]; then full=--full; fi
versions=$("$PY" tests/matrix.py ci-versions $full)

unpack() {  # unpack DIST VERSION ROOT MODULE
  local dir="$3/$2"
  if [[ -f "$dir/$4/__init__.py" ]]; then return; fi
  echo "trl_matrix: pip install --no-deps --target $dir $1==$2"
  rm -rf "$dir.tmp"
  "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --target "$dir.tmp" "$1==$2"
  mv "$dir.tmp" "$dir"
}

mkdir -p "$LIGER_DDP_PATCH_TRL_DIRS" "$LIGER_DDP_PATCH_LIGER_DIRS"
for v in $versions; do
  unpack trl "$v" "$LIGER_DDP_PATCH_TRL_DIRS" trl
done
unpack liger-kernel 0.8.2 "$LIGER_DDP_PATCH_LIGER_DIRS" liger_kernel

if [[ $prepare_only == 1 ]]; then exit 0; fi
exec "$PY" -m pytest -q -p no:cacheprovider tests/test_versions.py tests/test_matrix.py "$@"
