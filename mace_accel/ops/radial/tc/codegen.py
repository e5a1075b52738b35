"""The launch plan and CUDA source of one :class:`~.spec.RadialSpec` (template
``kernels/radial_tc/forward.cu.j2``): the radial MLP's forward in one kernel.

A block takes 64 edges through every layer with 8 warps (a 2 x 4 grid); its inputs, hidden
activations and hidden weights sit in shared memory (dynamic: more than the 48 KB of static),
the last layer's weight streams through it in tiles of 128 columns, two stages deep: about
96 KB for MACE-MP widths, two blocks per SM. It writes the output and the hidden layers'
pre-activations; the backward runs the 3xTF32 GEMMs with SiLU epilogues
(:mod:`mace_accel.ops.tf32x3_gemm`) on them (on sm_90 the forward is :mod:`.wgmma`'s and the
input gradient one kernel, :mod:`.wgmma_backward`).

Against the layer-by-layer 3xTF32 kernels it replaces (``scripts/bench_kernels.py radial-tc``,
MACE-MP's 10 -> 64 -> 64 -> 64 -> 1280 and 512-wide nets) the forward is a little faster on
small graphs and takes about two thirds of their time on large ones. Two backward kernels were
tried and dropped: one that recomputed the hidden layers (178 KB of shared memory, one block per
SM: slower than the layer-by-layer backward), and one that took the hidden layers' backward in
a single launch after the last layer's GEMM (no faster: not worth a kernel).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Tuple

from mace_accel.ops.limits import OPTIN_SHARED, RESERVED_SHARED, SM_SHARED, DeviceLimits
from mace_accel.ops.radial.tc.spec import RadialSpec
from mace_accel.ops.templates import render

BM = 64  # edges per block
BN = 128  # columns of the last layer per forward tile
FLOAT = 4


@dataclasses.dataclass(frozen=True)
class RadialPlan:
    """Shared-memory layout (offsets in floats) and shapes the templates print; ``hidden``:
    per hidden layer a dict ``k``, ``n`` (padded widths), ``width`` (unpadded output width),
    ``ni`` (mma tiles per warp column), ``lda`` (row stride of its input in shared memory),
    ``offset`` (of its weight in the packed buffer), ``smem`` (of its weight in the weight
    region); ``zw``: the widest hidden layer (row width of the pre-activations written)."""

    spec_key: str
    arch: str
    h0: int
    p0: int
    ph: int
    kl: int
    n_out: int
    n_tiles: int
    w_last_offset: int
    hidden: tuple
    zw: int
    fwd_floats: int

    @property
    def threads(self) -> int:
        return 256

    @property
    def fwd_shared_bytes(self) -> int:
        return self.fwd_floats * FLOAT

    @property
    def fwd_min_blocks(self) -> int:
        return max(1, min(2, SM_SHARED // (self.fwd_shared_bytes + RESERVED_SHARED)))

    def grid(self, m: int) -> int:
        return max(1, -(-m // BM))


def plan_kernel(spec: RadialSpec, arch: str = "sm_90") -> RadialPlan:
    """The plan of ``spec``'s kernel.

    Raises:
        ValueError: the layout does not fit the opt-in shared memory of a block.
    """
    p = spec.padded_widths
    offsets = spec.offsets()
    n_hidden = len(p) - 2
    ph = max(p[1:-1])
    hidden, at = [], 0
    for i in range(n_hidden):
        k, n = p[i], p[i + 1]
        hidden.append(dict(k=k, n=n, width=spec.widths[i + 1], ni=n // 32,
                           lda=(p[0] if i == 0 else ph) + 4, offset=offsets[i], smem=at))
        at += n * (k + 4)
    kl, n_out = p[-2], p[-1]
    fwd = BM * (p[0] + 4) + BM * (ph + 4) + max(at, 2 * BN * (kl + 4))
    if fwd * FLOAT > OPTIN_SHARED:
        raise ValueError(f"{spec.describe()}: the kernel needs {fwd * FLOAT} bytes of shared "
                         f"memory, over the {OPTIN_SHARED} a block can have")
    return RadialPlan(spec.key(), arch, spec.widths[0], p[0], ph, kl, n_out, -(-n_out // BN),
                      offsets[-1], tuple(hidden), spec.hidden_width, fwd)


def kernel_name(plan: RadialPlan) -> str:
    return f"mace_radial_tc_{plan.spec_key}"


def render_kernel(plan: RadialPlan) -> str:
    return render("radial_tc/forward.cu.j2", plan=plan, name=kernel_name(plan))


# what every test and the CI compile cover: MACE-MP's two radial MLPs (64 -> 512 and
# 64 -> 1280 last layers, 10 Bessel features), MP-large's 1792, MACE-OFF's 8 features, and
# ragged widths (padding inside every layer, a partial last tile)
CATALOG = {
    "mp_l1": RadialSpec((10, 64, 64, 64, 512)),
    "mp_l2": RadialSpec((10, 64, 64, 64, 1280)),
    "mp_large": RadialSpec((10, 64, 64, 64, 1792)),
    "off": RadialSpec((8, 64, 64, 64, 1024)),
    "ragged": RadialSpec((5, 20, 36, 300)),
}


def catalog_sources(limits: DeviceLimits) -> Iterator[Tuple[str, str]]:
    """``(name, source)`` of every catalog kernel (float32 only: float64 keeps cuBLAS, which
    runs on the FP64 tensor cores): the mma.sync kernels, then the wgmma ones (sm_90a), forward
    and backward, in the variant each spec runs and in those the GPU tests run."""
    from mace_accel.ops.radial.tc import wgmma, wgmma_backward

    for name, spec in sorted(CATALOG.items()):
        yield f"radial_tc/{name}", render_kernel(plan_kernel(spec, limits.arch))
    for name, spec in sorted(CATALOG.items()):
        variants = {wgmma.default_variant(spec), *wgmma.TESTED_VARIANTS}
        for variant in sorted(variants):
            plan = wgmma.plan_kernel(spec, *variant)
            yield f"radial_tc/{name}_{wgmma.kernel_name(plan)}", wgmma.render_kernel(plan)
        backward = {wgmma_backward.DEFAULT_VARIANT, *wgmma_backward.TESTED_VARIANTS}
        for variant in sorted(backward):
            plan = wgmma_backward.plan_backward(spec, *variant)
            yield (f"radial_tc/{name}_{wgmma_backward.kernel_name(plan)}",
                   wgmma_backward.render_backward(plan))
