"""The radial MLP's hidden layers on the GPU: the fused SiLU MLP kernels vs the GEMM + SiLU path
(mace_accel.ops.radial_mlp), forward + d x, at edge counts of MACE-MP-medium cells (21,248: 256
atoms; 539,136: 6,912 atoms); CUDA events, medians; with the FLOPs and the bytes each moves.

    python scripts/bench_silu_mlp.py --edges 21248,539136 --widths 8,64,64,64
"""

from __future__ import annotations

import argparse

import torch

from mace_accel.bench.timing import graph_replay, time_calls
from mace_accel.ops import radial_mlp
from mace_accel.ops.silu_mlp import autograd, dmma
from mace_accel.ops.silu_mlp.cuda import CudaSiluMLP
from mace_accel.ops.silu_mlp.spec import SiluMLPSpec, pack_weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", default="21248,65536,131072,539136")
    parser.add_argument("--widths", default="8,64,64,64")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    widths = tuple(int(w) for w in args.widths.split(","))
    spec = SiluMLPSpec(widths)
    key = autograd.register_spec(spec)
    macs = sum(a * b for a, b in zip(widths[:-1], widths[1:]))
    for dtype in (torch.float32, torch.float64):
        for edges in (int(e) for e in args.edges.split(",")):
            _bench(spec, key, edges, dtype, macs, args.repeats)


def _bench(spec: SiluMLPSpec, key: str, edges: int, dtype: torch.dtype, macs: int,
           repeats: int) -> None:
    widths = spec.widths
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(edges, widths[0], device="cuda", dtype=dtype, generator=gen)
    weights = [torch.randn(a, b, device="cuda", dtype=dtype, generator=gen) / a ** 0.5
               for a, b in zip(widths[:-1], widths[1:])]
    g = torch.randn(edges, widths[-1], device="cuda", dtype=dtype, generator=gen)
    packed = pack_weights(spec, weights)
    xr = x.clone().requires_grad_(True)

    def gemm_path():
        out = radial_mlp.radial_mlp(xr, weights, last_act=True)
        torch.autograd.grad(out, xr, g)

    def fused_path():
        out = autograd.silu_mlp(key, xr, packed, "cuda")
        torch.autograd.grad(out, xr, g)

    cuda = autograd._cuda(key, x)
    if dtype == torch.float64 and cuda.kind == "dmma":  # the FMA kernels and other geometries
        simt = CudaSiluMLP(spec, dtype, x.device, kind="simt")
        _, slopes = cuda.forward(x, packed, keep_slopes=True)
        extra = {"DMMA forward, slopes kept": lambda: cuda.forward(x, packed, keep_slopes=True),
                 "DMMA backward from slopes": lambda: cuda.backward_kept(slopes, packed, g),
                 "SIMT forward kernel": lambda: simt.forward(x, packed),
                 "SIMT backward kernel": lambda: simt.backward(x, packed, g)}
        for variant in ({"forward_warps": 12}, {"unroll": 4}, {"forward_warps": 12, "unroll": 4},
                        {"forward_warps": 4}):
            other = CudaSiluMLP(spec, dtype, x.device, variant=variant)
            label = ",".join(f"{k}={v}" for k, v in variant.items())
            extra[f"DMMA {label} fwd"] = lambda o=other: o.forward(x, packed, keep_slopes=True)
        out, gx = cuda.forward(x, packed), cuda.backward(x, packed, g)
        want, want_gx = simt.forward(x, packed), simt.backward(x, packed, g)
        kept_gx = cuda.backward_kept(slopes, packed, g)
        print(f"   DMMA vs SIMT kernels: max |d out| {(out - want).abs().max().item():.2e}, "
              f"max |d gx| {(gx - want_gx).abs().max().item():.2e}, from the kept slopes "
              f"{(kept_gx - want_gx).abs().max().item():.2e}", flush=True)
    else:
        extra = {}
    rows = {"GEMM + SiLU, fwd + d x": gemm_path, "fused, fwd + d x": fused_path,
            "GEMM + SiLU, in a graph": graph_replay(gemm_path),
            "fused, in a graph": graph_replay(fused_path),
            "fused forward kernel": lambda: cuda.forward(x, packed),
            "fused backward kernel": lambda: cuda.backward(x, packed, g), **extra}
    real = 8 if dtype == torch.float64 else 4
    for name, fn in rows.items():
        ms = time_calls(fn, "cuda", 3, repeats).median_ms
        print(f"{str(dtype)[6:]:8s} {edges:7d} edges {name:24s} {ms:7.3f} ms", flush=True)
    flops = 2 * edges * macs * 3  # forward; the backward: recompute, back-propagate
    moved = edges * (2 * widths[0] + 2 * widths[-1]) * real
    print(f"   fused: {flops / 1e9:.2f} GFLOP, {moved / 1e6:.0f} MB through memory", flush=True)


if __name__ == "__main__":
    main()
