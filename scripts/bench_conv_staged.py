"""The conv kernels with their rows staged in shared memory (``ops/conv_tp/staged.py``) against
the plain kernels: same process, same inputs, CUDA events, medians after warm-up.

For each dtype and stage shape (edges per tile x stages; ``plain`` = the register-prefetch
kernels): forward, deterministic backward (d node_feats, d edge_attrs, d tp_weights, the
per-sender sum included) and atomic backward times, the fraction of the HBM roofline of
forward + deterministic backward (``count_flops_bytes``, against a device copy measured here),
and whether every output is bit-identical to the plain kernels'.

    python scripts/bench_conv_staged.py [--problem mp-medium-l2] [--cells 12 4]
        [--shapes plain 4x3 2x4 8x2 4x2u2 plain:4x2] [--dtypes float32 float64]
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_conv_kernel import build_graph, copy_bandwidth, random_inputs, time_ms  # noqa: E402

from mace_accel.ops.conv_tp import codegen  # noqa: E402
from mace_accel.ops.conv_tp.catalog import CATALOG  # noqa: E402
from mace_accel.ops.conv_tp.cuda import CudaConvPrimitives  # noqa: E402
from mace_accel.ops.conv_tp.schedule import count_flops_bytes  # noqa: E402
from mace_accel.ops.conv_tp.spec import make_spec  # noqa: E402
from mace_accel.ops.conv_tp.staged import Staging  # noqa: E402
from mace_accel.ops.graph import KernelGraph, graph_from_edge_index  # noqa: E402

NEEDS = (True, True, True)
HOIST, HOIST_H, OUTER = codegen.HOIST_G_WORDS, codegen.HOIST_H_VALUES, codegen.OUTER_FWD_VALUES


def _shape(text: str):
    """``"4x2"``: 4 edges a tile, 2 stages; ``"4x2u2"``: unroll 2; a trailing ``s``: one input
    segment per launch; ``plain``: the plain kernels."""
    if text == "plain":
        return None
    by_segment = text.endswith("s")
    body, _, unroll = text.rstrip("s").partition("u")
    edges, stages = (int(v) for v in body.split("x"))
    return Staging(edges, stages, int(unroll or 0), by_segment)


def staging(shape: str):
    """``SHAPE`` for both directions, or ``FWD:BWD`` (a trailing ``/h0``: the backward reads
    the node's output gradient per edge instead of holding it in registers; ``/H<n>``: the
    backward holds ``h`` where it takes at most n values, codegen.HOIST_H_VALUES; ``/O0``: the
    forward forms ``u`` per edge instead of accumulating the outer product,
    codegen.OUTER_FWD_VALUES)."""
    shape = shape.split("/")[0]
    fwd, _, bwd = shape.partition(":")
    return {"forward": _shape(fwd), "backward": _shape(bwd or fwd)}


def run(problem: str, cells: int, dtype: torch.dtype, shapes, bw: float, repeats: int) -> None:
    device = torch.device("cuda")
    spec = make_spec(*CATALOG[problem].irreps)
    n, edge_index = build_graph(cells, 6.0, device)
    graph = KernelGraph(*graph_from_edge_index(edge_index, n).tensors("cuda"))
    e = edge_index.shape[1]
    x, y, w, g = random_inputs(spec, n, e, dtype, device)
    roof = count_flops_bytes(spec, n, e, str(dtype).replace("torch.", ""))
    ref = None
    print(f"\n{problem} {str(dtype)[6:]} {n} atoms {e} edges")
    print(f"{'shape':>12} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'roof':>5} {'atomic bwd':>10} "
          f"{'f+b atomic':>10} {'roof':>5}  bits")
    for shape in shapes:
        # kernels are rendered on their first call, below
        codegen.HOIST_G_WORDS = 0 if shape.endswith("/h0") else HOIST
        codegen.HOIST_H_VALUES = int(shape.split("/H")[1].split("/")[0]) if "/H" in shape \
            else HOIST_H
        codegen.OUTER_FWD_VALUES = 0 if "/O0" in shape else OUTER
        prims = CudaConvPrimitives(spec, dtype, device, staging=staging(shape))
        atomic = CudaConvPrimitives(spec, dtype, device, deterministic=False,
                                    staging=staging(shape))
        prims.staged_min_edges = atomic.staged_min_edges = 0  # the shape asked for, any size
        out = prims.forward(n, graph, x, y, w)
        grads = prims.backward(n, graph, x, y, w, g, NEEDS)
        agx = atomic.backward(n, graph, x, y, w, g, NEEDS)[0]
        res = [out, *grads]
        if ref is None:
            ref, same = res, "reference"
        else:
            diffs = [float((a - b).abs().max()) for a, b in zip(res, ref)]
            same = "identical" if max(diffs) == 0 else f"DIFFER {diffs}"
        codegen.HOIST_G_WORDS, codegen.HOIST_H_VALUES = HOIST, HOIST_H
        codegen.OUTER_FWD_VALUES = OUTER
        adiff = float((agx - ref[1]).abs().max() / ref[1].abs().max())
        ran = ",".join(sorted({("staged " if "_st" in k else "plain ") + k.split("_")[2]
                               for k in prims._kernels if "sender" not in k}))
        t_f, _ = time_ms(lambda: prims.forward(n, graph, x, y, w), repeats=repeats)
        t_b, _ = time_ms(lambda: prims.backward(n, graph, x, y, w, g, NEEDS), repeats=repeats)
        t_a, _ = time_ms(lambda: atomic.backward(n, graph, x, y, w, g, NEEDS), repeats=repeats)
        fb = roof["fwd_bytes"] + roof["bwd_bytes"]
        print(f"{shape:>12} {t_f:8.3f} {t_b:8.3f} {t_f + t_b:8.3f} "
              f"{100 * fb / ((t_f + t_b) * 1e-3) / bw:4.0f}% {t_a:10.3f} {t_f + t_a:10.3f} "
              f"{100 * fb / ((t_f + t_a) * 1e-3) / bw:4.0f}%  {ran}, {same} (atomic d x {adiff:.1e})",
              flush=True)
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--problem", default="mp-medium-l2")
    parser.add_argument("--cells", type=int, nargs="+", default=[12, 4])
    parser.add_argument("--shapes", nargs="+", default=["plain", "4x3", "2x4", "8x2"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s")
    for cells in args.cells:
        for dtype in args.dtypes:
            run(args.problem, cells, getattr(torch, dtype), args.shapes, bw, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
