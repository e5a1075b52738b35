"""Time source-level variants of the generated conv kernels on one problem (development aid).

Each variant is a text edit of the generated source (e.g. unrolling the edge loop); the kernels
run through the normal runtime, so numbers compare directly with scripts/bench_conv_kernel.py.

    python scripts/kernel_variants.py [--problem mp-medium-l2] [--cells 12]
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_conv_kernel import build_graph, time_ms  # noqa: E402

from mace_accel.ops.conv_tp import cuda as conv_cuda  # noqa: E402
from mace_accel.ops.conv_tp.catalog import CATALOG  # noqa: E402
from mace_accel.ops.conv_tp.spec import make_spec  # noqa: E402
from mace_accel.ops.graph import ConvGraph, KernelGraph  # noqa: E402

LOOP = "for (int t = 0; t < cnt; ++t) {"
VARIANTS = {
    "base": lambda src: src,
    "tile32": lambda src: src.replace("#define TILE 16", "#define TILE 32"),
    "tile8": lambda src: src.replace("#define TILE 16", "#define TILE 8"),
    "bunroll2": lambda src: src.replace("      " + LOOP, "#pragma unroll 2\n      " + LOOP),
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--problem", default="mp-medium-l2")
    parser.add_argument("--cells", type=int, default=12)
    args = parser.parse_args()
    spec = make_spec(*CATALOG[args.problem].irreps)
    n, ei = build_graph(args.cells, 6.0, "cuda")
    render_f, render_b = conv_cuda.render_forward, conv_cuda.render_backward
    print(f"{args.problem}: {n} nodes, {ei.shape[1]} edges")
    for dtype in (torch.float32, torch.float64):
        kg = KernelGraph(*ConvGraph(sender=ei[0], receiver=ei[1], n_nodes=n).tensors("cuda"))
        x = torch.randn(n, spec.dim_in1, device="cuda", dtype=dtype)
        y = torch.randn(ei.shape[1], spec.dim_in2, device="cuda", dtype=dtype)
        w = torch.randn(ei.shape[1], spec.weight_numel, device="cuda", dtype=dtype)
        g = torch.randn(n, spec.dim_out, device="cuda", dtype=dtype)
        ref = None
        for name, edit in VARIANTS.items():
            # the primitives render through these module names: wrap them with the edit
            conv_cuda.render_forward = lambda *a, e=edit: e(render_f(*a))
            conv_cuda.render_backward = lambda *a, e=edit: e(render_b(*a))
            prims = conv_cuda.CudaConvPrimitives(spec, dtype, torch.device("cuda"))
            out = [prims.forward(n, kg, x, y, w),
                   *prims.backward(n, kg, x, y, w, g, (True,) * 3)]
            if ref is None:
                ref = out
            same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(out, ref))
            f, _ = time_ms(lambda: prims.forward(n, kg, x, y, w))
            b111, _ = time_ms(lambda: prims.backward(n, kg, x, y, w, g, (True,) * 3))
            b011, _ = time_ms(lambda: prims.backward(n, kg, x, y, w, g, (False, True, True)))
            print(f"{str(dtype):14} {name:8} fwd {f:7.3f} ms  bwd(x,y,w) {b111:7.3f} ms  "
                  f"bwd(y,w) {b011:7.3f} ms  same={same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
