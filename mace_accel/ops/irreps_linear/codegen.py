"""The launch plan and CUDA source of one :class:`~.spec.LinearSpec` (template
``kernels/irreps_linear/apply.cu.j2``). The backward of a map is the same kernel for the
transposed spec, so one template serves every pass."""

from __future__ import annotations

import dataclasses
from typing import List

from mace_accel.ops.irreps_linear.spec import LinearSpec
from mace_accel.ops.limits import WARP
from mace_accel.ops.templates import RealType, render

# static shared memory per block for the staged input tile (below the 48 KB static limit)
TILE_BYTES = 24 * 1024
MAX_TILE_NODES = 8
MAX_THREADS = 128


@dataclasses.dataclass(frozen=True)
class LinearPlan(RealType):
    """Kernel geometry: ``tile_nodes`` nodes per block pass, ``threads`` output channels in
    flight, blocks of the output with their instructions (dicts the template prints)."""

    spec_key: str
    dtype: str
    arch: str
    dim_in: int
    dim_out: int
    indexed: bool
    tile_nodes: int
    threads: int
    max_block: int
    out_blocks: tuple

    def grid(self, n_nodes: int, multiprocessors: int = 132) -> tuple:
        """``(node tiles, output blocks)``: the tiles capped at 16 blocks per SM in all."""
        tiles = -(-n_nodes // self.tile_nodes)
        per_sm = max(1, 16 // max(1, len(self.out_blocks)))
        return (max(1, min(tiles, multiprocessors * per_sm)), max(1, len(self.out_blocks)))


def plan_kernel(spec: LinearSpec, dtype: str, arch: str = "sm_90") -> LinearPlan:
    real_bytes = 8 if dtype == "float64" else 4
    max_block = max([spec.in_blocks[i.i_in].size for i in spec.instructions] or [1])
    tile = max(1, min(MAX_TILE_NODES, TILE_BYTES // (max_block * real_bytes)))
    max_mul = max([b.mul for b in spec.out_blocks] or [1])
    threads = min(MAX_THREADS, -(-max_mul // WARP) * WARP)
    out_blocks = []
    for o, blk in enumerate(spec.out_blocks):
        ins: List[dict] = []
        for i in spec.instructions:
            if i.i_out == o:
                a = spec.in_blocks[i.i_in]
                ins.append(dict(in_offset=a.offset, mul_in=a.mul, size=a.size,
                                w_offset=i.w_offset))
        out_blocks.append(dict(offset=blk.offset, mul=blk.mul, d=blk.d, instructions=ins))
    return LinearPlan(spec.key(), dtype, arch, spec.dim_in, spec.dim_out, spec.indexed, tile,
                      threads, max_block, tuple(out_blocks))


def kernel_name(plan: LinearPlan) -> str:
    return f"mace_linear_{plan.spec_key}_{plan.dtype}"


def render_kernel(plan: LinearPlan) -> str:
    return render("irreps_linear/apply.cu.j2", plan=plan, name=kernel_name(plan))
