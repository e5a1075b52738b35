"""Whole-model measurements beside ``mace-accel bench`` (GPU machine): one energy + forces call
replayed as a CUDA graph against cuEquivariance and e3nn captured the same way, and torch-sim's
batched MD against torch-sim's own MACE model. Same process, same systems.

    python scripts/bench_model.py graphs [--sizes 256,2048] [--md 256,864] [--serial]
    python scripts/bench_model.py replay [--models mp0-medium,mpa0-medium,mh1 --sizes 256,864]
                                         [--linear-thresholds 65536,262144]
    python scripts/bench_model.py accuracy [--models mh1 --size 6912 --backends e3nn,mace-accel]
    python scripts/bench_model.py torchsim [--systems 64 --atoms 108 --steps 100]
    python scripts/bench_model.py table-walks [--models mpa0-medium,mp0-medium]

``table-walks``: one eager forces call with the radial tables on, their lookups walking the
edges sorted by length where ``patches.radial.table.walks_sorted`` says so (the default) against
walking them as they come, rounds interleaved.

``replay``: mace-accel's call replayed as the calculator's CUDA graph (``GraphedCall``) for
several models in one process, rounds interleaved, each against the first model's time (what
the MD-sized targets compare: MPA-0's and MH-1's call against MP-0's); with
``--linear-thresholds``, each model once per weight count from which its float32 linears run
on the tensor cores (what sets ``gemm.MIN_WEIGHTS_FLOAT32``).

``accuracy``: each backend's float32 energy and forces against e3nn's float64 on the same
weights and structure (the bench checks float32 against e3nn's float32, whose own error grows
with the model and the system: MH-1's at 6,912 atoms is ~1e-5).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Callable, Dict, List

import torch

from mace_accel.bench.backends import prepare_backend, resolve_model_source
from mace_accel.bench.systems import build_system, make_batch
from mace_accel.bench.timing import capture_graph, synchronize, time_calls
from mace_accel.models.batch import model_info

SERIAL = "mace-accel serial"
Call = Callable[[], Dict[str, torch.Tensor]]


def _eager(model, batch) -> Call:
    return lambda: model(dict(batch), training=False, compute_force=True)


def _by_hand(model, batch) -> Call:
    """The whole call captured into one graph as a user would (after three warm-up calls)."""
    call = _eager(model, batch)
    for _ in range(2):
        call()
    graph, out = capture_graph(call)  # the third on a side stream

    def replay():
        graph.replay()
        return out
    return replay


def _accel_graph(model, batch, r_max: float) -> Call:
    from mace_accel.capture import GraphedCall

    graphed = GraphedCall(model, r_max)
    return lambda: graphed(batch, compute_stress=False)


def _serial_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the patched ``model`` with every kernel on the caller's stream, in order
    (linked with ``patches.radial.overlap._OVERLAP`` off): the same kernels without the radial
    MLPs' overlap."""
    from mace_accel.options import AccelOptions
    from mace_accel.patches import link_across_blocks
    from mace_accel.patches.radial import overlap as radial_overlap

    serial = copy.deepcopy(model)
    radial_overlap._OVERLAP = False
    try:
        link_across_blocks(serial, AccelOptions(backend="cuda"))
    finally:
        radial_overlap._OVERLAP = True
    return serial


def _graph_line(row: dict) -> str:
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
    return " ".join(parts)


def _ratio(row: dict, over: str, under: str) -> float | None:
    a, b = row.get(over), row.get(under)
    if isinstance(a, dict) and isinstance(b, dict) and a["graph_ms"] and b["graph_ms"]:
        return a["graph_ms"] / b["graph_ms"]
    return None


def graph_rows(model_name: str, sizes: List[int], dtypes: List[str], repeats: int,
               serial: bool = False) -> List[dict]:
    """Per (dtype, size): eager and graph-replay ms of each backend, the forces' difference to
    e3nn, mace-accel's ratio to cuEquivariance (and to itself without the radial overlap)."""
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
            for key, over, under in (("accel_over_cueq_graph", "mace-accel", "cueq"),
                                     ("overlap_over_serial_graph", "mace-accel", SERIAL)):
                if _ratio(row, over, under) is not None:
                    row[key] = _ratio(row, over, under)
            rows.append(row)
            print(_graph_line(row), flush=True)
    return rows


