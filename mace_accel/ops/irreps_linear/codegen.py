"""The launch plan and CUDA source of one :class:`~.spec.LinearSpec` (template
``kernels/irreps_linear/apply.cu.j2``). The backward of a map is the same kernel for the
transposed spec, so one template serves every pass."""

from __future__ import annotations

import dataclasses
from typing import List

from mace_accel.ops.irreps_linear.spec import LinearSpec
from mace_accel.ops.limits import BLOCKS_PER_SM, DEFAULT_SMS, STATIC_SHARED, WARP
from mace_accel.ops.templates import RealType, render

# static shared memory per block (at most STATIC_SHARED): the staged input tile, then the
# warps' partial sums (one buffer)
TILE_BYTES = 32 * 1024
# the geometry, the fastest that ``scripts/bench_kernels.py irreps-linear`` measured against
# other tiles (its ``--variants``, in git history) on MACE-MP maps at 280 and 6,912 nodes: 4
# nodes per tile, 2 output channels per thread where blocks are wide
TILE_NODES = 4
# warps splitting the input channels of a block (each warp takes every KS-th u)
MAX_K_SPLIT = 4
# global loads each thread has in flight while staging a tile
MAX_BATCH = 8
LANES = WARP


def vector_width(dtype: str) -> int:
    """Values of ``dtype`` in one 16-byte vector load (float4 / double2)."""
    return 2 if dtype == "float64" else 4


@dataclasses.dataclass(frozen=True)
class LinearPlan(RealType):
    """Kernel geometry: ``tile_nodes`` nodes per block pass (a multiple of ``vec_width``, the
    nodes one vector load of the staged tile holds), ``k_split`` warps per block sharing the sum
    over input channels, ``v_tile`` output channels per thread (32 * v_tile per block), blocks
    of the output with their instructions (dicts the template prints), ``buffer`` shared-memory
    elements."""

    spec_key: str
    dtype: str
    arch: str
    dim_in: int
    dim_out: int
    indexed: bool
    tile_nodes: int
    k_split: int
    v_tile: int
    buffer: int
    out_blocks: tuple

    @property
    def threads(self) -> int:
        return LANES * self.k_split

    @property
    def vec_width(self) -> int:
        return vector_width(self.dtype)

    @property
    def vec(self) -> str:
        return "double2" if self.dtype == "float64" else "float4"

    @property
    def components(self) -> tuple:
        return ("x", "y", "z", "w")[:self.vec_width]

    def grid(self, n_nodes: int, multiprocessors: int = DEFAULT_SMS) -> tuple:
        """``(node tiles, output blocks, slices of 32 * v_tile channels)``: the tiles capped at
        16 blocks per SM in all (a block then walks several tiles with its weights in L1)."""
        tiles = -(-n_nodes // self.tile_nodes)
        blocks = max(1, len(self.out_blocks))
        width = LANES * self.v_tile
        slices = max([-(-b["mul"] // width) for b in self.out_blocks] or [1])
        cap = max(1, multiprocessors * BLOCKS_PER_SM // (blocks * slices))
        return (max(1, min(tiles, cap)), blocks, slices)


def plan_kernel(spec: LinearSpec, dtype: str, arch: str = "sm_90") -> LinearPlan:
    """The geometry of ``spec``'s kernel. A map whose blocks would overflow the shared memory
    (high-L irreps in float64) gets fewer warps per block, then fewer nodes per tile.

    Raises:
        ValueError: a map that does not fit even with one warp and one vector of nodes.
    """
    vec_width = vector_width(dtype)
    used = [spec.in_blocks[i.i_in] for i in spec.instructions]
    v_tile = 2 if max([b.mul for b in spec.out_blocks] or [1]) >= 2 * LANES else 1
    tile = TILE_NODES
    split = max(1, min(MAX_K_SPLIT, -(-max([a.mul for a in used] or [1]) // LANES)))
    while True:
        plan = _plan(spec, dtype, arch, tile, split, v_tile)
        if plan.buffer * plan.real_bytes <= STATIC_SHARED:
            return plan
        if split > 1:
            split -= 1
        elif tile > vec_width:
            tile -= vec_width
        else:
            raise ValueError(f"the geometry tile_nodes={tile}, k_split={split}, "
                             f"v_tile={v_tile} needs {plan.buffer * plan.real_bytes} bytes of "
                             f"shared memory ({dtype}); at most {STATIC_SHARED}")


def _plan(spec: LinearSpec, dtype: str, arch: str, tile: int, k_split: int,
          v_tile: int) -> LinearPlan:
    real_bytes = 8 if dtype == "float64" else 4
    max_d = max([b.d for b in spec.out_blocks] or [1])
    threads = LANES * k_split
    out_blocks = []
    staged = 1
    for o, blk in enumerate(spec.out_blocks):
        ins: List[dict] = []
        for i in spec.instructions:
            if i.i_out == o:
                a = spec.in_blocks[i.i_in]
                # input channels staged per pass: the whole block where the tile fits
                chunk = max(1, min(a.mul, TILE_BYTES // (tile * a.d * real_bytes)))
                stage = tile * chunk * a.d
                staged = max(staged, stage)
                ins.append(dict(in_offset=a.offset, mul_in=a.mul, size=a.size, chunk=chunk,
                                w_offset=i.w_offset,
                                batch=max(1, min(MAX_BATCH, -(-stage // threads)))))
        out_blocks.append(dict(offset=blk.offset, mul=blk.mul, d=blk.d, instructions=ins))
    buffer = max(staged, k_split * tile * max_d * LANES)
    return LinearPlan(spec.key(), dtype, arch, spec.dim_in, spec.dim_out, spec.indexed, tile,
                      k_split, v_tile, buffer, tuple(out_blocks))


def kernel_name(plan: LinearPlan) -> str:
    return f"mace_linear_{plan.spec_key}_{plan.dtype}"


def render_kernel(plan: LinearPlan) -> str:
    return render("irreps_linear/apply.cu.j2", plan=plan, name=kernel_name(plan))
