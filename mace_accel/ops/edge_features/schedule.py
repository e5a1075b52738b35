"""Launch plan of the edge-feature kernels: one thread per edge, grid-stride loops. Pure Python.

Every kernel of the family maps edge ``e`` to one thread, which reads the edge's inputs and
keeps everything in registers; blocks of ``threads`` threads walk the edges in tiles of
``threads`` edges (a grid-stride loop over tiles, at most ``max_blocks`` blocks, so any number of
edges runs in one launch). A kernel writing a wide row per edge (edge_attrs, the radial basis,
their double-backward gradients) stages the tile's rows in shared memory (odd row pitch: no bank
conflicts) and stores them coalesced: a strided store per thread and row reaches a fraction of
the write bandwidth that coalesced stores do. The
spherical-harmonics backward stages its wide input rows (the upstream gradient) the same way;
the radial backward and the double backwards read theirs in place, which measured faster there.
The plan is made from the device limits passed in, never assumed.
"""

from __future__ import annotations

import dataclasses
from typing import Union

from mace_accel.errors import KernelError
from mace_accel.ops.edge_features.spec import RadialSpec, SHSpec
from mace_accel.ops.limits import BLOCKS_PER_SM, WARP, DeviceLimits
from mace_accel.ops.templates import RealType

DTYPES = ("float32", "float64")
THREADS = 128
DEFAULT_LIMITS = DeviceLimits()  # an H100/H200 (sm_90): the pins and the CPU tests


@dataclasses.dataclass(frozen=True)
class EdgePlan(RealType):
    """Launch geometry of the kernels of one spec and dtype (forward, backward, double backward).

    Attributes:
        dtype: ``"float32"`` or ``"float64"``.
        arch: e.g. ``"sm_90"`` (recorded in the generated source).
        row: width of the widest row a kernel stages in shared memory (``dim`` or
            ``num_basis``).
        threads: threads (= edges of a tile) per block, the kernels' ``__launch_bounds__``.
        max_blocks: most blocks one launch uses.
    """

    dtype: str
    arch: str
    row: int
    threads: int = THREADS
    max_blocks: int = BLOCKS_PER_SM * DEFAULT_LIMITS.multiprocessors


    @property
    def pitch(self) -> int:
        """Row pitch of the shared-memory tile: odd, so the threads' row writes hit distinct
        banks."""
        return self.row | 1

    @property
    def tile_bytes(self) -> int:
        return self.threads * self.pitch * self.real_bytes

    def blocks(self, n_edges: int) -> int:
        """Grid size for ``n_edges`` edges (at least 1; the kernel loops over the rest)."""
        return max(1, min(self.max_blocks, -(-n_edges // self.threads)))


def plan_edges(dtype: str, row: int, limits: DeviceLimits = DEFAULT_LIMITS) -> EdgePlan:
    """The plan for ``dtype`` and rows of ``row`` values on a device with ``limits``: 128
    threads, fewer when the tile would not fit shared memory.

    Raises:
        KernelError: an unknown dtype, or a row too wide for one warp's tile.
    """
    if dtype not in DTYPES:
        raise KernelError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if limits.warp_size != WARP:
        raise KernelError(f"the kernels assume 32-thread warps, device has {limits.warp_size}")
    plan = EdgePlan(dtype=dtype, arch=limits.arch, row=int(row),
                    threads=min(THREADS, limits.max_threads_per_block),
                    max_blocks=BLOCKS_PER_SM * max(1, int(limits.multiprocessors)))
    while plan.tile_bytes > limits.max_shared_per_block and plan.threads > WARP:
        plan = dataclasses.replace(plan, threads=plan.threads // 2)
    if plan.tile_bytes > limits.max_shared_per_block or plan.threads < WARP:
        raise KernelError(f"rows of {row} {dtype} values do not fit a tile of {WARP} edges in "
                          f"{limits.max_shared_per_block} bytes of shared memory")
    return plan


def plan_for(spec: Union[SHSpec, RadialSpec], dtype: str,
             limits: DeviceLimits = DEFAULT_LIMITS) -> EdgePlan:
    """The plan of the three kernels of ``spec`` (rows: ``dim`` or ``num_basis`` values)."""
    row = spec.dim if isinstance(spec, SHSpec) else spec.num_basis
    return plan_edges(dtype, row, limits)
