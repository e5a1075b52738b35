"""The problem of one grouped GEMM kernel of an equivariant linear map: its output blocks in one
launch, each read and written in e3nn's ``[N, channel, component]`` layout where it stands
(:class:`GroupedSpec` of :class:`E3nnBlock`), run by the 3xFP16 kernels (``mma.sync``:
:mod:`.fp16x3`; Hopper's ``wgmma``: :mod:`.fp16x3_wgmma`); and the grouped maps every test and
the CI compile cover (:data:`GROUPED_CATALOG`)."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Dict, Optional, Tuple

IRREP_DIMS = (1, 3, 5, 7, 9, 11, 13, 15)  # 2l + 1 for l = 0 .. 7
ALIGN = 4  # the kernels copy 16-byte chunks: k and n must be multiples of 4 floats


def unsupported_reason(k: int, n: int) -> Optional[str]:
    """Why a block ``[N, k] -> [N, n]`` cannot run in the grouped kernels, or None."""
    if k < 1 or n < 1:
        return f"the GEMM widths must be positive, got k={k}, n={n}"
    if k % ALIGN or n % ALIGN:
        return (f"the grouped 3xFP16 kernels need both GEMM widths to be multiples of {ALIGN} "
                f"(16-byte copies), got k={k}, n={n}")
    return None


def layout_misfit(d: int, x_col: int, k: int, lda: int, out_col: int, n: int,
                  ldc: int) -> Optional[str]:
    """Why the block of ``k`` channels of irrep dimension ``d`` at column ``x_col`` of rows of
    ``lda`` floats cannot be mapped by a grouped kernel of e3nn's layout into the ``n`` channels
    at ``out_col`` of rows of ``ldc`` floats, or None: the blocks must lie inside the rows, and
    with ``d`` = 1 the input is copied in 16-byte chunks and the output written in 8-byte
    pairs, so those rows and the blocks' starts must be aligned to them (the tensors' own
    starts are checked at launch)."""
    if x_col < 0 or x_col + k * d > lda or out_col < 0 or out_col + n * d > ldc:
        return (f"the blocks [{x_col}, {x_col + k * d}) of x's {lda} columns and "
                f"[{out_col}, {out_col + n * d}) of out's {ldc} do not fit the rows")
    if d == 1 and (x_col % 4 or lda % 4 or out_col % 2 or ldc % 2):
        return ("scalars are copied in 16-byte chunks and written in 8-byte pairs: x's rows "
                "and block start must be 16-byte aligned, out's 8-byte")
    return None


@dataclasses.dataclass(frozen=True)
class E3nnBlock:
    """One output block of an equivariant linear map in the grouped kernel: ``n`` channels of
    irrep dimension ``d`` at column ``out_col`` of the output rows, from the ``k`` channels at
    ``x_col`` of the input rows, by the ``[n, k]`` weights at float ``w_offset`` of the map's
    weight buffer."""

    d: int
    k: int
    n: int
    x_col: int
    out_col: int
    w_offset: int


@dataclasses.dataclass(frozen=True)
class GroupedSpec:
    """The blocks of one equivariant linear map in one launch of a grouped kernel (3xFP16), each
    read and written in e3nn's layout where it stands: inputs ``[N, lda]``, outputs ``[N, ldc]``
    (every other column of the output is left alone). Enough blocks of tiles for the GPU on
    MD-sized systems, where one launch per block left most of it idle."""

    blocks: Tuple[E3nnBlock, ...]
    lda: int
    ldc: int

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("a grouped GEMM needs at least one block")
        for b in self.blocks:
            why = unsupported_reason(b.k, b.n)
            if why is None and b.d not in IRREP_DIMS:
                why = f"irrep dimension {b.d} is not one of {IRREP_DIMS}"
            if why is None:  # the kernel checks at launch that the rows start aligned
                why = layout_misfit(b.d, b.x_col, b.k, self.lda, b.out_col, b.n, self.ldc)
            if why is None and b.w_offset % ALIGN:
                why = f"weights at float {b.w_offset}: not a multiple of {ALIGN}"
            if why is not None:
                raise ValueError(why)

    @property
    def weight_numel(self) -> int:
        return max(b.w_offset + b.n * b.k for b in self.blocks)

    def key(self) -> str:
        digest = hashlib.sha256(repr(self).encode()).hexdigest()[:16]
        return f"grouped_{digest}"

    def describe(self) -> str:
        return (f"GEMMs of {len(self.blocks)} blocks of an equivariant linear map "
                f"({self.lda} -> {self.ldc} columns) in one launch, e3nn's layout in place")


# equivariant linear maps' blocks in one launch of the grouped 3xFP16 kernels: MH-1-like
# 512-channel scalars and vectors, and the same with a narrow block of 2e (ragged tiles)
GROUPED_CATALOG: Dict[str, GroupedSpec] = {
    "e3nn_grouped": GroupedSpec((E3nnBlock(3, 512, 512, 512, 512, 0),
                                 E3nnBlock(1, 512, 512, 0, 0, 262144)), 2048, 2048),
    "e3nn_grouped_ragged": GroupedSpec((E3nnBlock(3, 512, 512, 512, 512, 0),
                                        E3nnBlock(1, 512, 512, 0, 0, 262144),
                                        E3nnBlock(5, 64, 32, 2048, 2048, 524288)), 2368, 2208),
}
