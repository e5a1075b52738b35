"""Which aten ops (with input shapes) launch the most CUDA time in one energy+forces call of the
accelerated model (GPU machine): ``python scripts/op_shapes.py --size 6912 --top 45``."""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from mace_accel.bench.backends import prepare_backend, resolve_model_source
from mace_accel.bench.systems import build_system, make_batch
from mace_accel.models.batch import model_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mp-medium")
    parser.add_argument("--size", type=int, default=6912)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--top", type=int, default=45)
    args = parser.parse_args()
    dtype, device = getattr(torch, args.dtype), torch.device("cuda")
    source = resolve_model_source(args.model).load(dtype, device)
    info = model_info(source)
    batch, n_edges = make_batch(build_system(info, args.size), info, dtype, device)
    model = prepare_backend("mace-accel", source, device).model

    def call():
        b = dict(batch)
        b["positions"] = batch["positions"].detach().clone().requires_grad_(True)
        return model(b, compute_force=True, training=False)["forces"]

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        call()
        torch.cuda.synchronize()
    print(f"{args.size} atoms, {n_edges} edges")
    rows = [r for r in prof.key_averages(group_by_input_shape=True)
            if r.key.startswith("aten::") and r.self_device_time_total > 0]
    rows.sort(key=lambda r: -r.self_device_time_total)
    for r in rows[:args.top]:
        print(f"{r.self_device_time_total / 1e3:8.3f} ms {r.count:4d}x {r.key:28s} "
              f"{str(r.input_shapes)[:110]}")


if __name__ == "__main__":
    main()
