"""The problem of one DMMA GEMM and the weight's fragment buffer.

``W [narrow, wide]`` (the radial MLP's last layer: ``narrow`` the hidden width, at most
:data:`MAX_NARROW`; ``wide`` the TP weight count) multiplies ``a [M, narrow]``. The kernel reads
``W`` from one flat buffer (:func:`pack`), ``W`` zero-padded to multiples of
:data:`~mace_accel.ops.radial.silu_mlp.spec.FRAG`, as ``mma.sync`` m16n8k8 B fragments in the
order it streams them: per tile of 8 output columns, per tile of 8 of K (``narrow``), per lane the pair
of :func:`~mace_accel.ops.radial.silu_mlp.spec.fragments` (K permuted within each tile, so an A
fragment loaded as row pairs fits as it stands).

Zero padding changes no result: padded K rows of ``W`` are zero, and padded output columns are
not stored.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from mace_accel.errors import UnsupportedModelError
from mace_accel.ops.radial.silu_mlp.spec import FRAG, fragments, padded, zero_padded

MAX_NARROW = 64  # the forward keeps a [16, narrow] operand per m-tile in registers


def unsupported_reason(narrow: int, wide: int) -> Optional[str]:
    """Why ``W [narrow, wide]`` cannot run in the DMMA GEMM kernels, or None."""
    if narrow < 1 or wide < 1:
        return f"the GEMM widths must be positive, got {narrow} x {wide}"
    if narrow > MAX_NARROW:
        return (f"the float64 tensor-core GEMM takes inputs up to {MAX_NARROW} wide (kept in "
                f"registers), got {narrow}")
    if wide % 2:
        return (f"the float64 tensor-core GEMM needs an even output width (16-byte copies of "
                f"column pairs), got {wide}")
    return None


@dataclasses.dataclass(frozen=True)
class DmmaGemmSpec:
    """``W [narrow, wide]``: ``[M, narrow] -> [M, wide]``."""

    narrow: int
    wide: int

    def __post_init__(self) -> None:
        why = unsupported_reason(self.narrow, self.wide)
        if why is not None:
            raise UnsupportedModelError(why)

    def key(self) -> str:
        return f"n{self.narrow}_w{self.wide}"

    @property
    def tn(self) -> int:
        """``narrow`` in tiles of 8."""
        return padded(self.narrow, FRAG) // FRAG

    @property
    def tw(self) -> int:
        """``wide`` in tiles of 8."""
        return padded(self.wide, FRAG) // FRAG

    @property
    def packed_numel(self) -> int:
        """Doubles of the fragment buffer."""
        return self.tn * self.tw * 64

    def describe(self) -> str:
        return f"float64 tensor-core GEMM [M, {self.narrow}] x [{self.narrow}, {self.wide}]"


def pack(spec: DmmaGemmSpec, w: torch.Tensor) -> torch.Tensor:
    """The kernels' buffer ``[packed_numel]`` of ``w [narrow, wide]`` (module docstring).

    Raises:
        UnsupportedModelError: ``w`` does not have the spec's shape.
    """
    if tuple(w.shape) != (spec.narrow, spec.wide):
        raise UnsupportedModelError(f"{spec.describe()}: weight of shape {tuple(w.shape)}, "
                                    f"expected {(spec.narrow, spec.wide)}")
    full = zero_padded(w, spec.tn * FRAG, spec.tw * FRAG)
    return fragments(full).view(spec.tn, spec.tw, 32, 2).transpose(0, 1).reshape(-1).contiguous()
