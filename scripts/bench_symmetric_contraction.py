"""Time the fused symmetric contraction against mace's own module (GPU), same inputs.

For each catalog problem tagged ``bench``/``model`` and each dtype: forward, and forward +
backward to the node features (what an energy+forces call needs), median of CUDA-event-timed
repeats after warm-up; plus the bytes each pass must move (its HBM roofline) and the share of
that roofline reached. Prints a table; ``--json`` writes the rows.

    python scripts/bench_symmetric_contraction.py --nodes 6912 --repeats 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
from typing import Callable, Dict, List

import torch

from mace_accel.ops.symmetric_contraction.catalog import build

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}


def _time(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    from mace_accel.bench.timing import time_calls

    return time_calls(fn, "cuda", warmup, repeats).median_ms


def _bandwidth() -> float:
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in HBM_BYTES_PER_S.items() if key in name), 3.35e12)


def bench(name: str, dtype: torch.dtype, nodes: int, repeats: int, warmup: int) -> Dict:
    from mace_accel.options import AccelOptions
    from mace_accel.patches.product_blocks import FusedSymmetricContraction

    module, spec = build(name, "float64")
    module = module.to("cuda", dtype)
    for p in module.parameters():  # inference: gradients of the inputs only
        p.requires_grad_(False)
    fused = FusedSymmetricContraction(module, spec, AccelOptions(backend="cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(nodes, spec.num_features, spec.num_components, device="cuda", dtype=dtype,
                    generator=gen)
    elem = torch.randint(0, spec.num_elements, (nodes,), device="cuda", generator=gen)
    y = torch.nn.functional.one_hot(elem, spec.num_elements).to(dtype)
    g = torch.randn(nodes, spec.dim_out, device="cuda", dtype=dtype, generator=gen)
    xg = x.clone().requires_grad_(True)

    def fwd(m):
        return lambda: m(x, y)

    def fwd_bwd(m):
        return lambda: torch.autograd.grad(m(xg, y), xg, g)

    with torch.no_grad():
        err = ((fused(x, y) - module(x, y)).norm() / module(x, y).norm()).item()
    size = torch.finfo(dtype).bits // 8
    x_bytes, out_bytes = x.numel() * size, nodes * spec.dim_out * size
    roof_fwd = (x_bytes + out_bytes) / _bandwidth() * 1e3            # ms
    roof_fb = roof_fwd + (2 * x_bytes + out_bytes) / _bandwidth() * 1e3
    row = {"problem": name, "dtype": str(dtype).replace("torch.", ""), "nodes": nodes,
           "spec": spec.describe(), "rel_err_vs_mace": err}
    for label, make in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        row[f"mace_{label}_ms"] = _time(make(module), repeats, warmup)
        row[f"fused_{label}_ms"] = _time(make(fused), repeats, warmup)
    row["roofline_fwd_ms"], row["roofline_fwd_bwd_ms"] = roof_fwd, roof_fb
    row["fwd_bwd_share_of_roofline"] = roof_fb / row["fused_fwd_bwd_ms"]
    return row


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default="mp-medium-p1,mp-large-p1,mp-medium-p2")
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--nodes", type=int, default=6912)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    for name in args.problems.split(","):
        for dt in args.dtypes.split(","):
            rows.append(bench(name, getattr(torch, dt), args.nodes, args.repeats, args.warmup))
            r = rows[-1]
            print(f"symmetric contraction, {r['problem']} {r['dtype']} N={r['nodes']}: "
                  f"fwd mace {r['mace_fwd_ms']:.3f} ms fused {r['fused_fwd_ms']:.3f} ms | "
                  f"fwd+bwd mace {r['mace_fwd_bwd_ms']:.3f} fused {r['fused_fwd_bwd_ms']:.3f} ms "
                  f"({r['mace_fwd_bwd_ms'] / r['fused_fwd_bwd_ms']:.1f}x; roofline "
                  f"{r['roofline_fwd_bwd_ms']:.3f} ms = {100 * r['fwd_bwd_share_of_roofline']:.0f}%)"
                  f" err {r['rel_err_vs_mace']:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
