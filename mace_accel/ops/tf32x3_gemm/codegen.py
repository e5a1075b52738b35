"""The launch plan and CUDA source of one :class:`~.spec.GemmSpec` (template
``kernels/tf32x3_gemm/gemm.cu.j2``).

Two block shapes, both with warps of 32 x 32 outputs and under the 48 KB of static shared
memory: wide outputs (the forward, ``n`` in the hundreds) take 64 x 128 tiles (8 warps, slices
of 16 along K three deep), narrow ones (the backward's ``d h``, ``n`` = hidden width, K in the
thousands) 64 x 64 tiles (4 warps, slices of 32 two deep).

Against torch.mm on cuBLAS's float32 kernels (``scripts/bench_kernels.py tf32x3-gemm``, MACE-MP's
64 -> 1280 layer): faster on small graphs and in the backward, on par in the large forward.
Relative L-infinity error against a float64 product: 2-4e-7 (cuBLAS 4e-7 forward, 0.7-1.9e-6
backward). Tried and slower: 128 x 128 tiles (16 warps), 64 x 64 forward tiles, 32 x 128
tiles.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Tuple

from mace_accel.ops.limits import STATIC_SHARED, DeviceLimits
from mace_accel.ops.tf32x3_gemm.spec import GemmSpec
from mace_accel.ops.templates import render

# (bm, bn, bk, warps_m, warps_n, stages)
WIDE = (64, 128, 16, 2, 4, 3)
NARROW = (64, 64, 32, 2, 2, 2)
WIDE_FROM = 128  # output widths from here take the wide tiles


class WarpTiles:
    """Warp geometry of a tensor-core tile (shared by the 3xTF32 plan and the equivariant
    linears' 3xFP16 one, :class:`~mace_accel.ops.irreps_linear.fp16x3.Fp16x3Plan`): ``bm x bn``
    outputs a block, ``warps_m x warps_n`` warps of ``mi x ni`` mma tiles (16 x 8)."""

    bm: int
    bn: int
    warps_m: int
    warps_n: int

    @property
    def mi(self) -> int:
        return self.bm // (16 * self.warps_m)

    @property
    def ni(self) -> int:
        return self.bn // (8 * self.warps_n)

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n


@dataclasses.dataclass(frozen=True)
class GemmPlan(WarpTiles):
    """Tile geometry of one kernel: ``bm x bn`` outputs per block, ``bk`` of K per stage,
    ``warps_m x warps_n`` warps of ``mi x ni`` mma tiles (16 x 8) each."""

    spec_key: str
    arch: str
    k: int
    n: int
    b_layout: str
    epilogue: str
    bm: int
    bn: int
    bk: int
    warps_m: int
    warps_n: int
    stages: int

    @property
    def shared_bytes(self) -> int:
        b = self.bk * (self.bn + 8) if self.b_layout == "kn" else self.bn * (self.bk + 4)
        return 4 * self.stages * (self.bm * (self.bk + 4) + b)

    def grid(self, m: int) -> Tuple[int, int]:
        """The blocks over ``m`` rows."""
        return max(1, -(-m // self.bm)), -(-self.n // self.bn)


def plan_kernel(spec: GemmSpec, arch: str = "sm_90",
                geometry: Optional[Tuple[int, int, int, int, int, int]] = None) -> GemmPlan:
    """The plan of ``spec``: :data:`WIDE` or :data:`NARROW` tiles by the output width, or
    ``geometry`` ``(bm, bn, bk, warps_m, warps_n, stages)`` (benchmarks).

    Raises:
        ValueError: a geometry that does not tile (warp tiles of whole 16 x 8 mma tiles, ``bk``
            a multiple of 8) or does not fit the static shared memory.
    """
    geo = geometry or (WIDE if spec.n >= WIDE_FROM else NARROW)
    bm, bn, bk, wm, wn, stages = geo
    if bm % (16 * wm) or bn % (8 * wn) or bk % 8 or stages < 2 or wm * wn * 32 > 1024:
        raise ValueError(f"tile geometry {geo} does not split into warps of 16x8 mma tiles "
                         "(bm % 16 warps_m, bn % 8 warps_n, bk % 8, stages >= 2)")
    plan = GemmPlan(spec.key(), arch, spec.k, spec.n, spec.b_layout, spec.epilogue, *geo)
    if plan.shared_bytes > STATIC_SHARED:
        raise ValueError(f"tile geometry {geo} needs {plan.shared_bytes} bytes of shared "
                         f"memory, over the {STATIC_SHARED} static limit")
    return plan


def kernel_name(plan: GemmPlan) -> str:
    return (f"mace_tf32x3_gemm_{plan.spec_key}_{plan.bm}x{plan.bn}x{plan.bk}"
            f"_w{plan.warps_m}x{plan.warps_n}_s{plan.stages}")


def render_kernel(plan: GemmPlan) -> str:
    return render("tf32x3_gemm/gemm.cu.j2", plan=plan, name=kernel_name(plan))


# the shapes every test and the CI compile cover: MACE-MP's radial last layers (64 -> 512,
# 64 -> 1280; MP-large 64 -> 1792) forward and backward, widths that leave ragged tiles, and the
# hidden layers with their SiLU
CATALOG = {
    "mp_l1_fwd": GemmSpec(64, 512, "nk"),
    "mp_l2_fwd": GemmSpec(64, 1280, "nk"),
    "mp_l2_bwd": GemmSpec(1280, 64, "kn"),
    "large_fwd": GemmSpec(64, 1792, "nk"),
    "ragged_fwd": GemmSpec(36, 300, "nk"),
    "ragged_bwd": GemmSpec(300, 36, "kn"),
    # the radial MLP's hidden layers (64 -> 64 with SiLU) forward and backward
    "hidden_fwd": GemmSpec(64, 64, "nk", "silu"),
    "hidden_bwd": GemmSpec(64, 64, "kn", "silu_grad"),
}


def catalog_sources(limits: DeviceLimits) -> Iterator[Tuple[str, str]]:
    """``(name, source)`` of every catalog GEMM (float32 only: float64 stays with cuBLAS,
    which runs it on the FP64 tensor cores)."""
    for name, spec in sorted(CATALOG.items()):
        yield f"tf32x3_gemm/{name}", render_kernel(plan_kernel(spec, limits.arch))
