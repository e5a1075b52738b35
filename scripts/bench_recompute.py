"""What recomputing the per-edge TP weights costs (GPU machine): one energy+forces call with
``recompute_tp_weights="never"`` (kept for the backward) and ``"always"`` (made chunk by chunk
and recomputed), same model and batch, CUDA events, medians; and the peak memory of each.

    python scripts/bench_recompute.py --model mp-medium --size 6912 --dtype float32
"""

from __future__ import annotations

import argparse

import torch

import mace_accel
from mace_accel.bench.backends import resolve_model_source
from mace_accel.bench.systems import build_system, make_batch
from mace_accel.bench.timing import time_calls, track_peak_memory
from mace_accel.models.batch import model_info
from mace_accel.models.outputs import evaluate
from mace_accel.options import AccelOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mp-medium")
    parser.add_argument("--size", type=int, default=6912)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    dtype, device = getattr(torch, args.dtype), torch.device("cuda")
    source = resolve_model_source(args.model)
    for mode in ("never", "always"):
        model = source.load(dtype, device)
        for p in model.parameters():
            p.requires_grad_(False)
        mace_accel.accelerate(model, backend="cuda", verify=False,
                              options=AccelOptions(recompute_tp_weights=mode))
        info = model_info(model)
        batch, _ = make_batch(build_system(info, args.size), info, dtype, device)
        timing = time_calls(lambda: evaluate(model, batch, False), device, warmup=3, repeats=15)
        with track_peak_memory(device) as peak:
            evaluate(model, batch, False)
        print(f"{args.model} {args.dtype} {args.size} atoms, recompute_tp_weights={mode}: "
              f"{timing.median_ms:.2f} ms, peak {peak.peak_mb:.0f} MB")
        del model, batch
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
