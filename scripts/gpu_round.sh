#!/usr/bin/env bash
# One GPU-machine call of this round: the linear/model GPU tests, the kernel table at 6,912
# atoms (ours vs cuEquivariance) and the 256-atom graph replay; logs under $OUT.
source .gpu-deps/setup.sh && export PYTHONPATH=/tmp/site:$PWD/.gpu-deps/oeq && python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 200 python -m pytest -q -m gpu tests/test_gpu_irreps_linear.py tests/test_gpu_model.py -x 2>&1 | tail -15 | tee $OUT/gpu_tests.log
timeout 150 python scripts/kernel_table.py --size 6912 --backends mace-accel,cueq --top 25 2>&1 | grep -v -i "warn\|visitor\|_Jd\|^$\|Precompiled\|For these\|from openeq\|a.shape\|np.reshape\|_cupy_stream" > $OUT/kernel_table.log
timeout 150 python scripts/bench_graphs.py --sizes 256 --dtypes float32 --repeats 30 2>&1 | grep -v -i "warn\|visitor\|_Jd\|^$\|Precompiled\|For these\|from openeq\|a.shape\|np.reshape\|_cupy_stream" > $OUT/graphs.log
grep -A12 "== " $OUT/kernel_table.log | head -60; tail -12 $OUT/graphs.log
