"""The launch plan and CUDA source of a :class:`~.spec.DmmaGemmSpec` (template
``kernels/dmma_gemm/gemm.cu.j2``): the forward ``a [M, narrow] W``.

Why: cuBLAS runs this float64 GEMM on the same DMMA units, but with K = 64 its tiles fall far
from the memory floor: on MACE-MP-medium's large graphs its forward writes well below the HBM
bandwidth (``scripts/bench_kernels.py dmma-gemm``). The product is a stream through memory with ~16
flops a byte, below the DMMA units' ~20 flops a byte on an H100, so the kernel keeps the narrow
side on chip and streams the wide one once: a warp holds its ``MT x 16`` rows of
``a [M, narrow]`` as A fragments in registers and walks the output columns 8 at a time, ``W``'s
fragments streamed through shared memory (cp.async, a ring of ``stages`` chunks of ``chunk``
column tiles shared by the block's warps). The backward ``g W^T`` stays on cuBLAS, which beat
a kernel of the same design on these shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Tuple

from mace_accel.ops.radial.dmma_gemm.spec import DmmaGemmSpec
from mace_accel.ops.limits import DEFAULT_SMS, LARGE_GRAPH_EDGES, OPTIN_SHARED, DeviceLimits
from mace_accel.ops.templates import render

ARCH = "sm_90"  # m16n8k8 in float64 is Hopper's (PTX ISA 7.8)
SHARED_LIMIT = OPTIN_SHARED  # an sm_90 block's dynamic shared memory, opted in (ARCH only)
# (warps, m-tiles per warp, column tiles per stage, stages): the fastest measured at 539k edges
# on an H100 (scripts/bench_kernels.py dmma-gemm): 64 -> 1280 2.33 ms with 16 warps of one m-tile
# (8 warps of two: 2.49-2.63 ms; 12 warps: 2.51-2.55 ms)
DEFAULT_GEOMETRY = (16, 1, 2, 4)
# below SMALL_ROWS rows the forward takes blocks of 4 warps (64 rows): 16-warp blocks of 256
# rows leave SMs idle (20k edges: 79 blocks for 132 SMs). Measured (the same script): 64 -> 1280
# at 20k edges 111 us vs 131 us (cuBLAS 121 us), at 44k 223 vs 255 us (cuBLAS 268 us); at 87k the
# default wins (415 vs 476 us)
SMALL_ROWS = LARGE_GRAPH_EDGES
SMALL_GEOMETRY = (4, 1, 2, 4)


@dataclasses.dataclass(frozen=True)
class DmmaGemmPlan:
    """What the template prints for one spec."""

    spec_key: str
    arch: str
    narrow: int
    wide: int
    tn: int
    tw: int
    warps: int
    mt: int
    chunk: int
    stages: int

    @property
    def chunks(self) -> int:
        """Stages per pass over ``W``: ``tw`` column tiles, ``chunk`` at a time."""
        return -(-self.tw // self.chunk)

    @property
    def stage_d2(self) -> int:
        """double2 of a ring stage: the W chunk."""
        return self.chunk * self.tn * 32

    @property
    def shared_bytes(self) -> int:
        return 16 * self.stages * self.stage_d2

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def block_rows(self) -> int:
        return 16 * self.mt * self.warps

    def grid(self, m: int, multiprocessors: int = DEFAULT_SMS, resident: int = 1) -> int:
        """Blocks: one per tile of ``block_rows`` rows, at most as many as the GPU holds at once
        (``resident`` a multiprocessor); blocks stride over the row tiles, so the ring's W chunks
        stream on across them."""
        return max(1, min(-(-m // self.block_rows), multiprocessors * resident))

    def describe(self) -> str:
        return (f"float64 DMMA GEMM [M, {self.narrow}] x [{self.narrow}, {self.wide}], "
                f"{self.warps} warps x {self.mt} m-tiles, {self.stages} stages of {self.chunk} "
                "column tiles")


def plan_kernel(spec: DmmaGemmSpec, arch: str = ARCH,
                geometry: Optional[Tuple[int, int, int, int]] = None) -> DmmaGemmPlan:
    """The plan of ``spec``'s kernel: :data:`DEFAULT_GEOMETRY`, or ``geometry``
    ``(warps, m-tiles per warp, column tiles per stage, stages)`` (benchmarks).

    Raises:
        ValueError: a geometry out of range, or one whose ring does not fit the shared memory.
    """
    warps, mt, chunk, stages = geometry or DEFAULT_GEOMETRY
    if not (1 <= warps <= 32 and 1 <= mt <= 4 and chunk >= 1 and stages >= 2):
        raise ValueError(f"geometry {(warps, mt, chunk, stages)}: want 1-32 warps, 1-4 m-tiles, "
                         "a chunk of at least one tile and at least two stages")
    plan = DmmaGemmPlan(spec.key(), arch, spec.narrow, spec.wide, spec.tn, spec.tw, warps, mt,
                        chunk, stages)
    if plan.shared_bytes > SHARED_LIMIT:
        raise ValueError(f"geometry {(warps, mt, chunk, stages)} needs {plan.shared_bytes} bytes "
                         f"of shared memory, over {SHARED_LIMIT}")
    return plan


def kernel_name(plan: DmmaGemmPlan) -> str:
    return (f"mace_dmma_gemm_{plan.spec_key}_forward_w{plan.warps}m{plan.mt}"
            f"c{plan.chunk}s{plan.stages}")


def render_kernel(plan: DmmaGemmPlan) -> str:
    return render("dmma_gemm/gemm.cu.j2", plan=plan, name=kernel_name(plan))


# what every test and the CI compile cover: MACE-MP's radial last layers (64 -> 512 and 1280;
# MP-large 64 -> 1792), a small model's, and ragged widths (odd narrow, wide not a multiple of 8)
CATALOG = {
    "mp_l1": DmmaGemmSpec(64, 512),
    "mp_l2": DmmaGemmSpec(64, 1280),
    "large": DmmaGemmSpec(64, 1792),
    "small": DmmaGemmSpec(16, 96),
    "ragged": DmmaGemmSpec(37, 302),
}
# a geometry besides the defaults the GPU tests run (and CI compiles): two m-tiles a warp
TESTED_GEOMETRY = (8, 2, 4, 4)


def catalog_sources(limits: DeviceLimits) -> Iterator[Tuple[str, str]]:
    """``(name, source)`` of every catalog spec's kernels (sm_90 only: elsewhere float64 stays
    with cuBLAS)."""
    if limits.arch != ARCH:
        return
    for name, spec in sorted(CATALOG.items()):
        for geometry in (None, SMALL_GEOMETRY, TESTED_GEOMETRY):
            plan = plan_kernel(spec, limits.arch, geometry)
            tail = "" if geometry is None else "_" + "x".join(map(str, geometry))
            yield f"dmma_gemm/{name}_forward{tail}", render_kernel(plan)
