"""Where the time goes (GPU machine), beside ``mace-accel bench --profile``'s split by part.

    python scripts/profile_gpu.py md [--sizes 256,864 --steps 200 --serial]
    python scripts/profile_gpu.py kernels [--size 6912 --backends mace-accel,cueq --ops 20]
    python scripts/profile_gpu.py timeline [--size 256 --gaps 25]

md: steps/s of ASE velocity Verlet with MACEAccelCalculator; the calculator's own split
(checks, neighbour list, model incl. the results' copy); the bare graph replay of the same call
(with and without stress); the 25 functions with the most own time under cProfile (--serial:
instead the same without the radial MLPs' overlap, one after the other).

kernels: per backend, one energy + forces call's median time, then one profiled call: its CUDA
kernels grouped by family (cuBLAS GEMM, ours by name, torch elementwise / reduction / indexing)
and the --top kernels by self time; --ops N also lists the N (op, origin) pairs that launch
most of torch's own kernels (the glue between ours: the autograd node in the backward, else
the innermost mace-accel / mace source line).

timeline: the kernels of replays of mace-accel's CUDA graph of one call as the profiler (CUPTI)
sees them, per stream: each replay's span, busy and idle time, then the last replay's kernels
in start order with the gap before each, and the largest gaps. Several replays are told apart
by their largest gaps (a rough split: one replay, the default, is the exact picture).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import re
import time
from collections import defaultdict
from typing import Dict, List, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

from mace_accel.bench.backends import prepare_backend, resolve_model_source
from mace_accel.bench.systems import build_system, make_batch
from mace_accel.bench.timing import time_calls
from mace_accel.models.batch import model_info
from mace_accel.models.outputs import evaluate as evaluate_model


def _model_and_batch(args, size: int) -> tuple:
    """``(model as loaded, its ModelInfo, batch, edges)`` of ``args.model`` at ``size`` atoms."""
    dtype = getattr(torch, args.dtype)
    model = resolve_model_source(args.model).load(dtype, torch.device("cuda"))
    info = model_info(model)
    batch, n_edges = make_batch(build_system(info, size), info, dtype, "cuda")
    return model, info, batch, n_edges


# ---------------------------------------------------------------------------------------------
# md

def md_profile(args, size: int, overlap: bool, cprofile: bool) -> None:
    """One size; ``overlap=False``: the model linked with ``patches.radial.overlap._OVERLAP``
    off (every kernel on the caller's stream, in order)."""
    from mace_accel.patches.radial import overlap as radial_overlap

    radial_overlap._OVERLAP = overlap
    try:
        _md_profile(args, size, overlap, cprofile)
    finally:
        radial_overlap._OVERLAP = True


def _md_profile(args, size: int, overlap: bool, cprofile: bool) -> None:
    from ase import units
    from ase.md.verlet import VelocityVerlet

    from mace_accel.bench.md import _thermalize
    from mace_accel.calculator import CallTimings, MACEAccelCalculator

    model = resolve_model_source(args.model).load(getattr(torch, args.dtype),
                                                  torch.device("cuda"))
    atoms = build_system(model_info(model), size).atoms
    _thermalize(atoms, 300.0, 0)
    calc = MACEAccelCalculator(model, device="cuda", default_dtype=args.dtype)
    atoms.calc = calc
    dyn = VelocityVerlet(atoms, timestep=1.0 * units.fs)
    dyn.run(20)  # captures, compiles
    calc.timings = CallTimings()
    builds = calc._resident.neighbours.n_builds
    t0 = time.perf_counter()
    dyn.run(args.steps)
    wall = time.perf_counter() - t0
    split = calc.timings.per_call_ms()
    print(f"{args.model} {args.dtype} {len(atoms)} atoms{'' if overlap else ' (serial)'}: "
          f"{args.steps / wall:.1f} steps/s, {1e3 * wall / args.steps:.2f} ms/step; calculator "
          "per call: " + ", ".join(f"{k} {v:.3f} ms" for k, v in split.items())
          + f"; calls/step {calc.timings.calls / args.steps:.2f}; list rebuilds "
          f"{calc._resident.neighbours.n_builds - builds}; graphs {calc._graphed.buckets}",
          flush=True)
    batch = calc._resident.batch(atoms)
    for stress in (False, True):
        ms = time_calls(lambda: calc._graphed(batch, compute_stress=stress), "cuda", 5,
                        50).median_ms
        print(f"   bare graph replay (stress={stress}): {ms:.3f} ms", flush=True)
    if cprofile:
        prof = cProfile.Profile()
        prof.enable()
        dyn.run(min(args.steps, 100))
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue()[-6000:], flush=True)


