"""Which operand layout cuBLAS runs fastest for the radial MLP's GEMMs (GPU machine):
``[E, k] @ [k, n]`` with the weight row-major or as the transpose of a row-major matrix, for
the forward (k = 64) and the backward (n = 64) shapes, float32 and float64.

    python scripts/gemm_layouts.py --edges 539136
"""

from __future__ import annotations

import argparse

import torch

from mace_accel.bench.timing import time_calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", type=int, default=539136)
    args = parser.parse_args()
    e = args.edges
    for dtype in (torch.float32, torch.float64):
        for k, n in ((64, 1280), (64, 512), (64, 64), (1280, 64), (512, 64)):
            a = torch.randn(e, k, device="cuda", dtype=dtype)
            w = torch.randn(k, n, device="cuda", dtype=dtype)
            wt = w.t().contiguous()
            rows = {}
            for label, b in (("row-major W", w), ("W = (W^T row-major).t()", wt.t())):
                rows[label] = time_calls(lambda: torch.mm(a, b), "cuda", 3, 15).median_ms
            flops = 2 * e * k * n
            print(f"{str(dtype)[6:]:8s} [E,{k}]@[{k},{n}]: " + ", ".join(
                f"{label} {ms:.3f} ms ({flops / ms / 1e9:.1f} TFLOP/s)"
                for label, ms in rows.items()), flush=True)


if __name__ == "__main__":
    main()
