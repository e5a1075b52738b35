"""Time the float64 DMMA GEMM kernels against torch.mm (cuBLAS float64, the same tensor cores)
on the radial MLP's last-layer shapes, forward ``h @ W`` and backward ``g @ W^T``, W column-major
as the model keeps it (GPU machine, sm_90). 10 launches per CUDA graph, median of the replays.

    python scripts/bench_dmma_gemm.py --edges 20000,539000 --widths 512,1280 \
        --forward 8:2:4:4,8:1:4:4 --backward 8:2:2:4,8:1:4:3
"""

from __future__ import annotations

import argparse

import torch

from mace_accel.bench.timing import graph_ms_per_launch
from mace_accel.ops.dmma_gemm.cuda import CudaDmmaGemm
from mace_accel.ops.dmma_gemm.spec import DmmaGemmSpec, pack

LAUNCHES = 10


def _geometries(text: str):
    return [tuple(int(v) for v in s.split(":")) for s in text.split(",") if s]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--edges", default="20000,539000")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--widths", default="512,1280")
    parser.add_argument("--forward", default="", help="extra warps:mt:chunk:stages")
    parser.add_argument("--backward", default="", help="extra warps:mt:chunk:stages")
    args = parser.parse_args()
    k = args.hidden
    extra = {"forward": _geometries(args.forward), "backward": _geometries(args.backward)}
    for n in (int(v) for v in args.widths.split(",")):
        spec = DmmaGemmSpec(k, n)
        w = torch.randn(k, n, device="cuda", dtype=torch.float64).t().contiguous().t() / k ** 0.5
        packed = pack(spec, w)
        kernels = {"default": CudaDmmaGemm(spec, w.device)}
        for direction, geos in extra.items():
            for geo in geos:
                try:
                    kernels[f"{direction} {geo}"] = CudaDmmaGemm(spec, w.device, {direction: geo})
                except ValueError as exc:
                    print(f"  skip {geo}: {exc}")
        for e in (int(v) for v in args.edges.split(",")):
            h = torch.randn(e, k, device="cuda", dtype=torch.float64)
            g = torch.randn(e, n, device="cuda", dtype=torch.float64)
            ref = {"fwd": torch.mm(h, w), "bwd": torch.mm(g, w.t())}
            rows = {"cublas fwd": lambda: torch.mm(h, w), "cublas bwd": lambda: torch.mm(g, w.t())}
            for label, kern in kernels.items():
                if not label.startswith("backward"):
                    rows[f"dmma fwd {label}"] = lambda kern=kern: kern.forward(h, packed)
                if not label.startswith("forward"):
                    rows[f"dmma bwd {label}"] = lambda kern=kern: kern.backward(g, packed)
            for name, fn in rows.items():
                ms = graph_ms_per_launch(fn, LAUNCHES)
                io = 8 * (e * (k + n) + k * n)
                r = ref["fwd" if " fwd" in name else "bwd"]
                err = float((fn() - r).abs().max() / r.abs().max())
                print(f"E={e:7d} {k}->{n:5d} {name:34s} {ms * 1e3:8.1f} us "
                      f"{2 * e * k * n / ms / 1e9:6.1f} TFLOP/s {io / ms / 1e6:6.0f} GB/s  "
                      f"err vs cuBLAS {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
