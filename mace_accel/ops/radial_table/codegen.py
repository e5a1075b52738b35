"""The radial table's kernel sources (``kernels/radial_table/``): the plan of one direction for
one row width, its name and source, and the catalog CI compiles."""

from __future__ import annotations

import dataclasses
from typing import Iterator, Tuple

from mace_accel.ops.limits import DeviceLimits
from mace_accel.ops.templates import render

THREADS = 256
# positions of the length order per forward block: enough edges that most of a block's lookups
# share the cells whose rows it has read into L1 (a 539k-edge graph over a 1024-cell table has
# ~500 edges a cell)
FORWARD_EDGES = 32
DIRECTIONS = ("forward", "backward")
# the row widths CI compiles: MACE-MP medium's two interactions, MACE-MP large's, and a width
# that is not a multiple of 4 (the scalar kernels)
CATALOG_WIDTHS = (512, 1280, 1792, 2560, 90)


@dataclasses.dataclass(frozen=True)
class TablePlan:
    """``direction`` (forward / backward) for rows of ``n_out`` weights: vectors of ``vec``
    floats (4 where ``n_out`` allows)."""

    direction: str
    n_out: int
    threads: int = THREADS
    edges: int = FORWARD_EDGES

    @property
    def vec(self) -> int:
        return 4 if self.n_out % 4 == 0 else 1

    @property
    def nq(self) -> int:
        return self.n_out // self.vec

    @property
    def vec_type(self) -> str:
        return "float4" if self.vec == 4 else "float"


def plan_kernel(direction: str, n_out: int) -> TablePlan:
    """The plan of ``direction`` for rows of ``n_out`` weights.

    Raises:
        ValueError: an unknown direction or a width below 1.
    """
    if direction not in DIRECTIONS or n_out < 1:
        raise ValueError(f"radial table kernel: direction {direction!r} (one of {DIRECTIONS}), "
                         f"n_out {n_out} (>= 1)")
    return TablePlan(direction, n_out)


def kernel_name(plan: TablePlan) -> str:
    return f"mace_radial_table_{plan.direction}_n{plan.n_out}"


def render_kernel(plan: TablePlan) -> str:
    return render(f"radial_table/{plan.direction}.cu.j2", plan=plan, name=kernel_name(plan))


def catalog_sources(limits: DeviceLimits) -> Iterator[Tuple[str, str]]:
    """``(name, source)`` of both directions for every width of :data:`CATALOG_WIDTHS`."""
    del limits  # the kernels take any sm_80+ GPU alike
    for n_out in CATALOG_WIDTHS:
        for direction in DIRECTIONS:
            plan = plan_kernel(direction, n_out)
            yield f"radial_table/{kernel_name(plan)}", render_kernel(plan)
