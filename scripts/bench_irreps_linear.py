"""The equivariant linear kernels on the GPU: the generated kernel vs the plain-torch reference
(einsum on cuBLAS) for the catalog's maps at node counts of MACE-MP cells (280: a 256-atom cell
padded; 6,912 atoms), each captured ten times in a CUDA graph so launches do not hide the kernel;
CUDA events, medians, with the FLOPs and bytes each launch moves.

    python scripts/bench_irreps_linear.py --nodes 280,2048,6912 --maps message,skip89 \
        --variants 8:4:1,4:4:2 --dtypes float32

``--variants`` times other kernel geometries too, each ``tile_nodes:k_split:v_tile``
(:func:`mace_accel.ops.irreps_linear.codegen.plan_kernel`).
"""

from __future__ import annotations

import argparse

import torch

from mace_accel.bench.timing import graph_ms_per_launch
from mace_accel.ops.irreps_linear import autograd, codegen, gemm
from mace_accel.ops.irreps_linear.cuda import CudaIrrepsLinear
from mace_accel.ops.irreps_linear.catalog import CATALOG
from mace_accel.ops.irreps_linear.spec import LinearSpec

LAUNCHES = 10


def _variant(spec: LinearSpec, dtype: torch.dtype, geometry: str) -> CudaIrrepsLinear:
    """The kernel of ``spec`` with the geometry ``tile_nodes:k_split:v_tile``."""
    tile, split, v_tile = (int(v) for v in geometry.split(":"))
    kernel = CudaIrrepsLinear(spec, dtype, torch.device("cuda"))
    kernel.gemm_min_nodes = 2 ** 62
    kernel.plan = codegen.plan_kernel(spec, kernel.plan.dtype, kernel.plan.arch, tile_nodes=tile,
                                      k_split=split, v_tile=v_tile)
    return kernel


def _bench(name: str, spec: LinearSpec, nodes: int, dtype: torch.dtype, repeats: int,
           variants: list) -> None:
    key = autograd.register_spec(spec)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(nodes, spec.dim_in, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(spec.weight_numel, device="cuda", dtype=dtype, generator=gen) * 0.1
    elem = torch.randint(0, spec.num_elements, (nodes,), device="cuda", dtype=torch.int32,
                         generator=gen)
    cuda = CudaIrrepsLinear(spec, dtype, x.device)
    cuda.gemm_min_nodes = 2 ** 62  # the generated kernel at every size
    rows = {"kernel": lambda: cuda.apply(x, w, elem),
            "torch reference": lambda: autograd.reference(spec, x, w, elem)}
    if gemm.runs_on(spec):
        rows["cuBLAS GEMMs"] = lambda: gemm.apply(spec, x, w)
    for geometry in variants:
        try:
            kernel = _variant(spec, dtype, geometry)
        except ValueError as exc:  # a geometry the shared memory cannot hold
            print(f"{str(dtype)[6:]:8s} {name:8s} kernel {geometry}: {exc}")
            continue
        rows[f"kernel {geometry}"] = (lambda k: lambda: k.apply(x, w, elem))(kernel)
    real = 8 if dtype == torch.float64 else 4
    macs = sum(spec.in_blocks[i.i_in].size * spec.out_blocks[i.i_out].mul
               for i in spec.instructions)
    moved = nodes * (spec.dim_in + spec.dim_out) * real + spec.weight_numel * real
    for label, fn in rows.items():
        ms = graph_ms_per_launch(fn, LAUNCHES, repeats)
        print(f"{str(dtype)[6:]:8s} {name:8s} {nodes:6d} nodes  {label:18s} {ms * 1e3:8.1f} us"
              f"  {2 * macs * nodes / ms / 1e9:7.2f} TFLOP/s  {moved / ms / 1e6:6.0f} GB/s",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="280,2048,6912")
    parser.add_argument("--maps", default="message,skip89")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--variants", default="", help="geometries tile_nodes:k_split:v_tile")
    parser.add_argument("--dtypes", default="float32,float64")
    args = parser.parse_args()
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for name in args.maps.split(","):
            for label, spec in ((name, CATALOG[name]), (name + "_t", CATALOG[name].transposed())):
                for nodes in (int(n) for n in args.nodes.split(",")):
                    _bench(label, spec, nodes, dtype, args.repeats,
                           [v for v in args.variants.split(",") if v])


if __name__ == "__main__":
    main()
