"""The conv forward that applies the radial MLP's last layer itself (mace_accel.ops.conv_tp.hidden)
against our GEMM kernel (3xTF32 float32, DMMA float64) followed by the plain conv forward,
MACE-MP-medium layers 1 and 2 on the 6,912-atom Cu cell's graph (539k edges), with and without
the weights written. GPU only; CUDA events, medians after warm-up, one process.

    python scripts/bench_hidden_conv.py [--dtypes float32,float64]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_conv_kernel import build_graph, copy_bandwidth, time_ms  # noqa: E402

from mace_accel.ops.conv_tp import autograd, hidden  # noqa: E402
from mace_accel.ops.conv_tp.catalog import CATALOG  # noqa: E402
from mace_accel.ops.conv_tp.spec import make_spec  # noqa: E402
from mace_accel.ops.dmma_gemm import autograd as dmma  # noqa: E402
from mace_accel.ops.graph import KernelGraph, graph_from_edge_index  # noqa: E402
from mace_accel.ops.tf32x3_gemm import autograd as tf32x3  # noqa: E402

LAYERS = ("mp-medium-l1", "mp-medium-l2")
HIDDEN = 64


def bench_layer(name: str, dtype: torch.dtype, n: int, kg: KernelGraph, n_edges: int) -> None:
    """Print one layer's timings and how far the fused output is from GEMM + conv."""
    dev = torch.device("cuda")
    spec = make_spec(*CATALOG[name].irreps)
    key = autograd.register_spec(spec)
    prims = autograd._cuda(key, torch.empty(0, dtype=dtype, device=dev), True)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, spec.dim_in1, dtype=dtype, device=dev, generator=gen)
    y = torch.randn(n_edges, spec.dim_in2, dtype=dtype, device=dev, generator=gen)
    h = torch.randn(n_edges, HIDDEN, dtype=dtype, device=dev, generator=gen)
    w_last = torch.randn(spec.weight_numel, HIDDEN, dtype=dtype, device=dev,
                         generator=gen).t() / 8  # column-major, as the radial MLP keeps it
    frag = hidden.pack(w_last, prims.fragment_index(HIDDEN))
    if dtype == torch.float64:
        packed = dmma.pack_weight(w_last)

        def gemm():
            return dmma.mm(h, packed, w_last)
    else:
        def gemm():
            return tf32x3.mm(h, w_last)

    w_full = gemm()

    def conv():
        return prims.forward(n, kg, x, y, w_full)

    def gemm_conv():
        return prims.forward(n, kg, x, y, gemm())

    def fused(write: bool):
        return prims.forward_hidden(n, kg, x, y, h, frag, write)

    base, (out, kept) = gemm_conv(), fused(True)
    exact = (h.double() @ w_last.double())
    diff = ((base.double() - out.double()).norm() / base.double().norm()).item()
    plan = prims.hidden_plan(HIDDEN)
    kernel = prims._kernels[hidden.kernel_name(plan)]
    print(f"{name} {dtype}: {plan.describe()}; {kernel.registers()} registers")
    print(f"  out rel diff fused vs gemm+conv {diff:.2e}; w err vs float64: fused "
          f"{((kept.double() - exact).norm() / exact.norm()).item():.2e} gemm "
          f"{((w_full.double() - exact).norm() / exact.norm()).item():.2e}; bit-equal out "
          f"{torch.equal(base, out)}")
    for label, fn in (("gemm", gemm), ("conv fwd", conv), ("gemm+conv", gemm_conv),
                      ("fused keep w", lambda: fused(True)),
                      ("fused no w", lambda: fused(False))):
        med, low = time_ms(fn, warmup=3, repeats=15)
        print(f"  {label:14s} {med:7.3f} ms (min {low:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,float64")
    args = parser.parse_args()
    dev = torch.device("cuda")
    n, edge_index = build_graph(12, 6.0, dev)
    n_edges = int(edge_index.shape[1])
    print(f"nodes {n} edges {n_edges}; copy {copy_bandwidth(dev) / 1e9:.0f} GB/s")
    kg = KernelGraph(*graph_from_edge_index(edge_index, n).tensors("cuda"))
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for name in LAYERS:
            bench_layer(name, dtype, n, kg, n_edges)


if __name__ == "__main__":
    main()
