"""Time the whole-radial-MLP forward kernel (``ops/radial_tc``) against the layer-by-layer path
it replaces (3xTF32 GEMMs with SiLU epilogues, then the last layer), forward and forward +
backward (``d x``: the 3xTF32 layer kernels in both), and their error against float64 (GPU
machine). 10 launches per CUDA graph, median of the replays.

    python scripts/bench_radial_tc.py --edges 20000,539000 --outs 512,1280
"""

from __future__ import annotations

import argparse

import torch

from mace_accel.bench.timing import graph_ms_per_launch
from mace_accel.ops import radial_mlp
from mace_accel.ops.radial_tc import apply as radial_tc
from mace_accel.ops.radial_tc.spec import RadialSpec, pack_weights
from mace_accel.ops.tf32x3_gemm import autograd as tf32x3

LAUNCHES = 10


def _time(fn) -> float:
    """Milliseconds per launch."""
    return graph_ms_per_launch(fn, LAUNCHES)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b).abs().max() / b.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--edges", default="20000,539000")
    parser.add_argument("--hidden", default="10,64,64,64")
    parser.add_argument("--outs", default="512,1280")
    args = parser.parse_args()
    hidden = tuple(int(v) for v in args.hidden.split(","))
    torch.manual_seed(0)
    for n_out in (int(v) for v in args.outs.split(",")):
        widths = hidden + (n_out,)
        spec = RadialSpec(widths)
        key = radial_tc.register_spec(spec)
        weights = [(torch.randn(widths[i], widths[i + 1], device="cuda") / widths[i] ** 0.5)
                   .t().contiguous().t() for i in range(len(widths) - 1)]
        packed = pack_weights(spec, weights)
        for e in (int(v) for v in args.edges.split(",")):
            x = torch.randn(e, widths[0], device="cuda")
            g = torch.randn(e, n_out, device="cuda")
            xr = x.clone().requires_grad_(True)

            def whole():
                return radial_mlp.radial_mlp(x, weights, tf32x3=True, whole=(key, packed))

            def layers():
                h = radial_mlp.radial_mlp(x, weights[:-1], last_act=True, tf32x3=True)
                return tf32x3.linear(h, weights[-1])

            def whole_bwd():
                out = radial_mlp.radial_mlp(xr, weights, tf32x3=True, whole=(key, packed))
                return torch.autograd.grad(out, xr, g)[0]

            def layers_bwd():
                h = radial_mlp.radial_mlp(xr, weights[:-1], last_act=True, tf32x3=True)
                return torch.autograd.grad(tf32x3.linear(h, weights[-1]), xr, g)[0]

            x64 = x.double().requires_grad_(True)
            ref = radial_mlp.reference(x64, [w.double() for w in weights])
            (gref,) = torch.autograd.grad(ref, x64, g.double())
            err = {"whole": (_rel(whole(), ref), _rel(whole_bwd(), gref)),
                   "layers": (_rel(layers(), ref), _rel(layers_bwd(), gref))}
            for name, fwd, both in (("whole", whole, whole_bwd), ("layers", layers, layers_bwd)):
                tf, tb = _time(fwd), _time(both)
                print(f"{'->'.join(map(str, widths)):22s} E={e:7d} {name:7s} fwd {tf * 1e3:8.1f} us"
                      f"  fwd+bwd {tb * 1e3:8.1f} us  err fwd {err[name][0]:.1e} "
                      f"bwd {err[name][1]:.1e}", flush=True)


if __name__ == "__main__":
    main()
