"""One energy+forces call inside a CUDA graph: mace-accel's GraphedCall vs cuEquivariance (and
e3nn) captured by hand the same way, same process, same batch; plus ASE MD steps/s.

    python scripts/bench_graphs.py --sizes 256,2048 --dtypes float32,float64 --md 256,864

Per (dtype, size): eager ms, graph-replay ms (median of CUDA-event-timed replays after warm-up)
for each backend, the forces' difference to e3nn, and mace-accel's ratio to cuEquivariance.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Callable, Dict, List, Sequence

import torch

from mace_accel.bench.backends import prepare_backend, resolve_model_source
from mace_accel.bench.systems import build_system, make_batch
from mace_accel.bench.timing import time_calls
from mace_accel.models.batch import model_info

SERIAL = "mace-accel serial"


def _eager(model, batch) -> Callable[[], Dict[str, torch.Tensor]]:
    return lambda: model(dict(batch), training=False, compute_force=True)


def _by_hand(model, batch) -> Callable[[], Dict[str, torch.Tensor]]:
    """The whole call captured into one graph as a user would (warm-up on a side stream)."""
    fn = _eager(model, batch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out
    return replay


def _accel_graph(model, batch, r_max) -> Callable[[], Dict[str, torch.Tensor]]:
    from mace_accel.capture import GraphedCall

    graphed = GraphedCall(model, r_max)
    return lambda: graphed(batch, compute_stress=False)


def _serial_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the patched ``model`` with every kernel on the caller's stream, in order
    (``overlap_radial=False``): the same kernels without the radial MLPs' overlap."""
    from mace_accel.options import AccelOptions
    from mace_accel.patches import link_across_blocks

    serial = copy.deepcopy(model)
    link_across_blocks(serial, AccelOptions(backend="cuda", overlap_radial=False))
    return serial


def _share_rows(model, batch, r_max, shares: List[str], repeats: int) -> Dict[str, float]:
    """mace-accel's graph captured again with each share of the GPU the later blocks' forked
    radial MLPs may hold (``patches.radial_overlap.LATER_SM_SHARE``; ``"F/B"`` also sets their
    backward's, ``LATER_BACKWARD_SM_SHARE``, else the same; 1: all), at any edge count (the
    model applies them only up to ``SHARE_MAX_EDGES``): ms per replay."""
    from mace_accel.patches import radial_overlap

    keep = (radial_overlap.LATER_SM_SHARE, radial_overlap.LATER_BACKWARD_SM_SHARE,
            radial_overlap.SHARE_MAX_EDGES)
    out = {}
    try:
        radial_overlap.SHARE_MAX_EDGES = 2**62  # the share asked for at every size
        for share in shares:
            forward, _, backward = share.partition("/")
            values = [None if float(v) >= 1 else float(v) for v in (forward, backward or forward)]
            radial_overlap.LATER_SM_SHARE, radial_overlap.LATER_BACKWARD_SM_SHARE = values
            out[f"share {share}"] = time_calls(_accel_graph(model, batch, r_max), "cuda", 3,
                                               repeats).median_ms
    finally:
        (radial_overlap.LATER_SM_SHARE, radial_overlap.LATER_BACKWARD_SM_SHARE,
         radial_overlap.SHARE_MAX_EDGES) = keep
    return out