def md_rows(model_name: str, sizes: List[int], steps: int) -> List[dict]:
    """ASE velocity-Verlet steps/s, float32: MACEAccelCalculator (graphs + resident batch) vs
    mace's MACECalculator with cuEquivariance; ms per step."""
    from mace_accel.bench.md import run_md

    base = resolve_model_source(model_name).load(torch.float32, torch.device("cuda"))
    info = model_info(base)
    rows = []
    for size in sizes:
        atoms = build_system(info, size).atoms
        for backend in ("cueq", "mace-accel"):
            t0 = time.perf_counter()
            rec = run_md(backend, base, atoms, "cuda", model_name, steps=steps, warmup_steps=10)
            rows.append(vars(rec))
            print(f"md {model_name} float32 {len(atoms)} atoms {backend}: "
                  f"{rec.status} {rec.steps_per_s or 0:.1f} steps/s "
                  f"({rec.ms_per_step or 0:.2f} ms/step; set-up+run "
                  f"{time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def graphs(args) -> None:
    out = {"graphs": graph_rows(args.model, args.sizes, args.dtypes, args.repeats, args.serial)
           if args.sizes else []}
    if args.md:
        out["md"] = md_rows(args.model, args.md, args.md_steps)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, default=str)


def replay(args) -> None:
    from mace_accel.ops.irreps_linear import gemm

    models = {}
    thresholds = args.linear_thresholds or [gemm.MIN_WEIGHTS_FLOAT32]
    for name in args.models:
        source = resolve_model_source(name).load(torch.float32, torch.device("cuda"))
        info = model_info(source)
        for weights in thresholds:
            label = name if len(thresholds) == 1 else f"{name} linears>={weights}"
            model = prepare_backend("mace-accel", copy.deepcopy(source), "cuda").model
            models[label] = (model, info, weights)
    default = gemm.MIN_WEIGHTS_FLOAT32
    for size in args.sizes:
        calls = {}
        for name, (model, info, weights) in models.items():
            batch = make_batch(build_system(info, size), info, torch.float32, "cuda")[0]
            calls[name] = _accel_graph(model, batch, info.r_max)
            gemm.MIN_WEIGHTS_FLOAT32 = weights  # read when the graph is captured
            try:
                calls[name]()  # captures
            finally:
                gemm.MIN_WEIGHTS_FLOAT32 = default
        times: Dict[str, List[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                times[name] += list(time_calls(call, "cuda", 3, args.repeats).samples_ms)
        medians = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        base = medians[next(iter(models))]
        print(json.dumps({"atoms": size, "ms": {n: round(m, 3) for n, m in medians.items()},
                          "ratio": {n: round(m / base, 3) for n, m in medians.items()}}),
              flush=True)


def accuracy(args) -> None:
    device = torch.device(args.device)
    for name in args.models:
        results = {}
        for dtype, backends in ((torch.float64, ["e3nn"]), (torch.float32, args.backends)):
            source = resolve_model_source(name).load(dtype, device)
            info = model_info(source)
            batch = make_batch(build_system(info, args.size), info, dtype, args.device)[0]
            for backend in backends:
                prepared = prepare_backend(backend, source, args.device)
                if not prepared.ok:
                    print(json.dumps({"model": name, "backend": prepared.name,
                                      "status": prepared.status}), flush=True)
                    continue
                out = _eager(prepared.model, batch)()
                results[(backend, dtype)] = {k: out[k].detach().double() for k in
                                             ("energy", "forces")}
                prepared = None
        exact = results.pop(("e3nn", torch.float64))
        for (backend, _), out in results.items():
            errors = {k: float((out[k] - exact[k]).norm() / exact[k].norm()) for k in exact}
            print(json.dumps({"model": name, "atoms": args.size, "backend": backend,
                              "dtype": "float32", "vs": "e3nn float64",
                              "rel_err": {k: f"{v:.2e}" for k, v in errors.items()}}),
                  flush=True)


def torchsim(args) -> None:
    """atoms x steps per second of ``ts.integrate(..., integrator=ts.nvt_langevin)`` after a
    warm-up run, and each model's energies against mace-accel's on the first state."""
    import torch_sim as ts
    import torch_sim.models.mace as ts_mace

    from mace_accel.torchsim import AcceleratedMaceModel

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    base = resolve_model_source(args.model).load(dtype, device)
    info = model_info(base)
    systems = [build_system(info, args.atoms, seed=k).atoms for k in range(args.systems)]
    total_atoms = sum(len(a) for a in systems)

    def theirs(cueq: bool):
        model = ts_mace.MaceModel(copy.deepcopy(base), device=device, dtype=dtype,
                                  compute_stress=False, enable_cueq=cueq)
        model.model = model.model.to(device)  # mace's cuEquivariance conversion lands on the CPU
        return model

    def ours(skin: float):
        return AcceleratedMaceModel(copy.deepcopy(base), device=device,
                                    default_dtype=args.dtype, compute_stress=False, skin=skin)

    # skin 0: every system's neighbour list built again each step (what the Verlet lists save)
    makers = {"mace-accel": lambda: ours(0.3), "mace-accel, skin 0": lambda: ours(0.0),
              "torch-sim MaceModel (e3nn)": lambda: theirs(False),
              "torch-sim MaceModel (cueq)": lambda: theirs(True)}
    reference = None
    for name, make in makers.items():
        label = f"torchsim {args.model} {args.dtype} {args.systems}x{args.atoms} atoms, {name}"
        try:
            model = make()
            state = ts.io.atoms_to_state(systems, device, dtype)
            energy = model(state)["energy"].detach()
            reference = energy if reference is None else reference
            kwargs = dict(integrator=ts.nvt_langevin, temperature=300, timestep=0.001)
            ts.integrate(state, model, n_steps=5, **kwargs)  # warm-up (compile, capture)
            synchronize(device)
            t0 = time.perf_counter()
            ts.integrate(state, model, n_steps=args.steps, **kwargs)
            synchronize(device)
            seconds = time.perf_counter() - t0
            print(f"{label}: {total_atoms * args.steps / seconds:,.0f} atom-steps/s "
                  f"({1e3 * seconds / args.steps:.2f} ms/step; energy vs mace-accel "
                  f"{float((energy - reference).abs().max()):.2e} eV)", flush=True)
        except Exception as exc:  # a model that cannot run is reported, the others still run
            print(f"{label}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        finally:
            model = None
            if device.type == "cuda":
                torch.cuda.empty_cache()


# the radial tables' lookups walking the edges sorted by length where walks_sorted says so
# (patches.radial.table.walks_sorted, one sort a call) against walking them as they come
WALKS = ("default", "unsorted")


def table_walks(args) -> None:
    """ms of an eager forces call, each walk of :data:`WALKS` in turn, rounds interleaved; the
    parameters frozen (the tables run only without weight gradients), default options."""
    from mace_accel.models.architectures import build_architecture
    from mace_accel.models.outputs import evaluate
    from mace_accel.patches.radial import table as table_patch
    from mace_accel.patches.radial.mlp import FusedRadialMLP
    from mace_accel.surgery import accelerate

    walks_sorted = table_patch.walks_sorted

    def route_of(model) -> str:
        route = next(m._kernels["route"] for m in model.modules()
                     if isinstance(m, FusedRadialMLP) and "route" in m._kernels)
        return route.path

    try:
        for name in args.models:
            for dtype_name in args.dtypes:
                dtype = getattr(torch, dtype_name)
                model = build_architecture(name, dtype=dtype, device="cuda")
                accelerate(model, verify=False)
                for p in model.parameters():  # inference: the tables run without weight grads
                    p.requires_grad_(False)
                info = model_info(model)
                for size in args.sizes:
                    batch, edges = make_batch(build_system(info, size), info, dtype, "cuda")
                    times: Dict[str, List[float]] = {w: [] for w in WALKS}
                    taken = {}
                    for rounds in (1, args.rounds):  # the first compiles and warms up
                        for _ in range(rounds):
                            for label in WALKS:
                                table_patch.walks_sorted = ((lambda *a: False)
                                                            if label == "unsorted"
                                                            else walks_sorted)
                                ms = time_calls(lambda: evaluate(model, dict(batch), False),
                                                "cuda", 1, args.repeats).samples_ms
                                taken[label] = route_of(model)
                                if rounds > 1:
                                    times[label] += list(ms)
                    medians = {w: round(sorted(t)[len(t) // 2], 3) for w, t in times.items()}
                    print(json.dumps({"model": name, "dtype": dtype_name, "atoms": size,
                                      "edges": edges, "ms": medians, "routes": taken}),
                          flush=True)
                model = None
                torch.cuda.empty_cache()
    finally:
        table_patch.walks_sorted = walks_sorted


def main(argv=None) -> None:
    def csv(item):
        return lambda text: [item(t) for t in text.split(",") if t]

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    g = modes.add_parser("graphs", help="one call in a CUDA graph against cuEquivariance, e3nn")
    g.add_argument("--sizes", type=csv(int), default="256,2048", help="atom counts")
    g.add_argument("--dtypes", type=csv(str), default="float32,float64")
    g.add_argument("--md", type=csv(int), default="", help="atom counts for ASE MD (none)")
    g.add_argument("--md-steps", type=int, default=50)
    g.add_argument("--serial", action="store_true",
                   help="also time mace-accel without the radial MLPs' overlap")
    g.add_argument("--json", help="also write the rows to this file")
    t = modes.add_parser("torchsim", help="torch-sim batched NVT: AcceleratedMaceModel (Verlet "
                                          "skin 0.3 and 0) against torch-sim's MaceModel "
                                          "(e3nn, cuEquivariance)")
    t.add_argument("--systems", type=int, default=64)
    t.add_argument("--atoms", type=int, default=108)
    t.add_argument("--steps", type=int, default=100)
    t.add_argument("--dtype", default="float32")
    t.add_argument("--device", default="cuda")
    r = modes.add_parser("table-walks", help="the radial tables' lookups walking the edges "
                                             "sorted by length against as they come")
    r.add_argument("--models", type=csv(str), default="mpa0-medium,mp0-medium")
    r.add_argument("--dtypes", type=csv(str), default="float32,float64")
    r.add_argument("--sizes", type=csv(int), default="1024,6912", help="atom counts")
    r.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default: 4)")
    r.add_argument("--repeats", type=int, default=6, help="calls a walk per round")
    p = modes.add_parser("replay", help="several models' calls in CUDA graphs, one process")
    p.add_argument("--models", type=csv(str), default="mp0-medium,mpa0-medium,mh1")
    p.add_argument("--sizes", type=csv(int), default="256,864", help="atom counts")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default: 4)")
    p.add_argument("--repeats", type=int, default=15, help="replays a model per round")
    p.add_argument("--linear-thresholds", type=csv(int), default="",
                   help="time each model with its float32 linears on the tensor cores from each "
                        "of these weight counts (gemm.MIN_WEIGHTS_FLOAT32; default: as set)")
    a = modes.add_parser("accuracy", help="float32 energy and forces against e3nn float64")
    a.add_argument("--models", type=csv(str), default="mh1")
    a.add_argument("--size", type=int, default=6912, help="atoms")
    a.add_argument("--backends", type=csv(str), default="e3nn,mace-accel")
    a.add_argument("--device", default="cuda")
    for sub in (g, t):
        sub.add_argument("--model", default="mp-medium")
    g.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    {"graphs": graphs, "torchsim": torchsim, "table-walks": table_walks,
     "replay": replay, "accuracy": accuracy}[args.mode](args)


if __name__ == "__main__":
    main()
