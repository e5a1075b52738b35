"""Fused conv TP kernel alone: mace-accel vs OpenEquivariance vs cuEquivariance vs e3nn.

The MACE-MP-0 medium layer-2 problem (128x0e+128x1o x sh(3) -> 10 paths) on the real graph of
a 6,912-atom fcc Cu supercell at r_max = 6 A (~539k edges), fp32 and fp64, forward and
forward+backward (gradients to node_feats, edge_attrs and tp_weights), side by side in one
process on the same inputs; CUDA events, warm-up, median. Also the fraction of the HBM roofline
(fewest bytes / time, against a device-to-device copy measured in the same process).

Two more rows time the conv with the radial MLP's last layer (hidden 64 -> weight_numel) in
front, as a patched model runs it: ``mace-accel+last layer`` keeps the per-edge TP weights for
the backward, ``mace-accel folded`` recomputes them chunk by chunk
(:mod:`mace_accel.ops.conv_tp.folded`); ``kept MB`` is what each keeps alive for the backward
beyond its inputs (the bytes the fold saves).

    python scripts/bench_conv_kernel.py [--json out.json] [--problem mp-medium-l2] [--cells 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch


def build_graph(cells: int, r_max: float, device):
    import ase.build
    from mace.data.neighborhood import get_neighborhood

    atoms = ase.build.bulk("Cu", "fcc", a=3.61, cubic=True).repeat((cells,) * 3)
    atoms.rattle(0.05, seed=0)
    edge_index, *_ = get_neighborhood(atoms.positions, cutoff=r_max, pbc=(True,) * 3,
                                      cell=np.asarray(atoms.cell))
    return len(atoms), torch.as_tensor(edge_index, dtype=torch.int64, device=device)


def time_ms(fn, warmup: int = 5, repeats: int = 30) -> tuple:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), min(times)


def copy_bandwidth(device) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    a = torch.empty(2 * 1024**3 // 4, dtype=torch.float32, device=device).normal_()
    b = torch.empty_like(a)
    med, _ = time_ms(lambda: b.copy_(a), warmup=3, repeats=10)
    del a, b
    return 2 * 2 * 1024**3 / (med * 1e-3)


def random_inputs(spec, n_nodes: int, n_edges: int, dtype, device):
    """``(x [N, dim_in1], y [E, dim_in2], w [E, weight_numel], g [N, dim_out])``, seeded."""
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = ((n_nodes, spec.dim_in1), (n_edges, spec.dim_in2), (n_edges, spec.weight_numel),
              (n_nodes, spec.dim_out))
    return tuple(torch.randn(*shape, device=device, dtype=dtype, generator=gen)
                 for shape in shapes)


def make_backends(problem, dtype, device):
    """name -> module with MACE's fused call (node_feats, edge_attrs, tp_weights, edge_index)."""
    from mace.modules import wrapper_ops
    from mace.tools.scatter import scatter_sum

    from mace_accel.ops.conv_tp.spec import make_e3nn_conv_tp, spec_from_e3nn
    from mace_accel.options import AccelOptions
    from mace_accel.patches.conv_tp import FusedConvTP

    tp = make_e3nn_conv_tp(*problem).to(device=device, dtype=dtype)
    backends, status = {}, {}

    class E3nnConv(torch.nn.Module):
        def forward(self, x, y, w, ei):
            return scatter_sum(tp(x[ei[0]], y, w), ei[1], dim=0, dim_size=x.shape[0])

    backends["e3nn"] = E3nnConv()
    backends["mace-accel"] = FusedConvTP(tp, spec_from_e3nn(tp), AccelOptions(backend="cuda"))
    backends["mace-accel-atomic"] = FusedConvTP(
        tp, spec_from_e3nn(tp), AccelOptions(backend="cuda", deterministic=False))
    ins, mid = tp.instructions, tp.irreps_out
    instructions = [(i.i_in1, i.i_in2, i.i_out, i.connection_mode, i.has_weight) for i in ins]
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the anchors' wrappers read it (benchmark script only)
    try:
        for name, kwargs in (
            ("oeq", dict(oeq_config=wrapper_ops.OEQConfig(enabled=True, optimize_all=True,
                                                          conv_fusion="atomic"))),
            ("cueq", dict(cueq_config=wrapper_ops.CuEquivarianceConfig(
                enabled=True, layout="mul_ir", group="O3_e3nn", optimize_all=True,
                conv_fusion=True))),
        ):
            if not getattr(wrapper_ops, "OEQ_AVAILABLE" if name == "oeq" else "CUET_AVAILABLE"):
                status[name] = "not installed"
                continue
            try:
                module = wrapper_ops.TensorProduct(tp.irreps_in1, tp.irreps_in2, mid,
                                                   instructions=instructions, **kwargs)
                backends[name] = module.to(device)
            except Exception as exc:  # report, never drop silently
                status[name] = f"failed: {type(exc).__name__}: {exc}"
    finally:
        torch.set_default_dtype(old)
    return backends, status, spec_from_e3nn(tp)