def run(model_name: str, sizes: List[int], dtypes: List[str], repeats: int,
        serial: bool = False, shares: Sequence[str] = ()) -> List[dict]:
    source = resolve_model_source(model_name)
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        base = source.load(dtype, torch.device("cuda"))
        info = model_info(base)
        models = {}
        for backend in ("e3nn", "cueq", "mace-accel"):
            prepared = prepare_backend(backend, base, "cuda")
            models[backend] = prepared.model if prepared.status == "ok" else prepared.status
        if serial and not isinstance(models["mace-accel"], str):
            models[SERIAL] = _serial_copy(models["mace-accel"])
        for size in sizes:
            system = build_system(info, size)
            batch, n_edges = make_batch(system, info, dtype, "cuda")
            row = {"model": model_name, "dtype": dtype_name, "atoms": len(system.atoms),
                   "edges": n_edges}
            want = _eager(models["e3nn"], batch)()["forces"].detach()
            for backend, model in models.items():
                if isinstance(model, str):
                    row[backend] = model
                    continue
                eager = time_calls(_eager(model, batch), "cuda", 3, repeats).median_ms
                try:
                    replay = (_accel_graph(model, batch, info.r_max)
                              if backend.startswith("mace-accel") else _by_hand(model, batch))
                    got = replay()["forces"].detach()
                    graph_ms = time_calls(replay, "cuda", 3, repeats).median_ms
                    err = ((got - want).norm() / want.norm()).item()
                except Exception as exc:  # a backend that cannot be captured is reported
                    graph_ms, err = None, f"{type(exc).__name__}: {exc}"[:120]
                row[backend] = {"eager_ms": eager, "graph_ms": graph_ms, "forces_err": err}
                torch.cuda.synchronize()
            if shares and not isinstance(models["mace-accel"], str):
                row["shares_graph_ms"] = _share_rows(models["mace-accel"], batch, info.r_max,
                                                     list(shares), repeats)
            accel, cueq = row.get("mace-accel"), row.get("cueq")
            if isinstance(accel, dict) and isinstance(cueq, dict) and accel["graph_ms"] \
                    and cueq["graph_ms"]:
                row["accel_over_cueq_graph"] = accel["graph_ms"] / cueq["graph_ms"]
            plain = row.get(SERIAL)
            if isinstance(accel, dict) and isinstance(plain, dict) and accel["graph_ms"] \
                    and plain["graph_ms"]:
                row["overlap_over_serial_graph"] = accel["graph_ms"] / plain["graph_ms"]
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def _line(row: dict) -> str:
    parts = [f"graph {row['model']} {row['dtype']} {row['atoms']} atoms {row['edges']} edges:"]
    for backend in ("e3nn", "cueq", "mace-accel", SERIAL):
        r = row.get(backend)
        if isinstance(r, dict):
            g = f"{r['graph_ms']:.3f}" if r["graph_ms"] else "n/a"
            e = r["forces_err"] if isinstance(r["forces_err"], str) else f"{r['forces_err']:.1e}"
            parts.append(f"{backend} eager {r['eager_ms']:.2f} graph {g} ms (F err {e});")
        elif r is not None:
            parts.append(f"{backend}: {r};")
    if "accel_over_cueq_graph" in row:
        parts.append(f"mace-accel/cueq in graphs = {row['accel_over_cueq_graph']:.2f}")
    if "overlap_over_serial_graph" in row:
        parts.append(f"; with/without the radial overlap = "
                     f"{row['overlap_over_serial_graph']:.3f}")
    for name, ms in row.get("shares_graph_ms", {}).items():
        parts.append(f"; later radial MLPs' {name}: graph {ms:.3f} ms")
    return " ".join(parts)


def md(model_name: str, sizes: List[int], dtypes: List[str], steps: int) -> List[dict]:
    """ASE velocity-Verlet steps/s: MACEAccelCalculator (graphs + resident batch) vs mace's
    MACECalculator with cuEquivariance; ms per step split into model and the rest."""
    from mace_accel.bench.md import run_md

    source = resolve_model_source(model_name)
    rows = []
    for dtype_name in dtypes:
        base = source.load(getattr(torch, dtype_name), torch.device("cuda"))
        info = model_info(base)
        for size in sizes:
            atoms = build_system(info, size).atoms
            for backend in ("cueq", "mace-accel"):
                t0 = time.perf_counter()
                rec = run_md(backend, base, atoms, "cuda", model_name, steps=steps,
                             warmup_steps=10)
                rows.append(vars(rec))
                print(f"md {model_name} {dtype_name} {len(atoms)} atoms {backend}: "
                      f"{rec.status} {rec.steps_per_s or 0:.1f} steps/s "
                      f"({rec.ms_per_step or 0:.2f} ms/step; set-up+run "
                      f"{time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mp-medium")
    parser.add_argument("--sizes", default="256,2048")
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--md", default="", help="atom counts for ASE MD (empty: none)")
    parser.add_argument("--md-steps", type=int, default=50)
    parser.add_argument("--json", default=None)
    parser.add_argument("--serial", action="store_true",
                        help="also time mace-accel without the radial MLPs' overlap")
    parser.add_argument("--shares", default="",
                        help="also time mace-accel's graph captured with each of these shares "
                        "of the GPU for the later blocks' radial MLPs (e.g. 1,0.5,0.25; "
                        "FORWARD/BACKWARD sets the backward kernel's apart, e.g. 0.5/1)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    dtypes = args.dtypes.split(",")
    shares = [s for s in args.shares.split(",") if s]
    out = {"graphs": run(args.model, sizes, dtypes, args.repeats, args.serial, shares)
           if sizes else []}
    if args.md:
        out["md"] = md(args.model, [int(s) for s in args.md.split(",")], ["float32"],
                       args.md_steps)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
