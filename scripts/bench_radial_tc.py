"""Time the whole-radial-MLP forward kernel (``ops/radial_tc``) against the layer-by-layer path
it replaces (3xTF32 GEMMs with SiLU epilogues, then the last layer), forward and forward +
backward (``d x``: the 3xTF32 layer kernels in both), and their error against float64 (GPU
machine). 10 launches per CUDA graph, median of the replays.

With ``--kernels``, the forward kernels against each other instead: the ``mma.sync`` kernel
(``mma``) and the ``wgmma`` one (``wgmma`` in the variant that runs, or ``wgmma:WGxSTAGESxBNx
SPLITS``) on the same inputs, each one's error against float64 (output and pre-activations, and
the signed error summed over all outputs: a bias), bandwidth (output bytes over time) and TF32
rate (three products per multiply-add).

With ``--backward``, the input gradient alone: the 3xTF32 layer kernels (``vjp`` from the
pre-activations) against the wgmma backward kernel in the given ``WGxSTAGES`` variants, each
one's error against float64, bandwidth (bytes of the gradient read over time) and TF32 rate.

    python scripts/bench_radial_tc.py --edges 20000,539000 --outs 512,1280
    python scripts/bench_radial_tc.py --kernels mma,wgmma,wgmma:1x4x32x1
    python scripts/bench_radial_tc.py --backward 1x4,2x4
"""

from __future__ import annotations

import argparse
from typing import List, Sequence

import torch

from mace_accel.bench.timing import graph_ms_per_launch
from mace_accel.ops import radial_mlp
from mace_accel.ops.radial_tc import apply as radial_tc
from mace_accel.ops.radial_tc.cuda import CudaRadialMLP
from mace_accel.ops.radial_tc.spec import RadialSpec
from mace_accel.ops.tf32x3_gemm import autograd as tf32x3

LAUNCHES = 10


def _time(fn) -> float:
    """Milliseconds per launch."""
    return graph_ms_per_launch(fn, LAUNCHES)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b).abs().max() / b.abs().max())


def _label(widths: Sequence[int], edges: int, name: str) -> str:
    return f"{'->'.join(map(str, widths)):22s} E={edges:7d} {name:12s}"


def _timing(widths: Sequence[int], edges: int, ms: float, base: float, stream: str) -> str:
    """Time, ratio to ``base``, the bandwidth of the ``[E, n_out]`` tensor ``stream`` (written
    or read) and the TF32 rate (three products per multiply-add)."""
    macs = sum(widths[i] * widths[i + 1] for i in range(len(widths) - 1))
    return (f"{ms * 1e3:8.1f} us ({ms / base:4.2f}x)  {stream} "
            f"{edges * widths[-1] * 4 / ms / 1e6:6.0f} GB/s  "
            f"{6 * edges * macs / ms / 1e9:5.0f} TFLOP/s tf32")


def whole_vs_layers(widths: Sequence[int], weights: List[torch.Tensor], x: torch.Tensor,
                    g: torch.Tensor) -> None:
    """The whole-net kernel through ``radial_mlp`` against the layer-by-layer kernels."""
    key = radial_tc.register_spec(RadialSpec(tuple(widths)))
    whole = radial_mlp.WholeNet(key, radial_tc.pack_weights(key, weights))
    nets = {
        "whole": lambda t: radial_mlp.radial_mlp(t, weights, tf32x3=True, whole=whole),
        "layers": lambda t: tf32x3.linear(radial_mlp.radial_mlp(
            t, weights[:-1], last_act=True, tf32x3=True), weights[-1]),
    }
    xr = x.clone().requires_grad_(True)
    x64 = x.double().requires_grad_(True)
    ref = radial_mlp.reference(x64, [w.double() for w in weights])
    (gref,) = torch.autograd.grad(ref, x64, g.double())
    for name, net in nets.items():
        def forward():
            return net(x)

        def both():
            return torch.autograd.grad(net(xr), xr, g)[0]

        err = (_rel(forward(), ref), _rel(both(), gref))
        tf, tb = _time(forward), _time(both)
        print(f"{_label(widths, x.shape[0], name)} fwd {tf * 1e3:8.1f} us  fwd+bwd "
              f"{tb * 1e3:8.1f} us  err fwd {err[0]:.1e} bwd {err[1]:.1e}", flush=True)


