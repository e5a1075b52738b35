"""Is the conv backward worth splitting across two streams? The MACE-MP-medium layer-2 conv
backward (gradients to node_feats, edge_attrs and tp_weights) as one kernel, against the
``d x, d y`` kernel alone (what would stay on the critical path) and against both halves run
concurrently on two streams, each captured in a CUDA graph; CUDA events, medians.

    python scripts/bench_conv_split.py --cells 4,6 --dtypes float32
"""

from __future__ import annotations

import argparse

import torch

from mace_accel.bench.timing import graph_ms_per_launch
from mace_accel.ops.conv_tp import autograd
from mace_accel.ops.conv_tp.catalog import CATALOG
from mace_accel.ops.conv_tp.spec import make_e3nn_conv_tp, spec_from_e3nn
from mace_accel.ops.graph import graph_from_edge_index

LAUNCHES = 10


def _build_graph(cells: int, device):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_conv_kernel import build_graph  # the benchmark's fcc Cu graph

    return build_graph(cells, 6.0, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default="4,6")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda")
    spec = spec_from_e3nn(make_e3nn_conv_tp(*CATALOG["mp-medium-l2"].irreps))
    key = autograd.register_spec(spec)
    for cells in (int(c) for c in args.cells.split(",")):
        n, edge_index = _build_graph(cells, device)
        graph = graph_from_edge_index(edge_index, n).tensors("cuda")
        e = edge_index.shape[1]
        for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
            gen = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(n, spec.dim_in1, device=device, dtype=dtype, generator=gen)
            y = torch.randn(e, spec.dim_in2, device=device, dtype=dtype, generator=gen)
            w = torch.randn(e, spec.weight_numel, device=device, dtype=dtype, generator=gen)
            g = torch.randn(n, spec.dim_out, device=device, dtype=dtype, generator=gen)
            side = torch.cuda.Stream(device=device)

            def bwd(need_x, need_y, need_w):
                return autograd.conv_tp_backward_op(x, y, w, g, graph, n, key, "cuda", True,
                                                    need_x, need_y, need_w)

            def split():
                main = torch.cuda.current_stream(device)
                side.wait_stream(main)
                out = bwd(True, True, False)
                with torch.cuda.stream(side):
                    gw = bwd(False, False, True)
                main.wait_stream(side)
                return out, gw

            rows = {"joint x1y1w1": lambda: bwd(True, True, True),
                    "dx,dy only x1y1w0": lambda: bwd(True, True, False),
                    "dw only x0y0w1": lambda: bwd(False, False, True),
                    "dy,dw x0y1w1": lambda: bwd(False, True, True),
                    "dx only x1y0w0": lambda: bwd(True, False, False),
                    "split on 2 streams": split}
            for label, fn in rows.items():
                ms = graph_ms_per_launch(fn, LAUNCHES, args.repeats)
                print(f"{str(dtype)[6:]:8s} {n:6d} nodes {e:8d} edges  {label:20s} "
                      f"{ms * 1e3:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
