"""The problem of one 3xTF32 GEMM kernel: ``C [M, n] = A [M, k] . op(B)``, ``M`` given at run
time (the edges), ``k`` and ``n`` fixed by the model (the radial MLP's widths)."""

from __future__ import annotations

import dataclasses
from typing import Optional


B_LAYOUTS = ("kn", "nk")
EPILOGUES = ("none", "silu", "silu_grad")
ALIGN = 4  # the kernels copy 16-byte chunks: k and n must be multiples of 4 floats


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """``k``, ``n``: the inner and output widths; ``b_layout``: how ``B`` is stored, ``"kn"``
    (row-major ``[k, n]``, ``op(B) = B``) or ``"nk"`` (row-major ``[n, k]``, ``op(B) = B^T``:
    a column-major ``[k, n]`` weight); ``epilogue``: ``"none"``, ``"silu"`` (a hidden layer's
    forward: ``z = A op(B)`` and ``silu(z)``) or ``"silu_grad"`` (its backward: ``A op(B) *
    silu'(z)``)."""

    k: int
    n: int
    b_layout: str
    epilogue: str = "none"

    def __post_init__(self) -> None:
        why = unsupported_reason(self.k, self.n)
        if why is not None:
            raise ValueError(why)
        if self.b_layout not in B_LAYOUTS:
            raise ValueError(f"b_layout must be one of {B_LAYOUTS}, got {self.b_layout!r}")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {self.epilogue!r}")

    def key(self) -> str:
        tail = "" if self.epilogue == "none" else f"_{self.epilogue}"
        return f"k{self.k}_n{self.n}_{self.b_layout}{tail}"

    def describe(self) -> str:
        tail = "" if self.epilogue == "none" else f", then {self.epilogue}"
        return (f"3xTF32 GEMM [M, {self.k}] x [{self.k}, {self.n}] (B stored "
                f"{self.b_layout}{tail})")


def unsupported_reason(k: int, n: int, kernels: str = "the 3xTF32 kernels") -> Optional[str]:
    """Why ``[M, k] x [k, n]`` cannot run in the kernels, or None; ``kernels``: how the reason
    names them (the grouped 3xFP16 kernels of the equivariant linears copy in the same 16-byte
    chunks and check their blocks' widths here too)."""
    if k < 1 or n < 1:
        return f"the GEMM widths must be positive, got k={k}, n={n}"
    if k % ALIGN or n % ALIGN:
        return (f"{kernels} need both GEMM widths to be multiples of {ALIGN} "
                f"(16-byte copies), got k={k}, n={n}")
    return None
