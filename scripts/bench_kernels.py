"""Single kernels against their alternatives, one family at a time (GPU machine).

    python scripts/bench_kernels.py FAMILY [options]
    python scripts/bench_kernels.py FAMILY --help      # what FAMILY measures, its options

Same process, same inputs, CUDA events, medians after warm-up (mace_accel.bench.timing). Small
kernels run LAUNCHES calls to a CUDA graph, replayed, so launch costs do not hide them. Errors
are relative L-infinity errors against float64 (or the named reference).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
from functools import partial
from typing import Callable, Dict, List, Tuple

import torch

from mace_accel.bench.backends import failure_status
from mace_accel.bench.timing import graph_ms_per_launch, time_calls

LAUNCHES = 10
say = partial(print, flush=True)
FAMILIES: Dict[str, Tuple[Callable, tuple]] = {}


def family(name: str, *options: Tuple[tuple, dict]) -> Callable:
    """Register ``run(args)`` as the family ``name`` with its options (:func:`opt`); its
    docstring is the family's help."""
    def register(run: Callable) -> Callable:
        FAMILIES[name] = (run, options)
        return run
    return register


def opt(*flags: str, **kwargs) -> Tuple[tuple, dict]:
    return flags, kwargs


def _list(item: Callable) -> Callable[[str], list]:
    return lambda text: [item(t) for t in text.split(",") if t]


ints, names = _list(int), _list(str)
dtypes = _list(lambda name: getattr(torch, name))


