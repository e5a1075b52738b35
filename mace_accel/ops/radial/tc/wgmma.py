"""The radial MLP's forward on Hopper's warpgroup tensor-core instructions (``wgmma``, sm_90a):
the launch plan, the weights' layout and the CUDA source (``kernels/radial_tc/wgmma.cu.j2``).

Same contract as the ``mma.sync`` kernel of :mod:`.codegen` (3xTF32 products, the output and
the hidden pre-activations written), another design:

* a warpgroup (4 warps) takes 64 edges through every layer with ``wgmma.m64nNk8`` (one
  instruction per 64 x N x 8 product, issued asynchronously); ``WG`` warpgroups share a block;
* both operands come from shared memory through matrix descriptors. The weights are split into
  their TF32 ``big`` and ``small`` parts once, on the host (:func:`pack_weights`), and stored in
  the instruction's canonical K-major layout, so the kernel only copies them; each layer's input
  activations are split once, when the layer below writes them;
* the last layer walks its output columns in pairs of tiles of :data:`BN` columns, one
  accumulator each (the second tile's products run while the first's outputs are stored), the
  next pair's weights loading meanwhile (``cp.async``, :data:`STAGES` tiles in shared memory);
* K is summed in slices of 32 on the tensor cores, the slices added in float32 (their
  accumulation truncates: over all of K the errors were ~2x the mma.sync kernel's);
* blocks stride over the tiles of edges, so a launch may hold only part of the GPU
  (``sm_share``: the radial MLPs forked beside the earlier blocks' work).

The ``mma.sync`` kernel splits every operand fragment again for every tile it meets and reads
the weights as float32; it runs far below the TF32 peak, bound by issue and latency. This one
is faster on MACE-MP's 64 -> 1280 last layer, on small and large graphs, and on large ones
Nsight Compute puts it near the L2's throughput (every block streams both TF32 parts of the last
layer's weights from L2); ``scripts/bench_kernels.py radial-tc --kernels`` times the two. Tried and
slower: one accumulator over all tiles unrolled
(instruction-cache misses), a loop with two accumulators across iterations or computed stage
addresses (ptxas serializes the wgmmas, C7514), three stages of 64 columns or two warpgroups
per block (one block per SM).

Canonical K-major layout (no swizzle) of a ``[R, C]`` operand (``R`` rows: output features or
edges; ``C``: the reduced dimension, a multiple of 8): element ``(r, c)`` at
``((r / 8) * (C / 4) + c / 4) * 32 + (r % 8) * 4 + c % 4``: 8 x 4 "core matrices" of 128
contiguous bytes, consecutive along ``C`` (leading byte offset 128), then along ``R`` (stride
byte offset ``C * 32``).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch

from mace_accel.ops.limits import OPTIN_SHARED, RESERVED_SHARED, SM_SHARED
from mace_accel.ops.radial.tc.spec import RadialSpec
from mace_accel.ops.radial.silu_mlp.spec import check_layer_weights, zero_padded
from mace_accel.ops.templates import render
from mace_accel.ops.wgmma_asm import wgmma_function

ARCH = "sm_90a"  # wgmma exists only on sm_90a (H100/H200), not on later architectures
PADW = 8  # input and hidden widths are padded to this (the k8 step and the n8 granule)
BN = 32  # default last-layer columns per tile (an accumulator: BN / 2 registers per thread)
STAGES = 4  # last-layer weight tiles in shared memory: the pair in use, the next pair loading
BN_CHOICES = (40, 32)  # tile widths default_variant picks from (4 stages in ~80 KB)
# variants besides the default that the GPU tests run (and CI compiles): two tiles of 64
# columns, the columns split over two blocks, two warpgroups per block
TESTED_VARIANTS = ((1, 2, 64, 1), (1, 4, 32, 2), (2, 4, 32, 1))
ROWS = 64  # edges per warpgroup (the m64 of wgmma)
FLOAT = 4


def padded(width: int) -> int:
    return -(-width // PADW) * PADW


class WarpgroupBlocks:
    """Launch geometry shared by the wgmma kernels' plans: ``wg`` warpgroups a block, each
    taking :data:`ROWS` edges."""

    wg: int

    @property
    def threads(self) -> int:
        return 128 * self.wg

    @property
    def block_rows(self) -> int:
        return ROWS * self.wg

    def row_blocks(self, m: int, max_blocks: Optional[int] = None) -> int:
        """Blocks along the tiles of ``block_rows`` edges (at most ``max_blocks``: the kernels
        stride over the rest)."""
        rows = max(1, -(-m // self.block_rows))
        return rows if max_blocks is None else max(1, min(rows, max_blocks))


@dataclasses.dataclass(frozen=True)
class WgmmaPlan(WarpgroupBlocks):
    """Offsets in floats: ``hidden``: per hidden layer a dict ``k``, ``n`` (padded input and
    output widths), ``width`` (unpadded output width), ``big``, ``small`` (offsets of its split
    weight in the packed buffer, which the kernel copies as is into shared memory); the last
    layer's tiles start at ``hidden_floats``, each ``tile_floats`` long (big then small)."""

    spec_key: str
    arch: str
    wg: int
    stages: int
    bn: int
    splits: int
    h0: int
    p0: int
    kl: int
    n_out: int
    n_tiles: int
    split_tiles: int
    hidden: tuple
    zw: int
    hidden_floats: int
    tile_floats: int
    abuf_floats: int
    region_floats: int

    @property
    def packed_numel(self) -> int:
        return self.hidden_floats + self.n_tiles * self.tile_floats

    @property
    def shared_bytes(self) -> int:
        return (self.region_floats + self.wg * self.abuf_floats) * FLOAT

    @property
    def min_blocks(self) -> int:
        return max(1, min(2, SM_SHARED // (self.shared_bytes + RESERVED_SHARED)))

    @property
    def n_sizes(self) -> Tuple[int, ...]:
        """The ``N`` of every wgmma shape the kernel issues."""
        return tuple(sorted({layer["n"] for layer in self.hidden} | {self.bn}))

    def grid(self, m: int, max_blocks: Optional[int] = None) -> Tuple[int, int]:
        """:meth:`row_blocks`, times the splits of the last layer's columns."""
        return self.row_blocks(m, max_blocks), self.splits


def plan_kernel(spec: RadialSpec, wg: int = 1, stages: int = STAGES, bn: int = BN,
                splits: int = 1) -> WgmmaPlan:
    """The plan of ``spec``'s kernel: ``wg`` warpgroups per block, ``stages`` last-layer weight
    tiles of ``bn`` columns in flight, the columns split over ``splits`` blocks (each computing
    the hidden layers: fewer edges per block, more blocks to fill the GPU with).

    Raises:
        ValueError: the layout does not fit the opt-in shared memory of a block.
    """
    if bn % 8 or not 8 <= bn <= 256 or stages < 2 or stages % 2 or splits < 1:
        raise ValueError(f"wgmma radial kernel: bn {bn} (a multiple of 8 up to 256), stages "
                         f"{stages} (even, >= 2), splits {splits} (>= 1)")
    w = spec.widths
    p = [padded(v) for v in w[:-1]]
    hidden, at = [], 0
    for i in range(len(w) - 2):
        k, n = p[i], p[i + 1]
        hidden.append(dict(k=k, n=n, width=w[i + 1], big=at, small=at + n * k))
        at += 2 * n * k
    kl, n_out = p[-1], w[-1]
    tile = 2 * bn * kl
    abuf = 2 * ROWS * max(p)
    region = max(at, stages * tile)
    n_tiles = -(-n_out // bn)
    plan = WgmmaPlan(spec.key(), ARCH, wg, stages, bn, splits, w[0], p[0], kl, n_out, n_tiles,
                     stages * -(-n_tiles // (stages * splits)), tuple(hidden),
                     spec.hidden_width, at, tile, abuf, region)
    if plan.shared_bytes > OPTIN_SHARED:
        raise ValueError(f"{spec.describe()}: the wgmma kernel needs {plan.shared_bytes} bytes "
                         f"of shared memory, over the {OPTIN_SHARED} a block can have")
    return plan


def default_variant(spec: RadialSpec) -> Tuple[int, int, int, int]:
    """``(wg, stages, bn, splits)`` for ``spec``: one warpgroup, :data:`STAGES` stages, and the
    tile width of :data:`BN_CHOICES` that pads the last layer least (ties: the wider).
    On MACE-MP's 10-64-64-64-1280 net (``scripts/bench_kernels.py radial-tc --kernels``) 40 columns
    win on small graphs and 32 on large ones; the small case (a 256-atom call, latency-bound)
    decides: 40."""
    def padded_columns(bn: int) -> int:
        return -(-spec.widths[-1] // (bn * STAGES)) * bn * STAGES

    bn = min(BN_CHOICES, key=lambda b: (padded_columns(b), -b))
    return 1, STAGES, bn, 1


def kernel_name(plan: WgmmaPlan) -> str:
    return (f"mace_radial_wgmma_{plan.spec_key}_w{plan.wg}s{plan.stages}n{plan.bn}"
            f"x{plan.splits}")


def render_kernel(plan: WgmmaPlan) -> str:
    return render("radial_tc/wgmma.cu.j2", plan=plan, name=kernel_name(plan),
                  wgmma_functions="\n".join(
                      wgmma_function(f"wgmma_n{n}", n, "k8.f32.tf32.tf32", False, "1, 1")
                      for n in plan.n_sizes))


# -- the weights ----------------------------------------------------------------------------------
def canonical(m: torch.Tensor) -> torch.Tensor:
    """``m [R, C]`` (``R % 8 == 0``, ``C % 4 == 0``) flattened in the canonical K-major layout
    (module docstring)."""
    r, c = m.shape
    return m.reshape(r // 8, 8, c // 4, 4).permute(0, 2, 1, 3).reshape(-1)


def split_tf32(m: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(big, small)`` of float32 ``m``: ``big`` rounded to TF32 as the kernels round (half an
    ulp added, the low 13 bits cleared), ``small = m - big`` (exact)."""
    bits = m.contiguous().view(torch.int32)
    big = ((bits + 0x1000) & -0x2000).view(torch.float32)
    return big, m - big


def pack_weights(plan: WgmmaPlan, spec: RadialSpec, weights: Sequence[torch.Tensor]
                 ) -> torch.Tensor:
    """The flat float32 buffer of the layers' ``[w_i, w_{i+1}]`` folded weights: per hidden
    layer its transposed weight ``[n, k]`` zero-padded, split and canonical (big, then small);
    then per tile of ``plan.bn`` output columns the last layer's ``[bn, kl]`` rows the same
    way.

    Raises:
        UnsupportedModelError: the weights do not have the spec's shapes.
    """
    check_layer_weights(spec.describe(), spec.widths, weights)
    parts: List[torch.Tensor] = []
    for layer, w in zip(plan.hidden, weights[:-1]):
        big, small = split_tf32(zero_padded(w.t().float(), layer["n"], layer["k"]))
        parts += [canonical(big), canonical(small)]
    last = zero_padded(weights[-1].t().float(), plan.n_tiles * plan.bn, plan.kl)
    for nt in range(plan.n_tiles):
        big, small = split_tf32(last[nt * plan.bn:(nt + 1) * plan.bn])
        parts += [canonical(big), canonical(small)]
    out = torch.cat(parts).contiguous()
    assert out.numel() == plan.packed_numel
    return out
