#!/usr/bin/env bash
# One command for the GPU machine: the GPU test suite, the standard side-by-side benchmark,
# and a short summary printed LAST (where only the tail of the output is shown).
#
# Usage: bash scripts/gpu_suite.sh [--tests-only | --bench-only] [--part K/N] [--quick] [--no-install]
#   --tests-only   only `python -m pytest -m gpu -q`          (log: $OUT/gpu_tests.log)
#   --part K/N     only the K-th of N shares of the test files with GPU tests (the whole suite
#                  takes about 20 minutes on an H200: run --part 1/3, 2/3 and 3/3)
#   --bench-only   only the benchmark                          (JSON/PNG: $OUT/bench/)
#   --quick        benchmark mpa0-medium float32 at 256,2048 atoms, 10 repeats
#   --no-install   skip `pip install -e .`
# Environment: OUT (default ./out), TESTS_TIMEOUT (s, default 540),
#   BENCH_TIME_LIMIT (s of measurements, default 220; the process gets 45 s more to finish).
# The benchmark alone takes about 7 minutes (conv kernel ~1.5, bench ~4.5); the tests about 20.
set -u -o pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-$PWD/out}"
TESTS_TIMEOUT="${TESTS_TIMEOUT:-540}"
BENCH_TIME_LIMIT="${BENCH_TIME_LIMIT:-220}"
run_tests=1; run_bench=1; quick=0; install=1; part="1/1"
for arg in "$@"; do
  if [ "${want_part:-0}" = 1 ]; then part="$arg"; want_part=0; continue; fi
  case "$arg" in
    --part) want_part=1 ;;
    --part=*) part="${arg#--part=}" ;;
    --tests-only) run_bench=0 ;;
    --bench-only) run_tests=0 ;;
    --quick) quick=1 ;;
    --no-install) install=0 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "gpu_suite.sh: unknown argument '$arg' (use --tests-only, --bench-only, --part K/N," \
            "--quick, --no-install)" >&2; exit 2 ;;
  esac
done
if ! [[ "$part" =~ ^([1-9][0-9]*)/([1-9][0-9]*)$ ]] || [ "${BASH_REMATCH[1]}" -gt "${BASH_REMATCH[2]}" ]; then
  echo "gpu_suite.sh: --part takes K/N with 1 <= K <= N (e.g. --part 1/3), got '$part'" >&2; exit 2
fi
part_k=${BASH_REMATCH[1]}; part_n=${BASH_REMATCH[2]}
if [ "$run_tests" = 0 ] && [ "$run_bench" = 0 ]; then
  echo "gpu_suite.sh: --tests-only and --bench-only exclude each other" >&2; exit 2
fi
mkdir -p "$OUT"

if [ -f .gpu-deps/setup.sh ]; then
  # shellcheck disable=SC1091
  source .gpu-deps/setup.sh
  # setup.sh puts the checkout itself on PYTHONPATH, which would shadow the installed package's
  # mapping of kernels/ and patches/ (mace_accel.kernels, mace_accel.patches): drop it
  PYTHONPATH=$(echo "$PYTHONPATH" | tr ':' '\n' | grep -vx "$PWD" | paste -sd: -)
  export PYTHONPATH
fi
install_note="skipped"
if [ "$install" = 1 ]; then
  if python -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip_install.log" 2>&1; then
    install_note="ok"
  else
    install_note="FAILED (see $OUT/pip_install.log)"
    tail -n 20 "$OUT/pip_install.log"
  fi
fi
# read-only look at the card's state, for the notes
gpu_state="nvidia-smi not found"
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm,temperature.gpu \
    --format=csv > "$OUT/gpu_state.csv" 2>&1 && gpu_state=$(tail -n 1 "$OUT/gpu_state.csv")
fi

tests_line="not run"; tests_failures=""
if [ "$run_tests" = 1 ]; then
  # the files with GPU tests (found, not listed), every N-th from the K-th in name order
  mapfile -t test_files < <(grep -l "mark.gpu" tests/test_*.py | sort \
                            | awk -v k="$part_k" -v n="$part_n" '(NR - k) % n == 0')
  echo "== GPU tests, part $part of the files (${#test_files[@]} files, timeout" \
       "${TESTS_TIMEOUT}s, log $OUT/gpu_tests.log)"
  timeout --signal=INT --kill-after=20 "$TESTS_TIMEOUT" \
    python -m pytest -m gpu -q -rfE -p no:cacheprovider "${test_files[@]}" \
    > "$OUT/gpu_tests.log" 2>&1
  tests_rc=$?
  tests_line=$(grep -E "[0-9]+ (passed|failed|error|errors|skipped|deselected)|no tests ran" \
               "$OUT/gpu_tests.log" | tail -n 1)
  [ -z "$tests_line" ] && tests_line="no pytest summary line (exit $tests_rc); see the log"
  [ "$tests_rc" = 124 ] && tests_line="TIMED OUT after ${TESTS_TIMEOUT}s: $tests_line"
  tests_failures=$(grep -E "^(FAILED|ERROR) " "$OUT/gpu_tests.log" | head -n 15)
