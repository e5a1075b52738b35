#!/usr/bin/env bash
# Bring what the GPU machine (no network) needs into .gpu-deps/: the shared preparation (mace-torch
# and friends; --anchors adds cuEquivariance and OpenEquivariance), plus the wheels our own
# dependencies need that it does not carry (vesin: the CUDA neighbour list; without it the
# calculator's, bench's and neighbour-list GPU tests fail with "No module named 'vesin'").
#
# Usage: bash scripts/prepare_gpu_deps.sh [--anchors]     then carry [".gpu-deps"]
set -euo pipefail
cd "$(dirname "$0")/.."
bash ../shared/device/prepare.sh "$@"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu-deps/wheels "vesin>=0.6" 2>&1 | grep -v WARNING || true
ls .gpu-deps/wheels | grep -q '^vesin-' || { echo "prepare_gpu_deps.sh: vesin wheel missing" >&2; exit 1; }
du -sh .gpu-deps
