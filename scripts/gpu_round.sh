#!/usr/bin/env bash
# One GPU-machine run for a change's closing numbers: the whole GPU test suite in SUITE_JOBS
# parallel pytest processes (test files dealt out by their GPU test count; NVRTC compiling the
# kernels is CPU work, so parallel processes finish a fresh machine's suite several times
# sooner), then the 256-atom energy+forces call in a CUDA graph against cuEquivariance (and
# without the radial MLPs' overlap), then optionally ASE MD with and without that overlap
# (scripts/profile_md.py) and the 256-atom kernel table; logs under $OUT, a summary last.
#   SUITE_TIMEOUT (s, default 330), SUITE_JOBS (default 4), GRAPH_DTYPES (default float32),
#   GRAPH_TIMEOUT (s, default 130), MD_SIZES (atom counts, default none), MD_TIMEOUT (s, 130),
#   KERNEL_TABLE (set: the kernel table), BENCH_MODELS (e.g. mp-medium,mp-large: the 6,912-atom
#   bench against cuEquivariance with --profile), BENCH_DTYPES (float32), BENCH_TIMEOUT (s, 200),
#   GLUE_TRACE (set: scripts/glue_trace.py at 256 atoms), TIMELINE (set: the kernels of the
#   256-atom graph replay, scripts/graph_timeline.py), LINEAR_SWEEP (arguments of
#   scripts/bench_irreps_linear.py, e.g. "--nodes 280 --maps readout --variants 4:4:1")
# Every log ends up in $OUT/logs.tgz (the device tool returns few files: one archive).
# Compiled kernels are cached in .gpu-deps/kernel-cache, which travels with carry [".gpu-deps"].
# The cache comes back as $OUT/kernel-cache.tgz; unpack it here for the next call:
#   tar -xzf <files_at>/kernel-cache.tgz -C .gpu-deps
set -u
# the shared preparation alone lacks vesin (13 GPU tests and the MD fail without it)
ls .gpu-deps/wheels 2>/dev/null | grep -q '^vesin-' || {
  echo "gpu_round.sh: no vesin wheel in .gpu-deps/wheels; run bash scripts/prepare_gpu_deps.sh" >&2
  exit 1; }
source .gpu-deps/setup.sh && export PYTHONPATH=/tmp/site:$PWD/.gpu-deps/oeq
export MACE_ACCEL_CACHE_DIR="$PWD/.gpu-deps/kernel-cache"
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
RESULTS="${OUT:-$PWD/out}"; OUT="$RESULTS/logs"; mkdir -p "$OUT"
FILTER='warn|visitor|_Jd|^$|Precompiled|For these|from openeq|a.shape|np.reshape|_cupy_stream|atomic_numbers|run_backward'
JOBS="${SUITE_JOBS:-4}"
mapfile -t FILES < <(python -m pytest -m gpu tests --collect-only -q -p no:cacheprovider \
  2>/dev/null | grep '::' | cut -d: -f1 | sort | uniq -c | sort -rn | awk '{print $2}')
declare -a GROUPS_
for i in "${!FILES[@]}"; do GROUPS_[$((i % JOBS))]+=" ${FILES[$i]}"; done
for j in "${!GROUPS_[@]}"; do
  timeout "${SUITE_TIMEOUT:-330}" python -m pytest -m gpu ${GROUPS_[$j]} -p no:cacheprovider \
    --tb=short -rf -W ignore::DeprecationWarning > "$OUT/gpu_tests_$j.log" 2>&1 &
done
wait
timeout "${GRAPH_TIMEOUT:-130}" python scripts/bench_graphs.py --sizes 256 \
  --dtypes "${GRAPH_DTYPES:-float32}" --repeats 30 --serial 2>&1 | grep -v -i -E "$FILTER" \
  > "$OUT/graphs.log"
if [ -n "${MD_SIZES:-}" ]; then
  timeout "${MD_TIMEOUT:-130}" python scripts/profile_md.py --sizes "$MD_SIZES" --steps 200 \
    --serial 2>&1 | grep -v -i -E "$FILTER" > "$OUT/md.log"
fi
if [ -n "${BENCH_MODELS:-}" ]; then  # e.g. BENCH_MODELS=mp-medium,mp-large
  timeout "${BENCH_TIMEOUT:-200}" python -m mace_accel.cli bench --models "$BENCH_MODELS" \
    --dtypes "${BENCH_DTYPES:-float32}" --sizes 6912 --backends mace-accel,cueq --profile \
    --repeats 10 --out "$OUT/bench" 2>&1 | grep -v -i -E "$FILTER" > "$OUT/bench.log"
fi
if [ -n "${GLUE_TRACE:-}" ]; then
  timeout 90 python scripts/glue_trace.py cuda 256 2>&1 | grep -v -i -E "$FILTER" > "$OUT/glue_trace.log"
fi
if [ -n "${TIMELINE:-}" ]; then
  timeout 90 python scripts/graph_timeline.py --size 256 2>&1 \
    | grep -v -i -E "$FILTER" > "$OUT/timeline.log"
fi
if [ -n "${LINEAR_SWEEP:-}" ]; then
  timeout 120 python scripts/bench_irreps_linear.py $LINEAR_SWEEP 2>&1 | grep -v -i -E "$FILTER" \
    > "$OUT/linear_sweep.log"
fi
if [ -n "${KERNEL_TABLE:-}" ]; then
  timeout 90 python scripts/kernel_table.py --size 256 --backends mace-accel --top 25 2>&1 \
    | grep -v -i -E "$FILTER" > "$OUT/kernel_table.log"
fi
tar -czf "$RESULTS/kernel-cache.tgz" -C .gpu-deps kernel-cache 2>/dev/null \
  && echo "kernel cache: $(ls .gpu-deps/kernel-cache | wc -l) cubins"
echo "== summary"
for j in "${!GROUPS_[@]}"; do
  echo "group $j:${GROUPS_[$j]}"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_$j.log" | head -20
  tail -1 "$OUT/gpu_tests_$j.log"
done
[ -f "$OUT/kernel_table.log" ] && grep -E "^== |^   [a-z]" "$OUT/kernel_table.log" | head -14
[ -f "$OUT/glue_trace.log" ] && head -1 "$OUT/glue_trace.log"
[ -f "$OUT/timeline.log" ] && grep -E "^replay" "$OUT/timeline.log"
[ -f "$OUT/md.log" ] && grep -E "steps/s|bare graph" "$OUT/md.log"
[ -f "$OUT/bench/bench_table.txt" ] && cat "$OUT/bench/bench_table.txt"
grep "^graph" "$OUT/graphs.log"
tar -czf "$RESULTS/logs.tgz" -C "$RESULTS" logs && rm -rf "$OUT"
