"""The launch plan and CUDA sources of one :class:`~.spec.SiluMLPSpec` (templates
``kernels/silu_mlp/``).

A block takes a tile of ``tile_edges`` edges through every layer: the tile's activations live
in shared memory (transposed, ``[width][tile]``), each thread computes ``me x mn`` micro-tiles
of a layer's output (register-blocked FMAs, the layer's weights read through L1), so nothing
between the input ``[E, h0]`` and the output ``[E, h_L]`` touches memory. The backward kernel
recomputes the forward (keeping each thread's pre-activations in registers: the backward's
micro-tiles of a layer's output are the forward's) and writes only ``d x [E, h0]``.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Tuple

from mace_accel.ops.limits import BLOCKS_PER_SM, DEFAULT_SMS, DeviceLimits
from mace_accel.ops.radial.silu_mlp.spec import SiluMLPSpec
from mace_accel.ops.templates import RealType, render

MAX_THREADS = 256
# per dtype: (largest edge tile, micro-tile rows, micro-tile columns, row padding of the
# shared tiles: keeps 16-byte vector reads aligned and spreads the transposed writes' banks)
# (the geometry matters little: the L1-resident weights and the FMA issue rate bound every one
# of the 6 per dtype tried at MP-medium widths, on small and large graphs alike)
_GEOMETRY = {"float32": (32, 4, 4, 4), "float64": (32, 4, 2, 2)}
SHARED_BUDGET = 46 * 1024  # two activation tiles, under the 48 KB static limit


@dataclasses.dataclass(frozen=True)
class SiluMLPPlan(RealType):
    """Kernel geometry and the layers' constants (dicts the templates print).

    Attributes:
        widths, padded: the spec's widths and their padded kernel widths.
        tile_edges, me, mn, ld: edges per tile, micro-tile shape, shared row stride.
        layers: per layer ``k, n`` (padded in/out widths), ``w, wt`` (offsets of ``W`` and
            ``W^T`` in the packed weights), ``reps`` (micro-tiles per thread of its output).
        input_reps: micro-tiles per thread of the backward's ``d x`` (width ``padded[0]``).
    """

    spec_key: str
    dtype: str
    arch: str
    widths: Tuple[int, ...]
    padded: Tuple[int, ...]
    tile_edges: int
    me: int
    mn: int
    ld: int
    threads: int
    layers: Tuple[dict, ...]
    input_reps: int

    @property
    def max_width(self) -> int:
        return max(self.padded)

    @property
    def shared_bytes(self) -> int:
        return 2 * self.max_width * self.ld * self.real_bytes

    def grid(self, n_edges: int, multiprocessors: int = DEFAULT_SMS) -> int:
        """Blocks: one per tile, capped at :data:`BLOCKS_PER_SM` per SM (grid-stride)."""
        tiles = -(-n_edges // self.tile_edges)
        return max(1, min(tiles, multiprocessors * BLOCKS_PER_SM))


def _reps(tile_edges: int, me: int, width: int, mn: int, threads: int) -> int:
    return -(-(tile_edges // me) * (width // mn) // threads)


def plan_kernels(spec: SiluMLPSpec, dtype: str, arch: str = "sm_90") -> SiluMLPPlan:
    """The plan of ``spec`` in ``dtype``: the largest edge tile (a power of two) whose two
    activation tiles fit :data:`SHARED_BUDGET`."""
    tile, me, mn, pad = _GEOMETRY[dtype]
    real_bytes = 8 if dtype == "float64" else 4
    widest = max(spec.padded_widths)
    while tile > me and 2 * widest * (tile + pad) * real_bytes > SHARED_BUDGET:
        tile //= 2
    p = spec.padded_widths
    # a thread per micro-tile of the widest layer, in whole warps, at most MAX_THREADS
    threads = min(MAX_THREADS, -(-(tile // me) * (widest // mn) // 32) * 32)
    layers = tuple(dict(k=p[i], n=p[i + 1], w=w, wt=wt,
                        reps=_reps(tile, me, p[i + 1], mn, threads))
                   for i, (w, wt) in enumerate(spec.offsets()))
    return SiluMLPPlan(spec.key(), dtype, arch, spec.widths, p, tile, me, mn, tile + pad,
                       threads, layers, _reps(tile, me, p[0], mn, threads))


def kernel_names(plan: SiluMLPPlan) -> Tuple[str, str]:
    """``(forward, backward)`` kernel names."""
    base = f"mace_silu_mlp_{plan.spec_key}_{plan.dtype}"
    return f"{base}_fwd", f"{base}_bwd"


def render_forward(plan: SiluMLPPlan) -> str:
    return render("silu_mlp/forward.cu.j2", plan=plan, name=kernel_names(plan)[0])


def render_backward(plan: SiluMLPPlan) -> str:
    return render("silu_mlp/backward.cu.j2", plan=plan, name=kernel_names(plan)[1])


def catalog_sources(limits: DeviceLimits) -> Iterator[Tuple[str, str]]:
    """``(name, source)`` of the forward and backward of every catalog MLP, fp32 and fp64, and
    of the float64 tensor-core kernels (:mod:`.dmma`) where they take the MLP on that arch."""
    from mace_accel.ops.radial.silu_mlp import dmma
    from mace_accel.ops.radial.silu_mlp.catalog import CATALOG

    for name, spec in sorted(CATALOG.items()):
        for dtype in ("float32", "float64"):
            plan = plan_kernels(spec, dtype, limits.arch)
            yield f"silu_mlp/{name}_fwd_{dtype}", render_forward(plan)
            yield f"silu_mlp/{name}_bwd_{dtype}", render_backward(plan)
        if dmma.unsupported_reason(spec, limits.arch) is None:
            tc = dmma.plan_kernels(spec, limits.arch)
            yield f"silu_mlp/{name}_dmma_fwd_float64", dmma.render_forward(tc)
            yield f"silu_mlp/{name}_dmma_bwd_float64", dmma.render_backward(tc)
            yield f"silu_mlp/{name}_dmma_bwd_kept_float64", dmma.render_backward_kept(tc)
