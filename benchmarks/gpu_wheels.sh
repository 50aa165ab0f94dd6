#!/usr/bin/env bash
# Wheels for benchmarks/gpu_check.py on a lent GPU machine (one H200, Python 3.12, torch 2.11, no network):
# the packages its image lacks (`python3 benchmarks/gpu_check.py --print-wheels`), for CPython 3.12 on manylinux
# x86_64, without their dependencies, into .whl/ (ignored by git; carried with the working tree, <= 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
mkdir -p .whl
for spec in $("$PY" benchmarks/gpu_check.py --print-wheels); do
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$spec"
done
ls -l .whl/*.whl
size=$(du -sm .whl | cut -f1)
echo "gpu_wheels: $(ls .whl/*.whl | wc -l) wheels, ${size} MiB in .whl/"
if (( size > 60 )); then echo "gpu_wheels: .whl/ is over 60 MiB: it may not travel with the tree" >&2; exit 1; fi