def md(args) -> None:
    for size in args.sizes:
        md_profile(args, size, overlap=True, cprofile=not args.serial)
        if args.serial:
            md_profile(args, size, overlap=False, cprofile=False)


# ---------------------------------------------------------------------------------------------
# kernels

FAMILIES: List[Tuple[str, str]] = [
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
    return next((label for pattern, label in FAMILIES
                 if re.search(pattern, name, flags=re.IGNORECASE)), "other")


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


def _glue_table(call, ops: int) -> None:
    """The ``ops`` (op, origin) pairs that launch most torch kernels in one call."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                 record_shapes=True) as prof:
        call()
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
        counts[key][0] += len(torch_kernels)
        counts[key][1] += sum(k.duration for k in torch_kernels) / 1e3
    print(f"   -- torch glue: {sum(c[0] for c in counts.values())} kernels; by op and origin")
    for (name, origin), (n, ms) in sorted(counts.items(), key=lambda kv: -kv[1][0])[:ops]:
        print(f"   {n:4d} kernels {ms:7.3f} ms  {name[:28]:28s} {origin[:60]:60s} "
              f"{shapes[(name, origin)]}")


def _kernel_table(backend: str, model, batch: Dict[str, torch.Tensor], args) -> None:
    def call():
        b = dict(batch)
        b["positions"] = batch["positions"].detach().clone().requires_grad_(True)
        if backend == "mace-accel":  # as the calculator, graphs and runs call it
            return evaluate_model(model, b, args.stress)["forces"]
        return model(b, compute_force=True, compute_stress=args.stress,
                     training=False)["forces"]

    median = time_calls(call, "cuda", 5, 20).median_ms
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels) / 1e3
    groups: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
    per_name: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        for tally in (groups[family(e.name)], per_name[e.name]):
            tally[0] += e.device_time / 1e3
            tally[1] += 1
    print(f"== {backend}{' with stress' if args.stress else ''}: median {median:.2f} ms per "
          f"call; one profiled call: {len(kernels)} kernels, {total:.2f} ms of kernel time",
          flush=True)
    for label, (ms, count) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"   {label:32s} {ms:8.3f} ms {100 * ms / total:5.1f}% {count:5d} kernels")
    print("   -- top kernels")
    for name, (ms, count) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"   {ms:8.3f} ms {count:4d}x  {name[:110]}")
    if args.ops:
        _glue_table(call, args.ops)


def kernels(args) -> None:
    source, _, batch, n_edges = _model_and_batch(args, args.size)
    print(f"{args.model} {args.dtype}: {args.size} atoms, {n_edges} edges", flush=True)
    for backend in args.backends.split(","):
        prepared = prepare_backend(backend, source, "cuda")
        if not prepared.ok:
            print(f"== {backend}: {prepared.status}")
            continue
        _kernel_table(prepared.name, prepared.model, batch, args)
        del prepared
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# timeline

Kernel = Tuple[float, float, int, str]  # start us, end us, stream, name


def _replays(kernels: List[Kernel], n: int) -> List[List[Kernel]]:
    """Split the kernels into ``n`` replays at the ``n - 1`` largest gaps."""
    if n <= 1 or len(kernels) < n:
        return [kernels]
    gaps = sorted(range(1, len(kernels)),
                  key=lambda i: kernels[i][0] - max(k[1] for k in kernels[:i]))[-(n - 1):]
    cuts = [0] + sorted(gaps) + [len(kernels)]
    return [kernels[a:b] for a, b in zip(cuts, cuts[1:])]


def _busy(kernels: List[Kernel]) -> float:
    """Microseconds covered by at least one kernel."""
    total, end = 0.0, float("-inf")
    for start, stop, _, _ in kernels:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def timeline(args) -> None:
    from mace_accel.capture import GraphedCall

    source, info, batch, n_edges = _model_and_batch(args, args.size)
    graphed = GraphedCall(prepare_backend("mace-accel", source, "cuda").model, info.r_max)
    for _ in range(5):
        graphed(batch, compute_stress=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.replays):
            graphed(batch, compute_stress=False)
            torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end,
                      int(getattr(e, "device_resource_id", 0) or 0), e.name)
                     for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA
                     and e.time_range.elapsed_us() > 0
                     and not e.name.startswith(("Memcpy", "Memset")))
    print(f"{args.model} {args.dtype} {args.size} atoms, {n_edges} edges: {len(kernels)} "
          f"kernels in {args.replays} replays")
    if not kernels:
        print("no kernels seen inside the graph replays (CUPTI does not report them here)")
        return
    for i, rep in enumerate(_replays(kernels, args.replays)):
        span, busy = max(k[1] for k in rep) - rep[0][0], _busy(rep)
        per_stream = ", ".join(
            f"stream {s}: {sum(k[1] - k[0] for k in rep if k[2] == s):.1f} us "
            f"({sum(1 for k in rep if k[2] == s)} kernels)" for s in sorted({k[2] for k in rep}))
        print(f"replay {i}: {len(rep)} kernels, span {span:.1f} us, busy {busy:.1f} us, "
              f"idle {span - busy:.1f} us; {per_stream}")
    rep = _replays(kernels, args.replays)[-1]
    t0, end, rows = rep[0][0], rep[0][0], []
    for start, stop, stream, name in rep:
        rows.append((start - end, start - t0, stop - start, stream, name))
        end = max(end, stop)
    print("\n  gap us   at us  dur us  stream  kernel (last replay, start order)")
    for gap, at, dur, stream, name in rows:
        print(f"  {gap:6.1f} {at:7.1f} {dur:7.1f}  {stream:6d}  {name[:90]}")
    print(f"\nlargest {args.gaps} gaps (no kernel running), with the kernel after each:")
    for gap, at, dur, stream, name in sorted(rows, key=lambda r: -r[0])[:args.gaps]:
        print(f"  {gap:6.1f} us before {name[:80]} (at {at:.1f} us)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    m = modes.add_parser("md", help="an ASE MD step of MACEAccelCalculator")
    m.add_argument("--sizes", type=lambda t: [int(v) for v in t.split(",")], default="256,864")
    m.add_argument("--steps", type=int, default=200)
    m.add_argument("--serial", action="store_true",
                   help="also run without the radial MLPs' overlap (no cProfile tables)")
    k = modes.add_parser("kernels", help="the CUDA kernels of one call, per backend")
    k.add_argument("--size", type=int, default=6912)
    k.add_argument("--backends", default="mace-accel,cueq")
    k.add_argument("--top", type=int, default=30)
    k.add_argument("--ops", type=int, default=0,
                   help="also list the N ops launching most torch kernels, with origin")
    k.add_argument("--stress", action="store_true", help="the call computes the stress too")
    t = modes.add_parser("timeline", help="the kernels of a replayed CUDA graph, with gaps")
    t.add_argument("--size", type=int, default=256)
    t.add_argument("--replays", type=int, default=1)
    t.add_argument("--gaps", type=int, default=25, help="largest gaps to list")
    for sub in (m, k, t):
        sub.add_argument("--model", default="mp-medium")
        sub.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    {"md": md, "kernels": kernels, "timeline": timeline}[args.mode](args)


if __name__ == "__main__":
    main()
