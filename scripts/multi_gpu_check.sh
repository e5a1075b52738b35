#!/usr/bin/env bash
# Multi-GPU checks for the GPU machine (nvidia-h200-x2 / -x4): batched evaluation over 1, 2, 4
# GPUs (mace_accel.bench.multi_gpu under torchrun), then `mace-accel run --gpus N` end to end on
# a small singlepoint run (NCCL), its results compared with a one-process run.
# Usage: bash scripts/multi_gpu_check.sh [FRAMES]   (logs under $OUT, default ./out)
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
frames="${1:-4000}"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
echo "== $gpus GPU(s)"
for n in 1 2 4; do
  [ "$n" -le "$gpus" ] || continue
  timeout 200 python -m torch.distributed.run --standalone --nproc-per-node "$n" \
    -m mace_accel.bench.multi_gpu --frames "$frames" > "$OUT/multi_gpu_$n.log" 2>&1
  grep -E "^multi-gpu" "$OUT/multi_gpu_$n.log" || tail -n 5 "$OUT/multi_gpu_$n.log"
done
work="$OUT/run_gpus"; mkdir -p "$work"
python - "$work" <<'PY'
import sys, yaml, ase.io
from mace_accel.bench.throughput import make_frames
from mace_accel.models.checkpoint import default_model_path, load_model
work = sys.argv[1]
model = load_model(default_model_path(), device="cpu")
ase.io.write(f"{work}/frames.extxyz", make_frames(model, 60, seed=3))
for name in ("one", "two"):
    yaml.safe_dump({"task": "singlepoint", "struct": "frames.extxyz", "device": "cuda",
                    "dtype": "float64", "outputs": f"out_{name}", "progress": False},
                   open(f"{work}/{name}.yaml", "w"))
PY
timeout 120 python -m mace_accel.cli run "$work/one.yaml" > "$OUT/run_one.log" 2>&1
timeout 200 python -m mace_accel.cli run "$work/two.yaml" --gpus 2 > "$OUT/run_two.log" 2>&1
echo "run --gpus 2: exit $?"
python - "$work" <<'PY'
import sys, numpy as np, ase.io
work = sys.argv[1]
a = ase.io.read(f"{work}/out_one/results.extxyz", ":")
b = ase.io.read(f"{work}/out_two/results.extxyz", ":")
de = max(abs(x.get_potential_energy() - y.get_potential_energy()) for x, y in zip(a, b))
df = max(np.abs(x.get_forces() - y.get_forces()).max() for x, y in zip(a, b))
print(f"run --gpus 2 vs one process: {len(b)}/{len(a)} frames, max |dE| {de:.2e} eV, "
      f"max |dF| {df:.2e} eV/A")
PY
grep -h "batched model call" "$work"/out_*/run.log