def run(problem_name: str, cells: int, dtypes, repeats: int) -> dict:
    from mace_accel.ops.conv_tp.catalog import CATALOG
    from mace_accel.ops.conv_tp.schedule import count_flops_bytes

    device = torch.device("cuda")
    problem = CATALOG[problem_name].irreps
    n_nodes, edge_index = build_graph(cells, 6.0, device)
    bw = copy_bandwidth(device)
    results = {"problem": problem_name, "n_nodes": n_nodes, "n_edges": int(edge_index.shape[1]),
               "copy_bandwidth_GBps": bw / 1e9, "gpu": torch.cuda.get_device_name(device),
               "rows": []}
    print(f"{problem_name}: {n_nodes} nodes, {edge_index.shape[1]} edges; "
          f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    for dtype in dtypes:
        backends, status, spec = make_backends(problem, dtype, device)
        E = edge_index.shape[1]
        x, y, w, g = random_inputs(spec, n_nodes, E, dtype, device)
        roof = count_flops_bytes(spec, n_nodes, E, str(dtype).replace("torch.", ""))
        ref_out = None
        for name, module in backends.items():
            row = {"dtype": str(dtype).replace("torch.", ""), "backend": name}
            try:
                xr, yr, wr = (t.detach().clone().requires_grad_(True) for t in (x, y, w))

                def fwd():
                    with torch.no_grad():
                        return module(x, y, w, edge_index)

                def fwd_bwd():
                    out = module(xr, yr, wr, edge_index)
                    return torch.autograd.grad(out, (xr, yr, wr), g)

                out = fwd()
                if name == "e3nn":
                    ref_out = out.double()
                elif ref_out is not None:
                    row["fwd_rel_err_vs_e3nn"] = float((out.double() - ref_out).norm() / ref_out.norm())
                row["fwd_ms"], _ = time_ms(fwd, repeats=repeats)
                row["fwd_bwd_ms"], _ = time_ms(fwd_bwd, repeats=repeats)
                fb_bytes = roof["fwd_bytes"] + roof["bwd_bytes"]
                row["roofline_fraction"] = fb_bytes / (row["fwd_bwd_ms"] * 1e-3) / bw
                row["fwd_roofline_fraction"] = roof["fwd_bytes"] / (row["fwd_ms"] * 1e-3) / bw
                row["status"] = "ok"
            except torch.cuda.OutOfMemoryError:
                row["status"] = "out of memory"
            except Exception as exc:
                row["status"] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
            results["rows"].append(row)
            torch.cuda.empty_cache()
        for name, why in status.items():
            results["rows"].append({"dtype": str(dtype).replace("torch.", ""), "backend": name,
                                    "status": why})
        results["rows"] += last_layer_rows(spec, n_nodes, edge_index, x, y, g, repeats)
    return results


def last_layer_rows(spec, n_nodes, edge_index, x, y, g, repeats: int, hidden: int = 64):
    """The conv with the radial MLP's last layer in front: weights kept vs recomputed."""
    from mace_accel.ops.conv_tp import autograd
    from mace_accel.ops.conv_tp.folded import folded_conv_tp
    from mace_accel.ops.graph import graph_from_edge_index

    key = autograd.register_spec(spec)
    graph = graph_from_edge_index(edge_index, n_nodes)
    gen = torch.Generator(device=x.device).manual_seed(1)
    h = torch.randn(edge_index.shape[1], hidden, device=x.device, dtype=x.dtype, generator=gen)
    w_last = torch.randn(spec.weight_numel, hidden, device=x.device, dtype=x.dtype,
                         generator=gen).t() / hidden ** 0.5
    calls = {"mace-accel+last layer": lambda a, b, c: autograd.conv_tp(key, graph, a, b,
                                                                       c @ w_last),
             "mace-accel folded": lambda a, b, c: folded_conv_tp(key, graph, a, b, c, w_last)}
    rows = []
    for name, call in calls.items():
        row = {"dtype": str(x.dtype).replace("torch.", ""), "backend": name}
        try:
            xr, yr, hr = (t.detach().clone().requires_grad_(True) for t in (x, y, h))

            def fwd():
                with torch.no_grad():
                    return call(x, y, h)

            def fwd_bwd():
                return torch.autograd.grad(call(xr, yr, hr), (xr, yr, hr), g)

            row["fwd_ms"], _ = time_ms(fwd, repeats=repeats)
            row["fwd_bwd_ms"], _ = time_ms(fwd_bwd, repeats=repeats)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(x.device)
            out = call(xr, yr, hr)  # the graph holds what the backward needs
            torch.cuda.synchronize()
            row["kept_MB"] = (torch.cuda.memory_allocated(x.device) - before
                              - out.numel() * out.element_size()) / 2**20
            del out
            row["status"] = "ok"
        except torch.cuda.OutOfMemoryError:
            row["status"] = "out of memory"
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def print_table(results: dict) -> None:
    print(f"\nconv kernel, {results['problem']}, {results['n_edges']} edges, {results['gpu']}")
    print(f"{'dtype':8} {'backend':17} {'fwd ms':>8} {'fwd+bwd ms':>11} {'%roof':>6} "
          f"{'vs e3nn':>8} {'vs best other':>13}  status")
    for dtype in sorted({r["dtype"] for r in results["rows"]}):
        rows = [r for r in results["rows"] if r["dtype"] == dtype]
        ok = {r["backend"]: r for r in rows if r.get("status") == "ok"}
        for r in rows:
            if r.get("status") != "ok":
                print(f"{dtype:8} {r['backend']:17} {'':>8} {'':>11} {'':>6} {'':>8} {'':>13}  {r['status']}")
                continue
            if "kept_MB" in r:  # the rows with the radial MLP's last layer in front
                print(f"{dtype:8} {r['backend']:17} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:11.3f} "
                      f"{'':>6} {'':>8} {'':>13}  ok, kept for the backward "
                      f"{r['kept_MB']:.0f} MB")
                continue
            vs_e3nn = ok["e3nn"]["fwd_bwd_ms"] / r["fwd_bwd_ms"] if "e3nn" in ok else float("nan")
            best = min(o for b, o in ((b, v["fwd_bwd_ms"]) for b, v in ok.items())
                       if not b.startswith("mace-accel") and b != "e3nn") \
                if any(not b.startswith("mace-accel") and b != "e3nn" for b in ok) else float("nan")
            vs_best = best / r["fwd_bwd_ms"]
            print(f"{dtype:8} {r['backend']:17} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:11.3f} "
                  f"{100 * r['roofline_fraction']:5.0f}% {vs_e3nn:7.2f}x {vs_best:12.2f}x  ok")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", default="mp-medium-l2")
    parser.add_argument("--cells", type=int, default=12)
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: this benchmark needs one", file=sys.stderr)
        return 2
    import mace_accel._e3nn_compat as compat

    compat.import_mace()
    t0 = time.time()
    results = run(args.problem, args.cells,
                  [getattr(torch, d) for d in args.dtypes.split(",")], args.repeats)
    results["wall_s"] = time.time() - t0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
