"""The launch plans and CUDA sources of a :class:`~.spec.DmmaGemmSpec` (template
``kernels/dmma_gemm/gemm.cu.j2``), forward and backward.

Why: cuBLAS runs these float64 GEMMs on the same DMMA units, but with K = 64 (the forward) or
N = 64 (the backward) its tiles fall far from the memory floor: on MACE-MP-medium's large
graphs its backward ``[E, 1280] x [1280, 64]`` reads its input and its forward writes well below
the HBM bandwidth (``scripts/bench_dmma_gemm.py``). Both are streams through memory
with ~16 flops a byte, below the DMMA units' ~20 flops a byte on an H100, so each kernel keeps
the narrow side on chip and streams the wide one once:

* forward: a warp holds its ``MT x 16`` rows of ``a [M, narrow]`` as A fragments in registers
  and walks the output columns 8 at a time, ``W``'s fragments streamed through shared memory
  (cp.async, a ring of ``stages`` chunks of ``chunk`` column tiles shared by the block's warps);
* backward: a warp accumulates its ``MT x 16`` rows of ``[M, narrow]`` in registers while its
  rows of ``g [M, wide]`` and ``W^T``'s fragments stream through the same ring.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Tuple

from mace_accel.ops.dmma_gemm.spec import DmmaGemmSpec
from mace_accel.ops.limits import DEFAULT_SMS, LARGE_GRAPH_EDGES, OPTIN_SHARED, DeviceLimits
from mace_accel.ops.templates import render

ARCH = "sm_90"  # m16n8k8 in float64 is Hopper's (PTX ISA 7.8)
DIRECTIONS = ("forward", "backward")
SHARED_LIMIT = OPTIN_SHARED  # an sm_90 block's dynamic shared memory, opted in (ARCH only)
# (warps, m-tiles per warp, column tiles per stage, stages) by direction: the fastest measured
# at 539k edges on an H100 (scripts/bench_dmma_gemm.py): forward
# 64 -> 1280 2.33 ms with 16 warps of one m-tile (8 warps of two: 2.49-2.63 ms; 12 warps:
# 2.51-2.55 ms), backward 2.34 ms with 8 warps of two m-tiles (16 warps of one: 2.54 ms)
DEFAULT_GEOMETRY = {"forward": (16, 1, 2, 4), "backward": (8, 2, 4, 2)}
# below SMALL_ROWS rows the forward takes blocks of 4 warps (64 rows): 16-warp blocks of 256
# rows leave SMs idle (20k edges: 79 blocks for 132 SMs). Measured (the same script): 64 -> 1280
# at 20k edges 111 us vs 131 us (cuBLAS 121 us), at 44k 223 vs 255 us (cuBLAS 268 us); at 87k the
# default wins (415 vs 476 us)
SMALL_ROWS = LARGE_GRAPH_EDGES
SMALL_GEOMETRY = (4, 1, 2, 4)


@dataclasses.dataclass(frozen=True)
class DmmaGemmPlan:
    """What the template prints for one direction of a spec."""

    spec_key: str
    arch: str
    direction: str
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
        """double2 of a ring stage: the W chunk, and in the backward each warp's rows of
        ``g`` for it."""
        w = self.chunk * self.tn * 32
        return w if self.direction == "forward" else w + self.warps * self.mt * self.chunk * 64

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
        shape = (f"[M, {self.narrow}] x [{self.narrow}, {self.wide}]" if
                 self.direction == "forward" else f"[M, {self.wide}] x [{self.wide}, "
                                                  f"{self.narrow}]")
        return (f"float64 DMMA GEMM {shape}, {self.warps} warps x {self.mt} m-tiles, "
                f"{self.stages} stages of {self.chunk} column tiles")


def plan_kernel(spec: DmmaGemmSpec, direction: str, arch: str = ARCH,
                geometry: Tuple[int, int, int, int] = None) -> DmmaGemmPlan:
    """The plan of ``spec``'s ``direction`` kernel: :data:`DEFAULT_GEOMETRY`, or ``geometry``
    ``(warps, m-tiles per warp, column tiles per stage, stages)`` (benchmarks).

    Raises:
        ValueError: an unknown direction, a geometry out of range, or one whose ring does not
            fit the shared memory.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    warps, mt, chunk, stages = geometry or DEFAULT_GEOMETRY[direction]
    if not (1 <= warps <= 32 and 1 <= mt <= 4 and chunk >= 1 and stages >= 2):
        raise ValueError(f"geometry {(warps, mt, chunk, stages)}: want 1-32 warps, 1-4 m-tiles, "
                         "a chunk of at least one tile and at least two stages")
    plan = DmmaGemmPlan(spec.key(), arch, direction, spec.narrow, spec.wide, spec.tn, spec.tw,
                        warps, mt, chunk, stages)
    if plan.shared_bytes > SHARED_LIMIT:
        raise ValueError(f"geometry {(warps, mt, chunk, stages)} needs {plan.shared_bytes} bytes "
                         f"of shared memory, over {SHARED_LIMIT}")
    return plan


def kernel_name(plan: DmmaGemmPlan) -> str:
    return (f"mace_dmma_gemm_{plan.spec_key}_{plan.direction}_w{plan.warps}m{plan.mt}"
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
# geometries besides the defaults the GPU tests run (and CI compiles)
TESTED_GEOMETRY = {"forward": ((8, 2, 4, 4),), "backward": ((16, 1, 2, 4),)}


def catalog_sources(limits: DeviceLimits) -> Iterator[Tuple[str, str]]:
    """``(name, source)`` of every catalog spec's kernels (sm_90 only: elsewhere float64 stays
    with cuBLAS)."""
    if limits.arch != ARCH:
        return
    for name, spec in sorted(CATALOG.items()):
        for direction in DIRECTIONS:
            small = (SMALL_GEOMETRY,) if direction == "forward" else ()
            for geometry in (None, *small, *TESTED_GEOMETRY[direction]):
                plan = plan_kernel(spec, direction, limits.arch, geometry)
                tail = "" if geometry is None else "_" + "x".join(map(str, geometry))
                yield f"dmma_gemm/{name}_{direction}{tail}", render_kernel(plan)