def dname(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def event_ms(fn: Callable, repeats: int, warmup: int = 5) -> float:
    """Median milliseconds of one call of ``fn``."""
    return time_calls(fn, "cuda", warmup, repeats).median_ms


def graph_ms(fn: Callable, repeats: int) -> float:
    """Median milliseconds per call of ``fn``, LAUNCHES calls captured in one CUDA graph."""
    return graph_ms_per_launch(fn, LAUNCHES, repeats)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((out.detach().double() - ref).abs().max() / ref.abs().max())


def rates(ms: float, flops: float = 0.0, moved: float = 0.0) -> str:
    """``ms`` in microseconds, with the TFLOP/s of ``flops`` and the GB/s of ``moved`` bytes."""
    text = f"{ms * 1e3:8.1f} us"
    if flops:
        text += f" {flops / ms / 1e9:6.2f} TFLOP/s"
    if moved:
        text += f" {moved / ms / 1e6:6.0f} GB/s"
    return text


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    a = torch.empty(2 * 1024**3 // 4, dtype=torch.float32, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = event_ms(partial(b.copy_, a), repeats=10, warmup=3)
    del a, b
    return 2 * 2 * 1024**3 / (ms * 1e-3)


def fcc_graph(cells: int, r_max: float = 6.0) -> Tuple[int, torch.Tensor]:
    """``(atoms, edge_index)`` of a rattled fcc Cu supercell of ``cells``^3 cubic cells
    (12: 6,912 atoms, ~539k edges at r_max = 6 Å)."""
    import ase.build
    import numpy as np
    from mace.data.neighborhood import get_neighborhood

    atoms = ase.build.bulk("Cu", "fcc", a=3.61, cubic=True).repeat((cells,) * 3)
    atoms.rattle(0.05, seed=0)
    edge_index, *_ = get_neighborhood(atoms.positions, cutoff=r_max, pbc=(True,) * 3,
                                      cell=np.asarray(atoms.cell))
    return len(atoms), torch.as_tensor(edge_index, dtype=torch.int64, device="cuda")


def conv_inputs(spec, n_nodes: int, n_edges: int, dtype: torch.dtype) -> tuple:
    """``(x [N, dim_in1], y [E, dim_in2], w [E, weight_numel], g [N, dim_out])``, seeded."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = ((n_nodes, spec.dim_in1), (n_edges, spec.dim_in2), (n_edges, spec.weight_numel),
              (n_nodes, spec.dim_out))
    return tuple(torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)
                 for shape in shapes)


# ---------------------------------------------------------------------------------------------
# the convolution

def _conv_backends(problem, dtype: torch.dtype) -> tuple:
    """``({name: module with MACE's fused call (x, y, w, edge_index)}, {name: why not}, spec)``."""
    from mace.modules import wrapper_ops
    from mace.tools.scatter import scatter_sum

    from mace_accel.ops.conv_tp.spec import make_e3nn_conv_tp, spec_from_e3nn
    from mace_accel.options import AccelOptions
    from mace_accel.patches.conv_tp import FusedConvTP

    tp = make_e3nn_conv_tp(*problem).to(device="cuda", dtype=dtype)
    backends, status = {}, {}

    class E3nnConv(torch.nn.Module):
        def forward(self, x, y, w, ei):
            return scatter_sum(tp(x[ei[0]], y, w), ei[1], dim=0, dim_size=x.shape[0])

    backends["e3nn"] = E3nnConv()
    backends["mace-accel"] = FusedConvTP(tp, spec_from_e3nn(tp), AccelOptions(backend="cuda"))
    backends["mace-accel-atomic"] = FusedConvTP(
        tp, spec_from_e3nn(tp), AccelOptions(backend="cuda", deterministic=False))
    instructions = [(i.i_in1, i.i_in2, i.i_out, i.connection_mode, i.has_weight)
                    for i in tp.instructions]
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the anchors' wrappers read it (benchmark only)
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
                module = wrapper_ops.TensorProduct(tp.irreps_in1, tp.irreps_in2, tp.irreps_out,
                                                   instructions=instructions, **kwargs)
                backends[name] = module.to("cuda")
            except Exception as exc:  # report, never drop silently
                status[name] = f"failed: {type(exc).__name__}: {exc}"
    finally:
        torch.set_default_dtype(old)
    return backends, status, spec_from_e3nn(tp)


def _timed_row(row: dict, fwd: Callable, fwd_bwd: Callable, repeats: int) -> dict:
    """``row`` with the forward and forward + backward times, or why they did not run."""
    try:
        row["fwd_ms"] = event_ms(fwd, repeats)
        row["fwd_bwd_ms"] = event_ms(fwd_bwd, repeats)
        row["status"] = "ok"
    except Exception as exc:  # a backend that cannot run is reported, the others still run
        row["status"] = failure_status(exc)[:300]
    torch.cuda.empty_cache()
    return row


def _last_layer_rows(spec, n_nodes: int, edge_index, x, y, g, repeats: int,
                     hidden: int = 64) -> List[dict]:
    """The conv with the radial MLP's last layer in front: weights kept vs recomputed."""
    from mace_accel.ops.conv_tp import autograd
    from mace_accel.ops.conv_tp.folded import folded_conv_tp
    from mace_accel.ops.graph import graph_from_edge_index

    key = autograd.register_spec(spec)
    graph = graph_from_edge_index(edge_index, n_nodes)
    gen = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(edge_index.shape[1], hidden, device="cuda", dtype=x.dtype, generator=gen)
    w_last = torch.randn(spec.weight_numel, hidden, device="cuda", dtype=x.dtype,
                         generator=gen).t() / hidden ** 0.5
    calls = {"mace-accel+last layer": lambda a, b, c: autograd.conv_tp(key, graph, a, b,
                                                                       c @ w_last),
             "mace-accel folded": lambda a, b, c: folded_conv_tp(key, graph, a, b, c, w_last)}
    rows = []
    for name, call in calls.items():
        xr, yr, hr = (t.detach().clone().requires_grad_(True) for t in (x, y, h))

        def fwd():
            with torch.no_grad():
                return call(x, y, h)

        row = _timed_row({"dtype": dname(x.dtype), "backend": name}, fwd,
                         lambda: torch.autograd.grad(call(xr, yr, hr), (xr, yr, hr), g), repeats)
        if row["status"] == "ok":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            out = call(xr, yr, hr)  # the autograd graph holds what the backward needs
            torch.cuda.synchronize()
            row["kept_MB"] = (torch.cuda.memory_allocated() - before
                              - out.numel() * out.element_size()) / 2**20
            del out
        rows.append(row)
    return rows


def _conv_table(results: dict) -> None:
    say(f"\nconv kernel, {results['problem']}, {results['n_edges']} edges, {results['gpu']}")
    say(f"{'dtype':8} {'backend':21} {'fwd ms':>8} {'fwd+bwd ms':>11} {'%roof':>6} "
        f"{'vs e3nn':>8} {'vs best other':>13}  status")
    for dtype in sorted({r["dtype"] for r in results["rows"]}):
        rows = [r for r in results["rows"] if r["dtype"] == dtype]
        ok = {r["backend"]: r["fwd_bwd_ms"] for r in rows if r.get("status") == "ok"}
        others = [ms for b, ms in ok.items() if not b.startswith("mace-accel") and b != "e3nn"]
        for r in rows:
            head = f"{dtype:8} {r['backend']:21}"
            if r.get("status") != "ok":
                say(f"{head} {'':>8} {'':>11} {'':>6} {'':>8} {'':>13}  {r['status']}")
            elif "kept_MB" in r:  # the rows with the radial MLP's last layer in front
                say(f"{head} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:11.3f} {'':>6} {'':>8} "
                    f"{'':>13}  ok, kept for the backward {r['kept_MB']:.0f} MB")
            else:
                vs_e3nn = ok["e3nn"] / r["fwd_bwd_ms"] if "e3nn" in ok else math.nan
                vs_best = min(others) / r["fwd_bwd_ms"] if others else math.nan
                say(f"{head} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:11.3f} "
                    f"{100 * r['roofline_fraction']:5.0f}% {vs_e3nn:7.2f}x {vs_best:12.2f}x  ok")


@family("conv",
        opt("--problem", default="mp-medium-l2", help="conv_tp catalog problem"),
        opt("--cells", type=int, default=12, help="fcc Cu cells a side (12: ~539k edges)"),
        opt("--dtypes", type=dtypes, default="float32,float64", help="comma-separated"),
        opt("--json", help="also write the rows to this file"))
def conv(args) -> None:
    """The fused conv TP against OpenEquivariance, cuEquivariance and e3nn.

    A catalog problem (MACE-MP-medium layer 2: 128x0e+128x1o x sh(3) -> 10 paths) on the graph
    of an fcc Cu supercell at r_max = 6 Å: forward, and forward + backward (gradients to
    node_feats, edge_attrs and tp_weights), deterministic and atomic (deterministic=False);
    the fraction of the HBM roofline (fewest bytes over the time, against a device copy
    measured here). Two more rows put the radial MLP's last layer (64 -> weight_numel) in
    front, as a patched model runs it: "mace-accel+last layer" keeps the per-edge TP weights
    for the backward, "mace-accel folded" (mace_accel.ops.conv_tp.folded) recomputes them
    chunk by chunk; "kept" is what each keeps for the backward beyond its inputs.
    """
    import mace_accel._e3nn_compat as compat
    from mace_accel.ops.conv_tp.catalog import CATALOG
    from mace_accel.ops.conv_tp.schedule import count_flops_bytes

    compat.import_mace()
    n_nodes, edge_index = fcc_graph(args.cells)
    n_edges = int(edge_index.shape[1])
    bw = copy_bandwidth()
    results = {"problem": args.problem, "n_nodes": n_nodes, "n_edges": n_edges,
               "copy_bandwidth_GBps": bw / 1e9, "gpu": torch.cuda.get_device_name(), "rows": []}
    say(f"{args.problem}: {n_nodes} nodes, {n_edges} edges; copy bandwidth {bw / 1e9:.0f} GB/s")
    for dtype in args.dtypes:
        backends, status, spec = _conv_backends(CATALOG[args.problem].irreps, dtype)
        x, y, w, g = conv_inputs(spec, n_nodes, n_edges, dtype)
        roof = count_flops_bytes(spec, n_nodes, n_edges, dname(dtype))
        ref = None
        for name, module in backends.items():
            xr, yr, wr = (t.detach().clone().requires_grad_(True) for t in (x, y, w))

            def fwd(module=module):
                with torch.no_grad():
                    return module(x, y, w, edge_index)

            row = {"dtype": dname(dtype), "backend": name}
            try:
                out = fwd().double()
            except Exception as exc:
                results["rows"].append({**row, "status": failure_status(exc)[:300]})
                continue
            if name == "e3nn":
                ref = out
            elif ref is not None:
                row["fwd_rel_err_vs_e3nn"] = float((out - ref).norm() / ref.norm())
            _timed_row(row, fwd, lambda m=module, xr=xr, yr=yr, wr=wr: torch.autograd.grad(
                m(xr, yr, wr, edge_index), (xr, yr, wr), g), args.repeats)
            if row["status"] == "ok":
                both = roof["fwd_bytes"] + roof["bwd_bytes"]
                row["roofline_fraction"] = both / (row["fwd_bwd_ms"] * 1e-3) / bw
                row["fwd_roofline_fraction"] = roof["fwd_bytes"] / (row["fwd_ms"] * 1e-3) / bw
            results["rows"].append(row)
        results["rows"] += [{"dtype": dname(dtype), "backend": name, "status": why}
                            for name, why in status.items()]
        results["rows"] += _last_layer_rows(spec, n_nodes, edge_index, x, y, g, args.repeats)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    _conv_table(results)


def _staging(shape: str) -> dict:
    """``SHAPE`` for both directions or ``FWD:BWD``, each ``plain`` (the register-prefetch
    kernels) or ``EDGESxSTAGES`` (``u<n>``: unroll n; a trailing ``s``: one input segment per
    launch); a ``/...`` suffix is read by :func:`_codegen_knobs`."""
    from mace_accel.ops.conv_tp.staged import Staging

    def one(text: str):
        if text == "plain":
            return None
        body, _, unroll = text.rstrip("s").partition("u")
        edges, stages = (int(v) for v in body.split("x"))
        return Staging(edges, stages, int(unroll or 0), text.endswith("s"))

    fwd, _, bwd = shape.split("/")[0].partition(":")
    return {"forward": one(fwd), "backward": one(bwd or fwd)}


def _codegen_knobs(shape: str, defaults: dict) -> dict:
    """The codegen constants a shape's suffix sets: ``/h0`` the backward reads the node's output
    gradient per edge (HOIST_G_WORDS = 0), ``/H<n>`` it holds ``h`` up to n values
    (HOIST_H_VALUES), ``/O0`` the forward forms ``u`` per edge (OUTER_FWD_VALUES = 0)."""
    knobs = dict(defaults)
    for part in shape.split("/")[1:]:
        if part == "h0":
            knobs["HOIST_G_WORDS"] = 0
        elif part.startswith("H"):
            knobs["HOIST_H_VALUES"] = int(part[1:])
        elif part == "O0":
            knobs["OUTER_FWD_VALUES"] = 0
    return knobs


@family("conv-staged",
        opt("--problem", default="mp-medium-l2", help="conv_tp catalog problem"),
        opt("--cells", type=ints, default="12,4", help="fcc Cu cells a side, comma-separated"),
        opt("--shapes", type=names, default="plain,4x3,2x4,8x2",
            help="comma-separated stage shapes, e.g. plain,4x2u2,8x2s,plain:4x2,4x2/h0"),
        opt("--dtypes", type=dtypes, default="float32,float64", help="comma-separated"))
def conv_staged(args) -> None:
    """The conv kernels with rows staged in shared memory (ops/conv_tp/staged.py) by shape.

    For each stage shape (edges per tile x stages; "plain": the register-prefetch kernels;
    FWD:BWD apart; suffixes /h0, /H<n>, /O0 change codegen's HOIST_G_WORDS, HOIST_H_VALUES,
    OUTER_FWD_VALUES): forward, deterministic backward (all three gradients, the per-sender
    sum included) and atomic backward times, the fraction of the HBM roofline of forward +
    backward (count_flops_bytes over a device copy measured here), and whether every output
    is bit-identical to the first shape's.
    """
    from mace_accel.ops.conv_tp import codegen
    from mace_accel.ops.conv_tp.catalog import CATALOG
    from mace_accel.ops.conv_tp.cuda import CudaConvPrimitives
    from mace_accel.ops.conv_tp.schedule import count_flops_bytes
    from mace_accel.ops.conv_tp.spec import make_spec
    from mace_accel.ops.graph import KernelGraph, graph_from_edge_index

    needs = (True, True, True)
    defaults = {k: getattr(codegen, k)
                for k in ("HOIST_G_WORDS", "HOIST_H_VALUES", "OUTER_FWD_VALUES")}
    bw = copy_bandwidth()
    say(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s")
    spec = make_spec(*CATALOG[args.problem].irreps)
    for cells in args.cells:
        n, edge_index = fcc_graph(cells)
        graph = KernelGraph(*graph_from_edge_index(edge_index, n).tensors("cuda"))
        e = edge_index.shape[1]
        for dtype in args.dtypes:
            x, y, w, g = conv_inputs(spec, n, e, dtype)
            both = sum(count_flops_bytes(spec, n, e, dname(dtype))[k]
                       for k in ("fwd_bytes", "bwd_bytes"))
            ref = None
            say(f"\n{args.problem} {dname(dtype)} {n} atoms {e} edges")
            say(f"{'shape':>12} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'roof':>5} "
                f"{'atomic bwd':>10} {'f+b atomic':>10} {'roof':>5}  bits")
            for shape in args.shapes:
                # the kernels are rendered on their first call, below, with these constants
                for k, v in _codegen_knobs(shape, defaults).items():
                    setattr(codegen, k, v)
                prims = CudaConvPrimitives(spec, dtype, torch.device("cuda"),
                                           staging=_staging(shape))
                atomic = CudaConvPrimitives(spec, dtype, torch.device("cuda"),
                                            deterministic=False, staging=_staging(shape))
                prims.staged_min_edges = atomic.staged_min_edges = 0  # the shape at any size
                res = [prims.forward(n, graph, x, y, w), *prims.backward(n, graph, x, y, w, g,
                                                                         needs)]
                agx = atomic.backward(n, graph, x, y, w, g, needs)[0]
                for k, v in defaults.items():
                    setattr(codegen, k, v)
                if ref is None:
                    ref, same = res, "reference"
                else:
                    diffs = [float((a - b).abs().max()) for a, b in zip(res, ref)]
                    same = "identical" if max(diffs) == 0 else f"DIFFER {diffs}"
                adiff = float((agx - ref[1]).abs().max() / ref[1].abs().max())
                ran = ",".join(sorted({("staged " if "_st" in k else "plain ") + k.split("_")[2]
                                       for k in prims._kernels if "sender" not in k}))
                t_f = event_ms(lambda: prims.forward(n, graph, x, y, w), args.repeats)
                t_b = event_ms(lambda: prims.backward(n, graph, x, y, w, g, needs), args.repeats)
                t_a = event_ms(lambda: atomic.backward(n, graph, x, y, w, g, needs),
                               args.repeats)
                say(f"{shape:>12} {t_f:8.3f} {t_b:8.3f} {t_f + t_b:8.3f} "
                    f"{100 * both / ((t_f + t_b) * 1e-3) / bw:4.0f}% {t_a:10.3f} "
                    f"{t_f + t_a:10.3f} {100 * both / ((t_f + t_a) * 1e-3) / bw:4.0f}%  "
                    f"{ran}, {same} (atomic d x {adiff:.1e})")
                torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# the node-wise ops

@family("irreps-linear",
        opt("--nodes", type=ints, default="280,2048,6912", help="comma-separated node counts"),
        opt("--maps", type=names, default="message,skip89",
            help="irreps_linear catalog maps (each also transposed)"),
        opt("--dtypes", type=dtypes, default="float32,float64", help="comma-separated"))
def irreps_linear(args) -> None:
    """The equivariant linear kernels against the torch reference and cuBLAS GEMMs.

    The catalog's maps at node counts of MACE-MP cells (280: a 256-atom cell padded; 6,912
    atoms), in CUDA graphs, with the FLOP rate and the bytes each launch moves.
    """
    from mace_accel.ops.irreps_linear import autograd, gemm
    from mace_accel.ops.irreps_linear.catalog import CATALOG
    from mace_accel.ops.irreps_linear.cuda import CudaIrrepsLinear

    def kernel(spec, dtype) -> CudaIrrepsLinear:
        k = CudaIrrepsLinear(spec, dtype, torch.device("cuda"))
        k.gemm_min_nodes = 2 ** 62  # the generated kernel at every size
        return k

    for dtype in args.dtypes:
        for name in args.maps:
            for label, spec in ((name, CATALOG[name]), (name + "_t", CATALOG[name].transposed())):
                autograd.register_spec(spec)
                real = torch.finfo(dtype).bits // 8
                macs = sum(spec.in_blocks[i.i_in].size * spec.out_blocks[i.i_out].mul
                           for i in spec.instructions)
                for nodes in args.nodes:
                    gen = torch.Generator(device="cuda").manual_seed(0)
                    x = torch.randn(nodes, spec.dim_in, device="cuda", dtype=dtype, generator=gen)
                    w = torch.randn(spec.weight_numel, device="cuda", dtype=dtype,
                                    generator=gen) * 0.1
                    elem = torch.randint(0, spec.num_elements, (nodes,), device="cuda",
                                         dtype=torch.int32, generator=gen)
                    rows = {"kernel": partial(kernel(spec, dtype).apply, x, w, elem),
                            "torch reference": lambda: autograd.reference(spec, x, w, elem)}
                    if gemm.runs_on(spec):
                        rows["cuBLAS GEMMs"] = partial(gemm.apply, spec, x, w)
                    moved = (nodes * (spec.dim_in + spec.dim_out) + spec.weight_numel) * real
                    for row, fn in rows.items():
                        ms = graph_ms(fn, args.repeats)
                        say(f"{dname(dtype):8s} {label:8s} {nodes:6d} nodes  {row:18s} "
                            f"{rates(ms, 2 * macs * nodes, moved)}")


@family("symmetric-contraction",
        opt("--problems", type=names, default="mp-medium-p1,mp-large-p1,mp-medium-p2",
            help="symmetric_contraction catalog problems"),
        opt("--nodes", type=int, default=6912, help="node count"),
        opt("--dtypes", type=dtypes, default="float32,float64", help="comma-separated"),
        opt("--json", help="also write the rows to this file"))
def symmetric_contraction(args) -> None:
    """The fused symmetric contraction against mace's own module.

    Forward, and forward + backward to the node features (what an energy + forces call
    needs), with the bytes each pass must move and the share of the HBM roofline reached
    (against a device copy measured here).
    """
    from mace_accel.ops.symmetric_contraction.catalog import build
    from mace_accel.options import AccelOptions
    from mace_accel.patches.product_blocks import FusedSymmetricContraction

    bw, rows, nodes = copy_bandwidth(), [], args.nodes
    for name in args.problems:
        for dtype in args.dtypes:
            module, spec = build(name, "float64")
            module = module.to("cuda", dtype)
            for p in module.parameters():  # inference: gradients of the inputs only
                p.requires_grad_(False)
            fused = FusedSymmetricContraction(module, spec, AccelOptions(backend="cuda"))
            gen = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(nodes, spec.num_features, spec.num_components, device="cuda",
                            dtype=dtype, generator=gen)
            elem = torch.randint(0, spec.num_elements, (nodes,), device="cuda", generator=gen)
            y = torch.nn.functional.one_hot(elem, spec.num_elements).to(dtype)
            g = torch.randn(nodes, spec.dim_out, device="cuda", dtype=dtype, generator=gen)
            xg = x.clone().requires_grad_(True)
            with torch.no_grad():
                want = module(x, y)
                err = float((fused(x, y) - want).norm() / want.norm())
            size = torch.finfo(dtype).bits // 8
            x_bytes, out_bytes = x.numel() * size, nodes * spec.dim_out * size
            r = {"problem": name, "dtype": dname(dtype), "nodes": nodes, "spec": spec.describe(),
                 "rel_err_vs_mace": err, "roofline_fwd_ms": (x_bytes + out_bytes) / bw * 1e3,
                 "roofline_fwd_bwd_ms": (3 * x_bytes + 2 * out_bytes) / bw * 1e3}
            for label, m in (("mace", module), ("fused", fused)):
                r[f"{label}_fwd_ms"] = event_ms(partial(m, x, y), args.repeats)
                r[f"{label}_fwd_bwd_ms"] = event_ms(
                    lambda m=m: torch.autograd.grad(m(xg, y), xg, g), args.repeats)
            r["fwd_bwd_share_of_roofline"] = r["roofline_fwd_bwd_ms"] / r["fused_fwd_bwd_ms"]
            rows.append(r)
            say(f"symmetric contraction, {name} {r['dtype']} N={nodes}: "
                f"fwd mace {r['mace_fwd_ms']:.3f} ms fused {r['fused_fwd_ms']:.3f} ms | "
                f"fwd+bwd mace {r['mace_fwd_bwd_ms']:.3f} fused {r['fused_fwd_bwd_ms']:.3f} ms "
                f"({r['mace_fwd_bwd_ms'] / r['fused_fwd_bwd_ms']:.1f}x; roofline "
                f"{r['roofline_fwd_bwd_ms']:.3f} ms = {100 * r['fwd_bwd_share_of_roofline']:.0f}%)"
                f" err {err:.1e}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


# ---------------------------------------------------------------------------------------------
# the radial MLP and its GEMMs

R_MAX, BASIS, P = 6.0, 8, 6  # MACE's Bessel embedding with its polynomial cutoff


def _embedding(r: torch.Tensor) -> torch.Tensor:
    """MACE's Bessel basis times its polynomial cutoff, ``[E, BASIS]``."""
    n = torch.arange(1, BASIS + 1, dtype=r.dtype, device=r.device)
    bessel = (2 / R_MAX) ** 0.5 * torch.sin(n * math.pi * r[:, None] / R_MAX) / r[:, None]
    x = r / R_MAX
    cut = (1 - (P + 1) * (P + 2) / 2 * x ** P + P * (P + 2) * x ** (P + 1)
           - P * (P + 1) / 2 * x ** (P + 2)) * (r < R_MAX)
    return bessel * cut[:, None]


def _mlp_layers(x: torch.Tensor, w64: List[torch.Tensor], g: torch.Tensor
                ) -> Tuple[Callable, Callable]:
    """``(forward, d x)`` of the MLP of weights ``w64`` on ``x`` in ``x``'s dtype, as the model
    runs it without tables (patches/radial/mlp.py, route "layers"): a cuBLAS GEMM per layer
    with its SiLU; the input gradient of ``<g, out>`` from the hidden pre-activations the
    forward keeps."""
    from mace_accel.ops.radial import mlp as radial_mlp

    w = [wi.to(x.dtype).t().contiguous().t() for wi in w64]  # column-major, as the model keeps
    with torch.no_grad():
        pre = radial_mlp.pre_activations(x, w[:-1], last_act=True)[0]
    no_w = [False] * (len(w) - 1)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return torch.mm(radial_mlp.radial_mlp(x, w[:-1], last_act=True), w[-1])

    def grad_x() -> torch.Tensor:
        with torch.no_grad():
            g_hidden = torch.mm(g, w[-1].t())
            return radial_mlp.vjp(x, w[:-1], pre, g_hidden, True, True, no_w)[0]

    return forward, grad_x


@family("radial-table",
        opt("--edges", type=ints, default="20000,539000", help="comma-separated edge counts"),
        opt("--outs", type=ints, default="512,1280", help="output widths of the MLP"),
        opt("--dtypes", type=dtypes, default="float32",
            help="float64: the quintic table, against the MLP's layers on cuBLAS"))
def radial_table(args) -> None:
    """The tabulated radial MLP (ops/radial/table) against the MLP's layers it replaces.

    A Bessel x polynomial-cutoff embedding (MACE's: 8 functions, r_max 6 Å) into a random
    SiLU MLP 8-64-64-64-n_out, lengths drawn as in a dense solid (density ~ r^2 from 1.8 Å):
    the table's forward (with and without the sort by length) and backward d r against the
    MLP's forward and d x as the model runs them without tables (a cuBLAS GEMM per layer),
    their errors against the float64 MLP,
    and the bandwidth of the [E, n_out] tensor written or read.
    """
    from mace_accel.ops.radial import mlp as radial_mlp
    from mace_accel.ops.radial.table import autograd as table_ops
    from mace_accel.ops.radial.table.order import length_order
    from mace_accel.ops.radial.table.table import SPECS, build_table

    for dtype in args.dtypes:
        for n_out in args.outs:
            torch.manual_seed(0)
            widths = (BASIS, 64, 64, 64, n_out)
            w64 = [torch.randn(a, b, dtype=torch.float64, device="cuda") / a ** 0.5
                   for a, b in zip(widths[:-1], widths[1:])]

            def net64(r: torch.Tensor) -> torch.Tensor:
                return radial_mlp.reference(_embedding(r), w64)

            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            table = build_table(net64, R_MAX, w64[0], SPECS[dtype], dtype)
            t1.record()
            torch.cuda.synchronize()
            coeffs = table.coeffs.to(dtype).contiguous()
            kernels = table_ops._kernels(coeffs)
            for edges in args.edges:
                r64 = (R_MAX * torch.rand(edges, device="cuda", dtype=torch.float64) ** (1 / 3)
                       ).clamp(min=1.8)
                r = r64.to(dtype)
                g = torch.randn(edges, n_out, device="cuda", dtype=dtype)
                rr = r64.clone().requires_grad_(True)
                ref = net64(rr)  # float64 truth: the weights and d r of <g, w>
                (dref,) = torch.autograd.grad(ref, rr, g.double())
                ref = ref.detach()
                order = length_order(r, R_MAX)
                fwd = partial(kernels.forward, r, order, coeffs, table.inv_h)
                bwd = partial(kernels.backward, g, r, order, coeffs, table.inv_h)
                runs = [("table fwd + sort", lambda: table_ops.lookup(
                             r, length_order(r, R_MAX), coeffs, table.inv_h), ref),
                        ("table fwd, sorted", fwd, None),
                        ("table fwd, unsorted", partial(kernels.forward, r, torch.arange(
                            edges, device="cuda"), coeffs, table.inv_h), None),
                        ("table bwd d r", bwd, dref)]
                mlp_fwd, mlp_bwd = _mlp_layers(_embedding(r), w64, g)
                runs.insert(0, ("MLP fwd (layers)", mlp_fwd, ref))
                runs.insert(4, ("MLP bwd d x (layers)", mlp_bwd, None))
                say(f"n_out {n_out}, {edges} edges: {table.describe(dtype)}; built in "
                    f"{t0.elapsed_time(t1):.0f} ms")
                base = {}
                for name, fn, want in runs:
                    ms = graph_ms(fn, args.repeats)
                    base.setdefault(name.split()[1], ms)  # the first fwd / bwd: the ratios' base
                    say(f"  {name:22s} {rates(ms)} ({ms / base[name.split()[1]]:4.2f}x) "
                        f"{edges * n_out * r.element_size() / ms / 1e6:6.0f} GB/s of w"
                        + ("" if want is None else f"  err {rel_err(fn(), want):.1e}"))


@family("grouped-linear",
        opt("--nodes", type=ints, default="256,864,6912", help="node counts"))
def grouped_linear(args) -> None:
    """MACE-MH-1's 512-channel equivariant linears on the grouped 3xFP16 kernels (``mma.sync``
    and, on Hopper, ``wgmma``).

    linear_2 (512x(0e+1o+2e+3o) to itself), linear_1 (the convolution's 128-channel paths,
    256x0e+384x1o+384x2e+256x3o, to 2048x0e+512x(1o+2e+3o)), its transpose (the backward),
    the product's linear (512x(0e+1o)) and the second block's linear_up (512x(0e+1o) to
    128x(0e+1o)) and its transpose, float32, each map's blocks in one launch, against the
    generated kernel (FMA units; what maps under the GEMM path's thresholds run on) and
    cuBLAS's float32 (FMA units), TF32, FP16 and BF16 (one pass each, not float32-accurate)
    GEMMs of the same FLOPs on row-major copies.
    """
    from mace_accel._e3nn_compat import o3
    from mace_accel.ops.irreps_linear import autograd as linear_autograd
    from mace_accel.ops.irreps_linear import fp16x3, fp16x3_wgmma, gemm
    from mace_accel.ops.irreps_linear.cuda import CudaIrrepsLinear
    from mace_accel.ops.irreps_linear.spec import effective_weights, linear_scales, linear_spec

    def on_the_generated_kernel(fn):  # the choice is made when the graph is captured
        def call():
            threshold, gemm.MIN_WEIGHTS_FLOAT32 = gemm.MIN_WEIGHTS_FLOAT32, 2 ** 62
            try:
                return fn()
            finally:
                gemm.MIN_WEIGHTS_FLOAT32 = threshold
        return call

    mid = "128x0e+128x0e+128x1o+128x1o+128x1o+128x2e+128x2e+128x2e+128x3o+128x3o"
    nonlin = "2048x0e+512x1o+512x2e+512x3o"
    maps = {"linear_2": ("512x0e+512x1o+512x2e+512x3o",) * 2,
            "linear_1": (mid, nonlin), "linear_1^T": (nonlin, mid),
            "product": ("512x0e+512x1o",) * 2,
            "linear_up": ("512x0e+512x1o", "128x0e+128x1o"),
            "linear_up^T": ("128x0e+128x1o", "512x0e+512x1o")}

    for name, (irreps_in, irreps_out) in maps.items():
        lin = o3().Linear(irreps_in, irreps_out).cuda()
        spec = linear_spec(lin)
        w = effective_weights(spec, lin.weight.detach(), linear_scales(lin)).contiguous()
        prepared = gemm._prepared(spec, w)
        grouped = prepared.grouped
        flops = sum(2 * b.k * b.n * b.d for b in grouped.blocks)  # a node's
        linear_autograd.register_spec(spec)
        generated = CudaIrrepsLinear(spec, torch.float32, torch.device("cuda"))
        for nodes in args.nodes:
            x = torch.randn(nodes, spec.dim_in, device="cuda")
            exact = gemm.apply(spec, x.double(), w.double())
            out = torch.zeros(nodes, spec.dim_out, device="cuda")
            elem = torch.zeros(nodes, dtype=torch.int32, device="cuda")
            kernel = on_the_generated_kernel(partial(generated.apply, x, w, elem))
            ms = graph_ms(kernel, args.repeats)
            say(f"{name:8s} {nodes:5d} nodes generated kernel (FMA units)   "
                f"{rates(ms, flops * nodes)} err {rel_err(kernel(), exact):.1e}")
            runs = [("3xfp16 (mma.sync)", fp16x3.mm_grouped_fp16x3, prepared.split),
                    ("3xfp16 wgmma", fp16x3_wgmma.mm_grouped_fp16x3_wgmma, prepared.packed)]
            for label, grouped_kernel, weights in runs:
                if weights is None:  # not split (a misfit), or not packed (not Hopper)
                    continue
                run = partial(grouped_kernel, grouped, x, weights, out)
                run()
                ms = graph_ms(run, args.repeats)
                say(f"{name:8s} {nodes:5d} nodes {label:33s} {rates(ms, flops * nodes)} "
                    f"err {rel_err(out, exact):.1e}")
            pairs = [(torch.randn(nodes * b.d, b.k, device="cuda"),
                      torch.randn(b.k, b.n, device="cuda")) for b in grouped.blocks]
            for label, tf32 in (("cuBLAS float32", False), ("cuBLAS tf32 (1 pass)", True)):
                torch.backends.cuda.matmul.allow_tf32 = tf32
                ms = graph_ms(lambda: [a @ b for a, b in pairs], args.repeats)
                say(f"{name:8s} {nodes:5d} nodes {label:33s} {rates(ms, flops * nodes)}")
            torch.backends.cuda.matmul.allow_tf32 = False
            for half in (torch.float16, torch.bfloat16):  # what a 3-product split would run on
                halves = [(a.to(half), b.to(half)) for a, b in pairs]
                ms = graph_ms(lambda: [a @ b for a, b in halves], args.repeats)
                say(f"{name:8s} {nodes:5d} nodes {'cuBLAS ' + dname(half) + ' (1 pass)':33s} "
                    f"{rates(ms, flops * nodes)}")


@family("gemm-layouts",
        opt("--edges", type=int, default=539136, help="rows (edges)"),
        opt("--dtypes", type=dtypes, default="float32,float64", help="comma-separated"))
def gemm_layouts(args) -> None:
    """Which weight layout cuBLAS runs fastest for the radial MLP's GEMMs.

    [E, k] @ [k, n] with the weight row-major or as the transpose of a row-major matrix, for
    the forward (k = 64) and the backward (n = 64) shapes.
    """
    e = args.edges
    for dtype in args.dtypes:
        for k, n in ((64, 1280), (64, 512), (64, 64), (1280, 64), (512, 64)):
            a = torch.randn(e, k, device="cuda", dtype=dtype)
            w = torch.randn(k, n, device="cuda", dtype=dtype)
            layouts = {"row-major W": w, "W = (W^T row-major).t()": w.t().contiguous().t()}
            times = {label: event_ms(partial(torch.mm, a, b), args.repeats, warmup=3)
                     for label, b in layouts.items()}
            say(f"{dname(dtype):8s} [E,{k}]@[{k},{n}]: " + ", ".join(
                f"{label} {rates(ms, 2 * e * k * n)}" for label, ms in times.items()))


def main(argv=None) -> int:
    formatter = type("Formatter", (argparse.RawDescriptionHelpFormatter,
                                   argparse.ArgumentDefaultsHelpFormatter), {})
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    families = parser.add_subparsers(dest="family", required=True, metavar="FAMILY")
    for name, (run, options) in FAMILIES.items():
        doc = inspect.getdoc(run)
        sub = families.add_parser(name, help=doc.splitlines()[0], description=doc,
                                  formatter_class=formatter)
        sub.add_argument("--repeats", type=int, default=20, help="timed calls or replays")
        for flags, kwargs in options:
            sub.add_argument(*flags, **kwargs)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: these benchmarks need one", file=sys.stderr)
        return 2
    FAMILIES[args.family][0](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
