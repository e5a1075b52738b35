"""Where a replayed CUDA graph of one energy+forces call spends its time: the kernels of a few
replays as the profiler (CUPTI) sees them, on each stream, and the idle gaps of the call.

    python scripts/graph_timeline.py --size 256 --replays 1 --gaps 25

Prints, per replay (several replays are told apart by their largest gaps: a rough split, so
one replay, the default, is the exact picture): its span (first kernel start to last kernel end), the busy time (union of
kernel intervals over all streams), the kernel time on each stream, and the time no kernel runs;
then, for the last replay, every kernel in start order with its gap before it, and the largest
gaps with the kernels around them. Kernels inside a graph replay are reported by CUPTI on
recent drivers; if none are seen, it says so.
"""

from __future__ import annotations

import argparse
from typing import List, Tuple

import torch

from mace_accel.bench.backends import prepare_backend, resolve_model_source
from mace_accel.bench.systems import build_system, make_batch
from mace_accel.capture import GraphedCall
from mace_accel.models.batch import model_info

Kernel = Tuple[float, float, int, str]  # start us, end us, stream, name


def _kernels(prof) -> List[Kernel]:
    out = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.time_range.elapsed_us() <= 0:
            continue
        name = e.name
        if name.startswith(("Memcpy", "Memset")):
            continue
        out.append((e.time_range.start, e.time_range.end, int(getattr(e, "device_resource_id", 0)
                                                                  or 0), name))
    return sorted(out)


def _replays(kernels: List[Kernel], n: int) -> List[List[Kernel]]:
    """Split the kernels into ``n`` replays at the ``n - 1`` largest gaps."""
    if n <= 1 or len(kernels) < n:
        return [kernels]
    gaps = sorted(range(1, len(kernels)),
                  key=lambda i: kernels[i][0] - max(k[1] for k in kernels[:i]))[-(n - 1):]
    cuts = [0] + sorted(gaps) + [len(kernels)]
    return [kernels[a:b] for a, b in zip(cuts, cuts[1:])]


def _busy(kernels: List[Kernel]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop, _, _ in kernels:
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mp-medium")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--replays", type=int, default=1)
    parser.add_argument("--gaps", type=int, default=25, help="largest gaps to list")
    args = parser.parse_args()
    from torch.profiler import ProfilerActivity, profile

    dtype, device = getattr(torch, args.dtype), torch.device("cuda")
    model = resolve_model_source(args.model).load(dtype, device)
    info = model_info(model)
    batch, n_edges = make_batch(build_system(info, args.size), info, dtype, device)
    prepared = prepare_backend("mace-accel", model, device)
    graphed = GraphedCall(prepared.model, info.r_max)
    for _ in range(5):
        graphed(batch, compute_stress=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.replays):
            graphed(batch, compute_stress=False)
            torch.cuda.synchronize()
    kernels = _kernels(prof)
    print(f"{args.model} {args.dtype} {args.size} atoms, {n_edges} edges: {len(kernels)} kernels "
          f"in {args.replays} replays")
    if not kernels:
        print("no kernels seen inside the graph replays (CUPTI does not report them here)")
        return
    for i, rep in enumerate(_replays(kernels, args.replays)):
        span = max(k[1] for k in rep) - rep[0][0]
        busy = _busy(rep)
        streams = sorted({k[2] for k in rep})
        per_stream = ", ".join(
            f"stream {s}: {sum(k[1] - k[0] for k in rep if k[2] == s):.1f} us "
            f"({sum(1 for k in rep if k[2] == s)} kernels)" for s in streams)
        print(f"replay {i}: {len(rep)} kernels, span {span:.1f} us, busy {busy:.1f} us, "
              f"idle {span - busy:.1f} us; {per_stream}")
    rep = _replays(kernels, args.replays)[-1]
    t0, end = rep[0][0], rep[0][0]
    rows = []
    for start, stop, stream, name in rep:
        rows.append((start - end, start - t0, stop - start, stream, name))
        end = max(end, stop)
    print("\n  gap us   at us  dur us  stream  kernel (last replay, start order)")
    for gap, at, dur, stream, name in rows:
        print(f"  {gap:6.1f} {at:7.1f} {dur:7.1f}  {stream:6d}  {name[:90]}")
    print(f"\nlargest {args.gaps} gaps (no kernel running), with the kernel after each:")
    for gap, at, dur, stream, name in sorted(rows, key=lambda r: -r[0])[:args.gaps]:
        print(f"  {gap:6.1f} us before {name[:80]} (at {at:.1f} us)")


if __name__ == "__main__":
    main()
