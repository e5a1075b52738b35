"""Batched evaluation over 1..N GPUs with torch.distributed (run under torchrun).

    torchrun --standalone --nproc-per-node 4 -m mace_accel.bench.multi_gpu --frames 2000

``mace-accel bench --throughput FRAMES --throughput-gpus 1,2,4`` runs it for each GPU count
(:func:`launch`) and adds the rows to its throughput table.

Every rank builds the same frames (rattled fcc cells of 64-256 atoms), takes its share by atom
count (:func:`mace_accel.runs.distributed.share_frames`, as ``mace-accel run --gpus N`` does),
warms up, and evaluates its share with a :class:`mace_accel.BatchEvaluator`; the time is from a
barrier before to a barrier after, so it is the slowest rank's. Rank 0 prints frames/s and
atoms/s (process start-up, model loading and kernel compilation are not included: they are a
fixed cost per run, printed separately).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

RESULT_PREFIX = "multi-gpu-result "


def launch(model: str, n_gpus: int, frames: int, dtype: str, label: str,
           timeout_s: float = 600.0):
    """Run this module under torchrun on ``n_gpus`` GPUs; a
    :class:`~mace_accel.bench.throughput.ThroughputRecord` (mode ``batched, N GPUs``)."""
    from mace_accel.bench.throughput import ThroughputRecord

    record = ThroughputRecord(label, dtype, f"batched, {n_gpus} GPU(s)", "ok", frames, 0)
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpus > available:
        record.status = f"not run: {n_gpus} GPU(s) asked, {available} visible"
        return record
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={n_gpus}", "-m", "mace_accel.bench.multi_gpu",
               "--model", model, "--frames", str(frames), "--dtype", dtype]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        record.status = f"failed: did not finish in {timeout_s:.0f} s"
        return record
    return parse_result(done.stdout, done.stderr, done.returncode, record)


def parse_result(stdout: str, stderr: str, returncode: int, record):
    """Fill ``record`` from the result line of a run (or its failure)."""
    line = next((x for x in stdout.splitlines() if x.startswith(RESULT_PREFIX)), None)
    if returncode != 0 or line is None:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        record.status = f"failed (exit {returncode}): {tail[:200]}"
        return record
    result = json.loads(line[len(RESULT_PREFIX):])
    record.atoms, record.seconds = result["atoms"], result["seconds"]
    record.frames_per_s = result["frames"] / result["seconds"]
    record.atoms_per_s = result["atoms"] / result["seconds"]
    record.model_calls = result["calls"]
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mp-medium")
    parser.add_argument("--frames", type=int, default=2000)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    start = time.perf_counter()
    rank, size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    if size > 1:
        dist.init_process_group("nccl")

    from mace_accel.batched import BatchEvaluator
    from mace_accel.bench.backends import resolve_model_source
    from mace_accel.bench.throughput import make_frames
    from mace_accel.runs.distributed import share_frames

    device = torch.device("cuda", local)
    model = resolve_model_source(args.model).load(getattr(torch, args.dtype), device)
    frames = make_frames(model, args.frames, seed=0)
    mine = [frames[i] for i in share_frames([len(a) for a in frames], size)[rank]]
    evaluator = BatchEvaluator(model, device=device, default_dtype=args.dtype,
                               fallback="error", verify=False)
    evaluator.evaluate(frames[:8])  # kernels compiled, memory budget measured
    torch.cuda.synchronize()
    if size > 1:
        dist.barrier()
    setup = time.perf_counter() - start
    t0 = time.perf_counter()
    results = evaluator.evaluate(mine)
    torch.cuda.synchronize()
    if size > 1:
        dist.barrier()
    seconds = time.perf_counter() - t0
    atoms = sum(len(a) for a in frames)
    if rank == 0:
        print(f"multi-gpu {args.model} {args.dtype} {size} GPU(s): {args.frames} frames "
              f"({atoms} atoms) in {seconds:.2f} s = {args.frames / seconds:.1f} frames/s, "
              f"{atoms / seconds:,.0f} atoms/s; rank 0: {len(results)} frames in "
              f"{evaluator.n_calls - 1} calls; set-up {setup:.1f} s", flush=True)
        print(RESULT_PREFIX + json.dumps({"gpus": size, "frames": args.frames, "atoms": atoms,
                                          "seconds": seconds, "calls": evaluator.n_calls - 1}),
              flush=True)
    if size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