fi

kernel_line="not run"
if [ "$run_bench" = 1 ]; then
  # the fused conv kernel alone vs OpenEquivariance / cuEquivariance (MP-medium layer 2, ~540k edges)
  echo "== conv kernel benchmark (log $OUT/conv_kernel.log)"
  timeout 240 python scripts/bench_kernels.py conv --json "$OUT/conv_kernel.json" --repeats 20 \
    > "$OUT/conv_kernel.log" 2>&1
  kernel_rc=$?
  [ "$kernel_rc" = 0 ] && kernel_line="ok" || kernel_line="exit $kernel_rc (see $OUT/conv_kernel.log)"
fi

sc_line="not run"
if [ "$run_bench" = 1 ]; then
  # the fused symmetric contraction alone vs mace's module (MP-medium/large product blocks)
  echo "== symmetric contraction benchmark (log $OUT/sc_kernel.log)"
  timeout 180 python scripts/bench_kernels.py symmetric-contraction --json "$OUT/sc_kernel.json" \
    > "$OUT/sc_kernel.log" 2>&1
  sc_rc=$?
  [ "$sc_rc" = 0 ] && sc_line="ok" || sc_line="exit $sc_rc (see $OUT/sc_kernel.log)"
fi

graphs_line="not run"
if [ "$run_bench" = 1 ]; then
  # one call inside a CUDA graph (mace-accel's GraphedCall vs cuEquivariance captured by hand)
  # and ASE MD steps/s (MACEAccelCalculator vs mace's MACECalculator with cuEquivariance)
  echo "== CUDA-graph and MD benchmark (log $OUT/graphs.log)"
  timeout 300 python scripts/bench_model.py graphs --sizes 256,2048 --dtypes float32,float64 \
    --md 256,864 --json "$OUT/graphs.json" > "$OUT/graphs.log" 2>&1
  graphs_rc=$?
  [ "$graphs_rc" = 0 ] && graphs_line="ok" || graphs_line="exit $graphs_rc (see $OUT/graphs.log)"
fi

bench_line="not run"
if [ "$run_bench" = 1 ]; then
  if [ "$quick" = 1 ]; then
    bench_args=(--models mpa0-medium --dtypes float32 --sizes 256,2048 --repeats 10 --warmup 3)
  else
    bench_args=(--models mpa0-medium,mh1,mp0-medium,off23-medium --dtypes float32,float64
                --sizes 256,2048,6912 --repeats 20 --warmup 5)
  fi
  echo "== benchmark (measurements stop after ${BENCH_TIME_LIMIT}s, log $OUT/bench.log)"
  timeout --signal=INT --kill-after=15 "$((BENCH_TIME_LIMIT + 45))" \
    python -m mace_accel.bench "${bench_args[@]}" --backends e3nn,cueq,oeq,mace-accel \
      --device cuda --time-limit "$BENCH_TIME_LIMIT" --out "$OUT/bench" > "$OUT/bench.log" 2>&1
  bench_rc=$?
  case "$bench_rc" in
    0) bench_line="ok" ;;
    3) bench_line="finished; some backend FAILED (see the table)" ;;
    124) bench_line="KILLED at $((BENCH_TIME_LIMIT + 45))s; table from the last saved JSON" ;;
    *) bench_line="exit $bench_rc (see $OUT/bench.log)" ;;
  esac
fi

echo
echo "================================ summary ================================"
echo "install: $install_note    gpu: $gpu_state"
echo "GPU tests: $tests_line"
[ -n "$tests_failures" ] && echo "$tests_failures"
if [ "$run_bench" = 1 ]; then
  echo "conv kernel: $kernel_line"
  sed -n '/^conv kernel,/,$p' "$OUT/conv_kernel.log" 2>/dev/null
  echo "symmetric contraction: $sc_line"
  grep '^symmetric contraction,' "$OUT/sc_kernel.log" 2>/dev/null || tail -n 5 "$OUT/sc_kernel.log"
  echo "graphs and MD: $graphs_line"
  grep -E '^(graph|md) ' "$OUT/graphs.log" 2>/dev/null || tail -n 5 "$OUT/graphs.log"
  echo "benchmark: $bench_line"
  if [ -f "$OUT/bench/bench.json" ]; then
    python -m mace_accel.bench --summarize "$OUT/bench/bench.json" 2>&1 | tail -n 70
  else
    tail -n 30 "$OUT/bench.log"
  fi
fi
echo "total ${SECONDS}s; logs and results under $OUT"
