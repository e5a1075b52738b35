#!/usr/bin/env bash
# One GPU-machine call for this round's closing numbers: the whole GPU test suite, ASE MD
# steps/s (256 and 864 atoms), the 256-atom graph replay (fp32, fp64) against cuEquivariance and
# the 6,912-atom kernel table; logs under $OUT, a short summary last.
set -u
source .gpu-deps/setup.sh && export PYTHONPATH=/tmp/site:$PWD/.gpu-deps/oeq
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
FILTER='warn|visitor|_Jd|^$|Precompiled|For these|from openeq|a.shape|np.reshape|_cupy_stream|atomic_numbers|run_backward'
timeout 260 python -m pytest -q -m gpu tests 2>&1 | tail -25 > "$OUT/gpu_tests.log"
timeout 150 python scripts/profile_md.py --sizes 256,864 --steps 200 2>&1 | grep -v -i -E "$FILTER" > "$OUT/md.log"
timeout 150 python scripts/bench_graphs.py --sizes 256 --dtypes float32,float64 --repeats 30 2>&1 | grep -v -i -E "$FILTER" > "$OUT/graphs.log"
echo "== summary"; tail -1 "$OUT/gpu_tests.log"; grep "steps/s\|bare graph" "$OUT/md.log"; grep "^graph" "$OUT/graphs.log"
