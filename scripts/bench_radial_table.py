"""Time the tabulated radial MLP (``ops/radial_table``) against the whole-MLP wgmma kernels it
replaces (``ops/radial_tc``; the mma.sync ones off sm_90), on the same edges: forward (the sort
by length included), backward ``d r`` (``d x`` for the MLP), their error against the float64
MLP, and the bandwidth of the ``[E, n_out]`` tensor written / read (GPU machine). A Bessel x
polynomial-cutoff embedding (MACE's, 8 functions, r_max 6 Å) into a random SiLU MLP; lengths
drawn as in a dense solid (density ~ r^2 from 1.8 Å). 10 launches per CUDA graph, median.
With ``--dtype float64`` the quintic float64 table alone (no float64 MLP kernel to compare).

    python scripts/bench_radial_table.py --edges 20000,539000 --outs 512,1280
    python scripts/bench_radial_table.py --dtype float64
"""

from __future__ import annotations

import argparse
import math

import torch

from mace_accel.bench.timing import graph_ms_per_launch
from mace_accel.ops import radial_mlp
from mace_accel.ops.radial_table import autograd as table_ops
from mace_accel.ops.radial_table.order import length_order
from mace_accel.ops.radial_table.table import SPECS, build_table
from mace_accel.ops.radial_tc.cuda import CudaRadialMLP
from mace_accel.ops.radial_tc.spec import RadialSpec

R_MAX, BASIS, P = 6.0, 8, 6
LAUNCHES = 10


def embedding(r: torch.Tensor) -> torch.Tensor:
    """MACE's Bessel basis times its polynomial cutoff, ``[E, BASIS]``."""
    n = torch.arange(1, BASIS + 1, dtype=r.dtype, device=r.device)
    bessel = (2 / R_MAX) ** 0.5 * torch.sin(n * math.pi * r[:, None] / R_MAX) / r[:, None]
    x = r / R_MAX
    cut = (1 - (P + 1) * (P + 2) / 2 * x ** P + P * (P + 2) * x ** (P + 1)
           - P * (P + 1) / 2 * x ** (P + 2)) * (r < R_MAX)
    return bessel * cut[:, None]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).abs().max() / b.abs().max())


def run(n_out: int, edges: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    widths = (BASIS, 64, 64, 64, n_out)
    w64 = [torch.randn(widths[i], widths[i + 1], dtype=torch.float64, device="cuda")
           / widths[i] ** 0.5 for i in range(len(widths) - 1)]
    w32 = [w.float().t().contiguous().t() for w in w64]

    def net64(r: torch.Tensor) -> torch.Tensor:
        return radial_mlp.reference(embedding(r), w64)

    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    table = build_table(net64, R_MAX, w64[0], SPECS[dtype], dtype)
    t1.record()
    torch.cuda.synchronize()
    coeffs = table.coeffs.to(dtype).contiguous()
    r = (R_MAX * torch.rand(edges, device="cuda", dtype=torch.float64) ** (1 / 3)).clamp(min=1.8)
    r32 = r.to(dtype)
    g = torch.randn(edges, n_out, device="cuda", dtype=dtype)
    # float64 truth: the weights and d r of <g, w>
    rr = r.clone().requires_grad_(True)
    ref = net64(rr)
    (dref,) = torch.autograd.grad(ref, rr, g.double())

    def table_fwd():
        order = length_order(r32, R_MAX)
        return table_ops.lookup(r32, order, coeffs, table.inv_h)

    order = length_order(r32, R_MAX)
    kernels = table_ops._kernels(coeffs)

    def table_bwd():
        return kernels.backward(g, r32, order, coeffs, table.inv_h)

    if dtype == torch.float32:
        x = embedding(r32)
        mlp = CudaRadialMLP(RadialSpec(widths), r32.device)
        packed = mlp.pack(w32)
        _, z = mlp.forward(x, packed)

        def mlp_fwd():
            return mlp.forward(x, packed)[0]

        def mlp_bwd():
            return mlp.backward(g, z, packed)

    print(f"n_out {n_out}, {edges} edges: {table.describe(dtype)}; built in "
          f"{t0.elapsed_time(t1):.0f} ms", flush=True)
    gb = edges * n_out * r32.element_size() / 1e9
    base = {}
    mlp_rows = [] if dtype != torch.float32 else [
        ("MLP fwd (wgmma)", mlp_fwd, _rel(mlp_fwd(), ref.detach())),
        ("MLP bwd d x (wgmma)", mlp_bwd, None)]
    for name, fn, err in (
            *mlp_rows[:1],
            ("table fwd + sort", table_fwd, _rel(table_fwd(), ref.detach())),
            ("table fwd, sorted", lambda: kernels.forward(r32, order, coeffs, table.inv_h),
             None),
            ("table fwd, unsorted", lambda: kernels.forward(
                r32, torch.arange(edges, device="cuda"), coeffs, table.inv_h), None),
            *mlp_rows[1:],
            ("table bwd d r", table_bwd, _rel(table_bwd(), dref))):
        ms = graph_ms_per_launch(fn, LAUNCHES)
        key = name.split()[1]
        base.setdefault(key, ms)
        print(f"  {name:22s} {ms * 1e3:8.1f} us ({ms / base[key]:4.2f}x)  "
              f"{gb / ms * 1e3:6.0f} GB/s of w" + ("" if err is None else f"  err {err:.1e}"),
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--edges", default="20000,539000")
    parser.add_argument("--outs", default="512,1280")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    for n_out in (int(v) for v in args.outs.split(",")):
        for e in (int(v) for v in args.edges.split(",")):
            run(n_out, e, dtype)


if __name__ == "__main__":
    main()
