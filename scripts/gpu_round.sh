#!/usr/bin/env bash
# One GPU-machine call for a round's closing numbers: the whole GPU test suite (per-file
# progress kept in the log even if the time limit cuts it), then the 256-atom energy+forces call
# in a CUDA graph against cuEquivariance; logs under $OUT, a short summary last.
#   SUITE_TIMEOUT (s, default 410), GRAPH_DTYPES (default float32)
# Compiled kernels are cached in .gpu-deps/kernel-cache, which travels with carry [".gpu-deps"]:
# on a fresh machine NVRTC compiling the suite's few hundred kernels is a large part of a call.
# The cache comes back as $OUT/kernel-cache.tgz; unpack it here for the next call:
#   tar -xzf <files_at>/kernel-cache.tgz -C .gpu-deps
set -u
source .gpu-deps/setup.sh && export PYTHONPATH=/tmp/site:$PWD/.gpu-deps/oeq
export MACE_ACCEL_CACHE_DIR="$PWD/.gpu-deps/kernel-cache"
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
FILTER='warn|visitor|_Jd|^$|Precompiled|For these|from openeq|a.shape|np.reshape|_cupy_stream|atomic_numbers|run_backward'
timeout "${SUITE_TIMEOUT:-410}" python -m pytest -m gpu tests -p no:cacheprovider --tb=line -rf \
  -W ignore::DeprecationWarning > "$OUT/gpu_tests.log" 2>&1
timeout 90 python scripts/bench_graphs.py --sizes 256 --dtypes "${GRAPH_DTYPES:-float32}" \
  --repeats 30 2>&1 | grep -v -i -E "$FILTER" > "$OUT/graphs.log"
echo "== summary"
grep -E "^tests/.*(F|E)" "$OUT/gpu_tests.log" | head -20
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -30
tail -1 "$OUT/gpu_tests.log"; grep "^graph" "$OUT/graphs.log"
tar -czf "$OUT/kernel-cache.tgz" -C .gpu-deps kernel-cache 2>/dev/null \
  && echo "kernel cache: $(ls .gpu-deps/kernel-cache | wc -l) cubins, $(du -sh "$OUT/kernel-cache.tgz" | cut -f1)"
