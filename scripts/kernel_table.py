"""The CUDA kernels of one energy+forces call, most time first, per backend (GPU machine).

    python scripts/kernel_table.py --model mp-medium --size 6912 --dtype float32 \
        --backends mace-accel,cueq --top 30

Per backend: the call's median time (CUDA events, after warm-up), then one profiled call: its
kernels grouped by family (cuBLAS GEMM, our generated kernels by name, torch elementwise /
reduction / indexing) and the ``--top`` kernels by self CUDA time. ``--ops N`` also lists the N
(op, origin) pairs that launch most of torch's own kernels (the glue between ours): the origin
is the autograd node for the backward, else the innermost mace-accel / mace source line.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from typing import Dict, List, Tuple

import torch

from mace_accel.bench.backends import prepare_backend, resolve_model_source
from mace_accel.bench.systems import build_system, make_batch
from mace_accel.bench.timing import time_calls
from mace_accel.models.batch import model_info
from mace_accel.models.outputs import evaluate as evaluate_model

FAMILIES: List[Tuple[str, str]] = [
    (r"^mace_(tf32x3_gemm|radial_tc)", "radial MLP (ours, 3xTF32)"),
    (r"gemm|gemv|cutlass|xmma|sgemm|dgemm", "GEMM (cuBLAS)"),
    (r"^mace_conv", "conv (ours)"),
    (r"^mace_sc|symmetric", "symmetric contraction (ours)"),
    (r"^mace_(sh|radial|edge)", "edge features (ours)"),
    (r"^mace_linear", "linears (ours)"),
    (r"^mace_", "other generated (ours)"),
    (r"scatter|index|gather", "index/scatter"),
    (r"reduce|scan|sum", "reductions"),
    (r"elementwise|Fill|copy", "elementwise"),
]
# the families of torch's own kernels (the glue between ours and cuBLAS's); a new family of
# ours needs no entry here
GLUE = ("index/scatter", "reductions", "elementwise", "other")


def family(name: str) -> str:
    for pattern, label in FAMILIES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return label
    return "other"


def _origin(event) -> str:
    """The autograd node or the innermost mace-accel / mace frame ``event`` runs under."""
    node = event
    while node is not None:
        if node.name.startswith("autograd::engine::evaluate_function: "):
            return node.name.split(": ", 1)[1]
        for frame in node.stack or ():
            if "mace_accel" in frame or "/patches/" in frame or "/mace/" in frame:
                return frame.rsplit("/", 1)[-1][:70]
        node = node.cpu_parent
    return "?"


def glue_table(model_call, ops: int) -> None:
    """The ``ops`` (op, origin) pairs that launch most torch kernels in one call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                 record_shapes=True) as prof:
        model_call()
        torch.cuda.synchronize()
    counts: Dict[Tuple[str, str], List[float]] = defaultdict(lambda: [0, 0.0])
    shapes: Dict[Tuple[str, str], str] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or not e.kernels:
            continue
        torch_kernels = [k for k in e.kernels if family(k.name) in GLUE]
        if not torch_kernels:
            continue
        key = (e.name, _origin(e))
        shapes.setdefault(key, str(e.input_shapes)[:60])
        c = counts[key]
        c[0] += len(torch_kernels)
        c[1] += sum(k.duration for k in torch_kernels) / 1e3
    total = sum(c[0] for c in counts.values())
    print(f"   -- torch glue: {total} kernels; by op and origin")
    for (name, origin), (n, ms) in sorted(counts.items(), key=lambda kv: -kv[1][0])[:ops]:
        print(f"   {n:4d} kernels {ms:7.3f} ms  {name[:28]:28s} {origin[:60]:60s} "
              f"{shapes[(name, origin)]}")


def table(backend: str, model, batch: Dict[str, torch.Tensor], top: int, ops: int = 0) -> None:
    from torch.profiler import ProfilerActivity, profile

    def call():
        b = dict(batch)
        b["positions"] = batch["positions"].detach().clone().requires_grad_(True)
        if backend == "mace-accel":  # as the calculator, graphs and runs call it
            return evaluate_model(model, b, False)["forces"]
        return model(b, compute_force=True, training=False)["forces"]

    median = time_calls(call, "cuda", 5, 20).median_ms
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels) / 1e3
    groups: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
    per_name: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        g = groups[family(e.name)]
        g[0] += e.device_time / 1e3
        g[1] += 1
        n = per_name[e.name]
        n[0] += e.device_time / 1e3
        n[1] += 1
    print(f"== {backend}: median {median:.2f} ms per call; one profiled call: {len(kernels)} "
          f"kernels, {total:.2f} ms of kernel time", flush=True)
    for label, (ms, count) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"   {label:32s} {ms:8.3f} ms {100 * ms / total:5.1f}% {count:5d} kernels")
    print("   -- top kernels")
    for name, (ms, count) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"   {ms:8.3f} ms {count:4d}x  {name[:110]}")
    if ops:
        glue_table(call, ops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mp-medium")
    parser.add_argument("--size", type=int, default=6912)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--backends", default="mace-accel,cueq")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--ops", type=int, default=0,
                        help="also list the N ops launching most torch kernels, with origin")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    source = resolve_model_source(args.model).load(dtype, device)
    info = model_info(source)
    batch, n_edges = make_batch(build_system(info, args.size), info, dtype, device)
    print(f"{args.model} {args.dtype}: {args.size} atoms, {n_edges} edges", flush=True)
    for backend in args.backends.split(","):
        prepared = prepare_backend(backend, source, device)
        if not prepared.ok:
            print(f"== {backend}: {prepared.status}")
            continue
        table(prepared.name, prepared.model, batch, args.top, args.ops)
        del prepared
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