def kernels(widths: Sequence[int], weights: List[torch.Tensor], x: torch.Tensor,
            names: Sequence[str]) -> None:
    """The forward kernels ``names`` on the same inputs (the first is the ratios' base)."""
    spec = RadialSpec(tuple(widths))
    pre64, ref = radial_mlp.pre_activations(x.double(), [w.double() for w in weights])
    base = None
    for name in names:
        layout, _, variant = name.partition(":")
        kernel = CudaRadialMLP(spec, x.device, layout=layout, variant=tuple(
            int(v) for v in variant.split("x")) if variant else None)
        packed = kernel.pack(weights)
        out, z = kernel.forward(x, packed)
        err = _rel(out, ref)
        bias = float((out.double() - ref).sum() / ref.abs().sum())
        zerr = max(_rel(z[i, :, :p.shape[1]], p) for i, p in enumerate(pre64))
        ms = _time(lambda: kernel.forward(x, packed))
        base = base or ms
        print(f"{_label(widths, x.shape[0], name)} "
              f"{_timing(widths, x.shape[0], ms, base, 'out')}  err {err:.1e} z "
              f"{zerr:.1e} bias {bias:+.1e}  {kernel.describe()}", flush=True)
        del out, z


def backwards(widths: Sequence[int], weights: List[torch.Tensor], x: torch.Tensor,
              g: torch.Tensor, variants: Sequence[str]) -> None:
    """``d x`` on the layer kernels, then on the wgmma backward kernel in ``variants``."""
    spec = RadialSpec(tuple(widths))
    x64 = x.double().requires_grad_(True)
    (gref,) = torch.autograd.grad(radial_mlp.reference(x64, [w.double() for w in weights]),
                                  x64, g.double())
    with torch.no_grad():
        pre, _ = radial_mlp.pre_activations(x, weights, tf32x3=True)
    no_w = [False] * len(weights)

    def layers() -> torch.Tensor:
        with torch.no_grad():
            return radial_mlp.vjp(x, weights, pre, g, False, True, no_w, tf32x3=True)[0]

    runs = [("layers", layers, "3xTF32 layer kernels")]
    for variant in variants:
        kernel = CudaRadialMLP(spec, x.device, layout="wgmma",
                               backward_variant=tuple(int(v) for v in variant.split("x")))
        packed = kernel.pack(weights)
        _, z = kernel.forward(x, packed)
        runs.append((f"wgmma:{variant}", lambda k=kernel, p=packed, z=z: k.backward(g, z, p),
                     f"wgmma backward, {kernel.backward_plan.threads} threads"))
    base = None
    for name, fn, what in runs:
        err = _rel(fn(), gref)
        ms = _time(fn)
        base = base or ms
        print(f"{_label(widths, x.shape[0], name)} "
              f"{_timing(widths, x.shape[0], ms, base, 'grad')}  err {err:.1e}  {what}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--edges", default="20000,539000")
    parser.add_argument("--hidden", default="10,64,64,64")
    parser.add_argument("--outs", default="512,1280")
    parser.add_argument("--kernels", default="",
                        help="compare these forward kernels (e.g. mma,wgmma,wgmma:1x4x32x1)")
    parser.add_argument("--backward", default="",
                        help="compare the layer kernels' d x with these wgmma backward "
                             "variants (WGxSTAGES, e.g. 1x4,2x4)")
    args = parser.parse_args()
    hidden = tuple(int(v) for v in args.hidden.split(","))
    torch.manual_seed(0)
    for n_out in (int(v) for v in args.outs.split(",")):
        widths = hidden + (n_out,)
        # column-major like the patched model's folded weights
        weights = [(torch.randn(widths[i], widths[i + 1], device="cuda") / widths[i] ** 0.5)
                   .t().contiguous().t() for i in range(len(widths) - 1)]
        for e in (int(v) for v in args.edges.split(",")):
            x = torch.randn(e, widths[0], device="cuda")
            if args.kernels:
                kernels(widths, weights, x, args.kernels.split(","))
            elif args.backward:
                backwards(widths, weights, x, torch.randn(e, n_out, device="cuda"),
                          args.backward.split(","))
            else:
                whole_vs_layers(widths, weights, x, torch.randn(e, n_out, device="cuda"))


if __name__ == "__main__":
    main()
