"""Time the 3xTF32 GEMM kernels against torch.mm (cuBLAS float32) on the radial MLP's last
layer shapes, forward ``h @ W`` and backward ``g @ W^T``, W column-major as the model keeps it
(GPU machine). 10 launches per CUDA graph, median of the replays.

    python scripts/bench_tf32x3_gemm.py --edges 20000,539000 --widths 512,1280 \
        --variants 64:128:16:2:4:3,128:128:16:4:4:2
"""

from __future__ import annotations

import argparse

import torch

from mace_accel.bench.timing import graph_ms_per_launch
from mace_accel.ops.tf32x3_gemm import codegen
from mace_accel.ops.tf32x3_gemm.cuda import CudaGemm
from mace_accel.ops.tf32x3_gemm.spec import GemmSpec

LAUNCHES = 10


def _time(fn) -> float:
    """Milliseconds per launch."""
    return graph_ms_per_launch(fn, LAUNCHES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--edges", default="20000,160000,539000")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--widths", default="512,1280")
    parser.add_argument("--variants", default="",
                        help="extra tile geometries bm:bn:bk:warps_m:warps_n:stages")
    args = parser.parse_args()
    variants = [None] + [tuple(int(v) for v in s.split(":")) for s in args.variants.split(",")
                         if s]
    k = args.hidden
    for n in (int(v) for v in args.widths.split(",")):
        w = torch.randn(k, n, device="cuda").t().contiguous().t() / k ** 0.5
        wt = w.t()  # [n, k] contiguous
        for e in (int(v) for v in args.edges.split(",")):
            h = torch.randn(e, k, device="cuda")
            g = torch.randn(e, n, device="cuda")
            flops = 2 * e * k * n
            rows = {"cublas fwd": lambda: torch.mm(h, w), "cublas bwd": lambda: torch.mm(g, w.t())}
            for geo in variants:
                for label, spec, a in (("fwd", GemmSpec(k, n, "nk"), h),
                                       ("bwd", GemmSpec(n, k, "kn"), g)):
                    try:
                        kern = CudaGemm(spec, h.device)
                        if geo is not None:
                            kern.plan = codegen.plan_kernel(spec, kern.plan.arch, geo)
                    except ValueError as exc:
                        print(f"  skip {geo}: {exc}")
                        continue
                    name = f"3xtf32 {label} {geo or 'default'}"
                    rows[name] = (lambda kern=kern, a=a: kern.apply(a, wt))
            exact = {"fwd": (h.double() @ w.double()), "bwd": (g.double() @ w.double().t())}
            for name, fn in rows.items():
                ms = _time(fn)
                io = 4 * (e * (k + n) + k * n)
                ref = exact["fwd" if "fwd" in name else "bwd"]
                err = float((fn().double() - ref).abs().max() / ref.abs().max())
                print(f"E={e:7d} {k}->{n:5d} {name:42s} {ms * 1e3:8.1f} us "
                      f"{flops / ms / 1e9:6.1f} TFLOP/s {io / ms / 1e6:6.0f} GB/s  "
                      f"err {err:.1e}")


if __name__ == "__main__":
    main()
