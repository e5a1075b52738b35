"""The float64 SiLU MLP on Hopper's float64 tensor cores (``mma.sync`` m16n8k8 DMMA, sm_90):
the launch plan and CUDA sources (templates ``kernels/silu_mlp/dmma_*.cu.j2``).

Each warp takes 16 edges through every layer with the activations in registers: a product's
output fragment is the next product's A fragment as it stands (the weights' K index is permuted
to match when they are packed, :func:`~.spec.fragments`), so nothing between ``x [E, h0]`` and
the output touches memory, and no lane exchanges data. The weights' fragments are copied once
per block into shared memory. The SiLU runs as a loop over each lane's own values in a shared
slab: written once per register, its exp and reciprocal made the kernel too large for the
instruction cache (28k instructions against the loop's 2.5k; scripts/bench_kernels.py silu-mlp).

Two kernels: the forward, which also writes each layer's ``silu'(z)`` where asked (the slopes,
``[E, sum of hidden widths]`` doubles), and the backward, which gives ``d x`` from those slopes
(read once: a stream through memory). A backward that recomputed the forward instead of reading
kept slopes (for systems whose TP weights are recomputed to save memory) was slower end to end
than the GEMM path and is gone: there the hidden layers run as GEMMs
(:meth:`~mace_accel.patches.radial.mlp.FusedRadialMLP.route`).

Why: in float64 the radial MLP's hidden layers otherwise run as cuBLAS GEMMs (on the same DMMA
units) with SiLU passes between them, every ``[E, 64]`` pre-activation and activation written and
read again. Here the products run on the DMMA units with only ``x``, the output and the kept
slopes passing through memory, and the backward from the slopes streams near the copy bandwidth
(``scripts/bench_kernels.py silu-mlp`` times these against the GEMM path, ``scripts/
bench_model.py radial-routes`` the model with and without them).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Tuple

from mace_accel.ops.limits import DEFAULT_SMS, OPTIN_SHARED, SM_REGISTERS, SM_SHARED, DeviceLimits
from mace_accel.ops.radial.silu_mlp.spec import FRAG, SiluMLPSpec
from mace_accel.ops.templates import render

ARCH = "sm_90"  # m16n8k8 in float64 is Hopper's (PTX ISA 7.8)
ROWS = 16       # edges per warp tile (the product's M)
WARPS = 8       # the backward's warps per block: 256 threads of ~180 registers fill an SM
FORWARD_WARPS = 12  # the forward's (~150 registers; 12 warps: 0.573 vs 0.692 ms with 8 at 539k)
UNROLL = 2      # SiLU elements pairs per lane in flight in the forward's loop
SHARED_LIMIT = OPTIN_SHARED  # an sm_90 block's dynamic shared memory, opted in (ARCH only)
REGISTERS = 184  # a thread's, at most (ptxas: 144 forward / 184 backward for the MACE widths)


@dataclasses.dataclass(frozen=True)
class DmmaPlan:
    """What the DMMA templates print.

    Attributes:
        widths: the spec's widths; ``tiles``: each padded to n-tiles of 8.
        layers: per layer ``kt, nt`` (its K and N in tiles), ``fwd, bwd`` (offsets of its
            ``W`` and ``W^T`` fragments from ``src``, in double2 units: the forward's shared
            copy starts at the first ``W``, the backward's at the first ``W^T``).
        fwd_numel: doubles of the forward's fragments (``bwd_numel``, the backward's ``W^T``
            ones, are as many); ``src``: where the forward's start in the packed buffer.
        slope_offsets, slope_d2: where each layer's ``silu'(z)`` sits in a 16-edge tile's part
            of the slopes buffer, and the part's size, in double2 units (the forward writes
            them where asked, the backward reads them).
    """

    spec_key: str
    arch: str
    widths: Tuple[int, ...]
    tiles: Tuple[int, ...]
    layers: Tuple[dict, ...]
    fwd_numel: int
    src: int
    slope_offsets: Tuple[int, ...]
    slope_d2: int
    warps: int = WARPS
    forward_warps: int = FORWARD_WARPS
    unroll: int = UNROLL
    dtype: str = "float64"

    @property
    def bwd_numel(self) -> int:
        """Doubles of the backward's ``W^T`` fragments: as many as the forward's."""
        return self.fwd_numel

    @property
    def threads(self) -> int:
        """The backward kernel's threads per block."""
        return 32 * self.warps

    @property
    def forward_threads(self) -> int:
        return 32 * self.forward_warps

    @property
    def slab_d2(self) -> int:
        """double2 of a warp's SiLU slab in the forward (the widest layer's fragments)."""
        return max(self.tiles[1:]) * 64

    @property
    def forward_shared_bytes(self) -> int:
        return 8 * self.fwd_numel + 16 * self.slab_d2 * self.forward_warps

    @property
    def kept_backward_shared_bytes(self) -> int:
        return 8 * self.bwd_numel

    def slopes_numel(self, n_edges: int) -> int:
        """Doubles of the slopes buffer of ``n_edges`` edges (whole 16-edge tiles)."""
        return -(-n_edges // ROWS) * 2 * self.slope_d2

    def blocks_per_sm(self, shared: int, warps: int) -> int:
        """Blocks of ``warps`` warps and ``shared`` bytes an SM holds at once: shared memory
        and registers (:data:`REGISTERS` a thread)."""
        by_registers = SM_REGISTERS // (REGISTERS * 32 * warps)
        return max(1, min(SM_SHARED // max(shared, 1), by_registers))

    def grid(self, n_edges: int, multiprocessors: int = DEFAULT_SMS, shared: int = 0,
             warps: int = WARPS) -> int:
        """Blocks of ``warps`` warps: one per ``warps`` tiles of 16 edges, at most as many as
        the SMs hold at once (grid-stride: the weights are copied to shared memory once per
        block)."""
        tiles = -(-n_edges // ROWS)
        return max(1, min(-(-tiles // warps),
                          multiprocessors * self.blocks_per_sm(shared, warps)))


def unsupported_reason(spec: SiluMLPSpec, arch: str) -> Optional[str]:
    """Why the DMMA kernels cannot run ``spec`` on ``arch``, or None."""
    if arch != ARCH:
        return f"the float64 tensor-core MLP kernels are for {ARCH}, this GPU is {arch}"
    plan = plan_kernels(spec, arch)
    shared = max(plan.forward_shared_bytes, plan.kept_backward_shared_bytes)
    if shared > SHARED_LIMIT:
        return f"the kernels need {shared} bytes of shared memory, more than {SHARED_LIMIT}"
    return None


def plan_kernels(spec: SiluMLPSpec, arch: str = ARCH, warps: int = WARPS,
                 forward_warps: int = FORWARD_WARPS, unroll: int = UNROLL) -> DmmaPlan:
    """The DMMA plan of ``spec`` with ``warps`` per block in the backward, ``forward_warps`` in
    the forward, whose SiLU loop has ``unroll`` pairs in flight (check
    :func:`unsupported_reason` first)."""
    f = spec.fragment_widths
    tiles = tuple(w // FRAG for w in f)
    sizes = [f[i] * f[i + 1] for i in range(spec.n_layers)]
    fwd_numel = sum(sizes)
    layers = tuple(dict(kt=tiles[i], nt=tiles[i + 1], fwd=sum(sizes[:i]) // 2,
                        bwd=(fwd_numel + sum(sizes[:i])) // 2)
                   for i in range(spec.n_layers))
    slope_offsets = tuple(sum(tiles[j + 1] * 64 for j in range(i))
                          for i in range(spec.n_layers))
    return DmmaPlan(spec.key(), arch, spec.widths, tiles, layers, fwd_numel,
                    spec.fragment_start, slope_offsets,
                    sum(tiles[1:]) * 64, warps, forward_warps, unroll)


def kernel_names(plan: DmmaPlan) -> Tuple[str, str]:
    """``(forward, backward from the kept slopes)`` kernel names."""
    base = f"mace_silu_mlp_{plan.spec_key}_float64_dmma"
    return f"{base}_fwd", f"{base}_bwd_kept"


def render_forward(plan: DmmaPlan) -> str:
    return render("silu_mlp/dmma_forward.cu.j2", plan=plan, name=kernel_names(plan)[0],
                  warps=plan.forward_warps)


def render_backward_kept(plan: DmmaPlan) -> str:
    return render("silu_mlp/dmma_backward_kept.cu.j2", plan=plan, name=kernel_names(plan)[1],
                  warps=plan.warps)


def catalog_sources(limits: DeviceLimits) -> Iterator[Tuple[str, str]]:
    """``(name, source)`` of the two kernels of every catalog MLP the tensor-core kernels
    take on ``limits.arch`` (none off sm_90)."""
    from mace_accel.ops.radial.silu_mlp.catalog import CATALOG

    for name, spec in sorted(CATALOG.items()):
        if unsupported_reason(spec, limits.arch) is None:
            plan = plan_kernels(spec, limits.arch)
            yield f"silu_mlp/{name}_dmma_fwd_float64", render_forward(plan)
            yield f"silu_mlp/{name}_dmma_bwd_kept_float64", render_backward_kept(plan)
