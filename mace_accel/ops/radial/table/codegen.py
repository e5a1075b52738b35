"""The radial table's kernel sources (``kernels/radial_table/``): the plan of one direction for
one row width, dtype and polynomial degree, its name and source, and the catalog CI
compiles."""

from __future__ import annotations

import dataclasses
from typing import Iterator, Tuple, Union

from mace_accel.ops.limits import DeviceLimits, resident_blocks
from mace_accel.ops.templates import RealType, render

# the forward and the sorted backward: blocks take this many consecutive positions of the
# length order (their threads reload their coefficients only where the cell changes: a
# 539k-edge graph over a 2048-cell table has ~260 edges a cell) and chunks of at most this many
# vectors of a row, one vector a thread: the forward's blocks take a whole row where it fits
# in 640 (rows written whole: a little faster than in 256-vector chunks,
# scripts/bench_kernels.py radial-table; 640 threads keep two blocks an SM), the sorted backward's
# walk the row in chunks of 256 (more blocks an SM)
TABLE_EDGES = 64
FORWARD_MAX_CHUNK = 640
SORTED_BACKWARD_MAX_CHUNK = 256
SORTED_BACKWARD_GROUP = 4  # edges whose d w a thread loads before it sums any (8 was slower)
BACKWARD_THREADS = 256  # the backward in any order: warps of a block, two edges each
# forward; backward in any order (the edges as they come: a cell per edge); backward in order
# of length (the coefficients held in registers across the edges of a cell)
DIRECTIONS = ("forward", "backward", "sorted_backward")
DTYPES = ("float32", "float64")
# the row widths CI compiles: MACE-MP medium's two interactions, MACE-MP large's, and widths
# that take the narrower vectors (odd: scalars in both dtypes; 2 mod 4: float2 in float32), and
# a density's one weight (rows narrower than the block: lanes of edges)
CATALOG_WIDTHS = (512, 1280, 1792, 2560, 90, 45, 1)
# the degree each dtype's tables have (ops/radial/table/table.py SPECS)
CATALOG_DEGREES = {"float32": 3, "float64": 5}
_VEC = {"float32": (4, 2, 1), "float64": (2, 1)}


@dataclasses.dataclass(frozen=True)
class TablePlan(RealType):
    """``direction`` (:data:`DIRECTIONS`) for rows of ``n_out`` weights of ``dtype``, the
    polynomial of ``degree``: vectors of ``vec`` reals (the widest that divides ``n_out``:
    16 bytes where it can)."""

    direction: str
    n_out: int
    dtype: str
    degree: int

    @property
    def edges(self) -> int:
        """Positions of the length order a block takes (the backward in any order: a grid
        stride loop, two positions a warp)."""
        return 2 * BACKWARD_THREADS // 32 if self.direction == "backward" else TABLE_EDGES

    @property
    def vec(self) -> int:
        return next(v for v in _VEC[self.dtype] if self.n_out % v == 0)

    @property
    def nq(self) -> int:
        return self.n_out // self.vec

    @property
    def chunks(self) -> int:
        """Chunks of a row: the forward's blocks along grid.y, the sorted backward's walked by
        each block in turn (the backward in any order: its warps take whole rows)."""
        if self.direction == "backward":
            return 1
        most = FORWARD_MAX_CHUNK if self.direction == "forward" else SORTED_BACKWARD_MAX_CHUNK
        return -(-self.nq // most)

    @property
    def threads(self) -> int:
        """Threads a block: one vector of a chunk each (the row split evenly into
        :attr:`chunks`, whole warps); the backward in any order :data:`BACKWARD_THREADS`."""
        if self.direction == "backward":
            return BACKWARD_THREADS
        per_chunk = -(-self.nq // self.chunks)
        return -(-per_chunk // 32) * 32

    @property
    def unroll(self) -> int:
        """The backward's row vectors a lane has in flight (16 bytes each)."""
        return 2

    @property
    def group(self) -> int:
        """The sorted backward's edges loaded at once (a power of 2, at most 32)."""
        return SORTED_BACKWARD_GROUP

    @property
    def log_group(self) -> int:
        return self.group.bit_length() - 1

    @property
    def nc(self) -> int:
        return self.degree + 1

    @property
    def vec_type(self) -> str:
        return self.real if self.vec == 1 else f"{self.real}{self.vec}"

    @property
    def components(self) -> Tuple[str, ...]:
        """How the kernels address a vector's components (``""``: a scalar)."""
        return ("",) if self.vec == 1 else tuple(f".{c}" for c in "xyzw"[:self.vec])


def plan_kernel(direction: str, n_out: int, dtype: str = "float32",
                degree: int = 3) -> TablePlan:
    """The plan of ``direction`` for rows of ``n_out`` weights of ``dtype`` (``"float32"`` or
    ``"float64"``), a polynomial of ``degree`` (odd, 1 to 7).

    Raises:
        ValueError: an unknown direction or dtype, a width below 1, a degree not taken.
    """
    if direction not in DIRECTIONS or dtype not in DTYPES or n_out < 1 \
            or degree not in (1, 3, 5, 7):
        raise ValueError(f"radial table kernel: direction {direction!r} (one of {DIRECTIONS}), "
                         f"dtype {dtype!r} (one of {DTYPES}), n_out {n_out} (>= 1), degree "
                         f"{degree} (1, 3, 5 or 7)")
    return TablePlan(direction, n_out, dtype, degree)


def kernel_name(plan: TablePlan) -> str:
    return f"mace_radial_table_{plan.direction}_{plan.dtype}_d{plan.degree}_n{plan.n_out}"


def render_kernel(plan: TablePlan) -> str:
    return render(f"radial_table/{plan.direction}.cu.j2", plan=plan, name=kernel_name(plan))


def grid(plan: TablePlan, edges: int, sms: int) -> Union[int, Tuple[int, int]]:
    """The launch grid of ``plan`` over ``edges`` edges on a device of ``sms`` SMs: the
    forward's (position blocks, row chunks); the sorted backward's position blocks; the
    backward in any order, a grid-stride loop (:func:`~mace_accel.ops.limits.resident_blocks`)."""
    blocks = -(-edges // plan.edges)
    if plan.direction == "forward":
        return (blocks, plan.chunks)
    if plan.direction == "sorted_backward":
        return blocks
    return resident_blocks(blocks, sms)


def catalog_sources(limits: DeviceLimits) -> Iterator[Tuple[str, str]]:
    """``(name, source)`` of every direction for every width of :data:`CATALOG_WIDTHS`, in
    each dtype with its tables' degree."""
    del limits  # the kernels take any sm_80+ GPU alike
    for dtype, degree in CATALOG_DEGREES.items():
        for n_out in CATALOG_WIDTHS:
            for direction in DIRECTIONS:
                plan = plan_kernel(direction, n_out, dtype, degree)
                yield f"radial_table/{kernel_name(plan)}", render_kernel(plan)
