"""The problem of one 3xTF32 GEMM kernel: ``C [M, n] = A [M, k] . op(B)``, ``M`` given at run
time (the edges, or nodes times an irrep's dimension), ``k`` and ``n`` fixed by the model (the
radial MLP's widths, an equivariant linear map's channels)."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional, Tuple

import torch

B_LAYOUTS = ("kn", "nk")
EPILOGUES = ("none", "silu", "silu_grad")
ALIGN = 4  # the kernels copy 16-byte chunks: k and n must be multiples of 4 floats
IRREP_DIMS = (1, 3, 5, 7, 9, 11, 13, 15)  # 2l + 1 for l = 0 .. 7
Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """``k``, ``n``: the inner and output widths; ``b_layout``: how ``B`` is stored, ``"kn"``
    (row-major ``[k, n]``, ``op(B) = B``) or ``"nk"`` (row-major ``[n, k]``, ``op(B) = B^T``:
    a column-major ``[k, n]`` weight); ``epilogue``: ``"none"``, ``"silu"`` (a hidden layer's
    forward: ``z = A op(B)`` and ``silu(z)``) or ``"silu_grad"`` (its backward: ``A op(B) *
    silu'(z)``);
    ``irrep_dim``: 0 for row-major ``A`` and ``C``, else ``d`` = 2l + 1 of e3nn's layout, where
    a node's ``k`` (``n``) channels of one irrep sit as ``[channel, component]`` in a row of
    ``lda`` (``ldc``) floats: ``A[m, c] = a[(m // d) * lda + c * d + m % d]`` and the same for
    ``C`` (an equivariant linear map read and written in place, ``M`` = nodes x ``d``; layout
    ``"nk"``, no epilogue)."""

    k: int
    n: int
    b_layout: str
    epilogue: str = "none"
    irrep_dim: int = 0

    def __post_init__(self) -> None:
        why = unsupported_reason(self.k, self.n)
        if why is not None:
            raise ValueError(why)
        if self.b_layout not in B_LAYOUTS:
            raise ValueError(f"b_layout must be one of {B_LAYOUTS}, got {self.b_layout!r}")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {self.epilogue!r}")
        if self.irrep_dim and (self.irrep_dim not in IRREP_DIMS or self.b_layout != "nk"
                               or self.epilogue != "none"):
            raise ValueError(f"irrep_dim must be 0 or one of {IRREP_DIMS}, with B stored nk and "
                             f"no epilogue, got {self.irrep_dim}, {self.b_layout!r}, "
                             f"{self.epilogue!r}")

    def key(self) -> str:
        tail = "" if self.epilogue == "none" else f"_{self.epilogue}"
        if self.irrep_dim:
            tail += f"_e3nn{self.irrep_dim}"
        return f"k{self.k}_n{self.n}_{self.b_layout}{tail}"

    def describe(self) -> str:
        tail = "" if self.epilogue == "none" else f", then {self.epilogue}"
        if self.irrep_dim:
            tail += f", A and C in e3nn's layout of irrep dimension {self.irrep_dim}"
        return (f"3xTF32 GEMM [M, {self.k}] x [{self.k}, {self.n}] (B stored "
                f"{self.b_layout}{tail})")


def unsupported_reason(k: int, n: int) -> Optional[str]:
    """Why ``[M, k] x [k, n]`` cannot run in the kernels, or None."""
    if k < 1 or n < 1:
        return f"the GEMM widths must be positive, got k={k}, n={n}"
    if k % ALIGN or n % ALIGN:
        return (f"the 3xTF32 kernels need both GEMM widths to be multiples of {ALIGN} "
                f"(16-byte copies), got k={k}, n={n}")
    return None


def layout_misfit(d: int, x_col: int, k: int, lda: int, out_col: int, n: int, ldc: int,
                  x_base: int = 0, out_base: int = 0) -> Optional[str]:
    """Why the block of ``k`` channels of irrep dimension ``d`` at column ``x_col`` of rows of
    ``lda`` floats cannot be mapped by the kernel of e3nn's layout into the ``n`` channels at
    ``out_col`` of rows of ``ldc`` floats, or None: the blocks must lie inside the rows, and
    with ``d`` = 1 the kernel copies the input in 16-byte chunks and writes the output in
    8-byte pairs, so those rows and the blocks' starts (``x_base``, ``out_base``: the rows'
    start addresses in bytes, aligned where not given) must be aligned to them."""
    if x_col < 0 or x_col + k * d > lda or out_col < 0 or out_col + n * d > ldc:
        return (f"the blocks [{x_col}, {x_col + k * d}) of x's {lda} columns and "
                f"[{out_col}, {out_col + n * d}) of out's {ldc} do not fit the rows")
    if d == 1 and ((x_base + 4 * x_col) % 16 or lda % 4 or (out_base + 4 * out_col) % 8
                   or ldc % 2):
        return ("scalars are copied in 16-byte chunks and written in 8-byte pairs: x's rows "
                "and block start must be 16-byte aligned, out's 8-byte")
    return None


def e3nn_misfit(d: int, x: Tensor, x_col: int, k: int, out: Tensor, out_col: int,
                n: int) -> Optional[str]:
    """:func:`layout_misfit` of the block in ``x`` and ``out`` (both ``[N, width]``, which
    must be contiguous), or None."""
    if not (x.is_contiguous() and out.is_contiguous()):
        return "x and out must be contiguous"
    return layout_misfit(d, x_col, k, int(x.shape[1]), out_col, n, int(out.shape[1]),
                         x.data_ptr(), out.data_ptr())


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
    """The blocks of one equivariant linear map in one launch of the 3xTF32 kernel, each read
    and written in e3nn's layout where it stands: inputs ``[N, lda]``, outputs ``[N, ldc]``
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
        return (f"3xTF32 GEMMs of {len(self.blocks)} blocks of an equivariant linear map "
                f"({self.lda} -> {self.ldc} columns) in one launch, e3nn's layout in place")
