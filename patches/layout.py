"""``FusedReshapeIrreps``: mace's ``reshape_irreps`` (an interaction block's message
``[N, sum_i mul d_i]`` -> ``[N, mul, sum_i d_i]`` for the product block) as one gather.

mace slices the row per irrep, reshapes each slice and concatenates them: a copy per irrep and
the concatenation forward, and backward a zero-filled full-size gradient per slice, a copy into
it and an add (about 15 kernels per block; most of them launch-bound in a small system's call).
The layout change is a fixed permutation of the columns, so here it is one ``index_select``
forward and one backward (the inverse permutation, itself differentiable: double backward
follows). Exact: it moves values, it computes nothing.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from mace_accel.errors import InputError
from mace_accel.options import AccelOptions
from mace_accel.patches.adopt import FusedModule

Tensor = torch.Tensor


def reshape_reason(module: torch.nn.Module) -> Optional[str]:
    """Why ``module`` (a block's ``reshape``) is not mace's ``reshape_irreps`` in the
    ``[N, mul, d]`` layout with one multiplicity, or None."""
    cls = type(module)
    if cls.__name__ != "reshape_irreps" or not cls.__module__.startswith("mace."):
        return f"reshape is {cls.__module__}.{cls.__name__}, not mace's reshape_irreps"
    cueq = getattr(module, "cueq_config", None)
    if cueq is not None and getattr(cueq, "layout_str", "mul_ir") != "mul_ir":
        return "reshape_irreps in cuEquivariance's ir_mul layout"
    muls = list(getattr(module, "muls", []))
    if not muls or len(set(muls)) != 1:
        return f"irreps of different multiplicities {muls} (mace concatenates [N, mul, d])"
    return None


def column_permutation(muls: List[int], dims: List[int]) -> List[int]:
    """``perm`` with ``out.reshape(N, -1)[:, j] = x[:, perm[j]]``: field ``f`` of ``x`` is
    ``[mul, d_f]`` at its offset; ``out`` is ``[mul, sum d]`` with field ``f``'s ``d_f``
    columns after the earlier fields'."""
    mul, total = muls[0], sum(dims)
    perm = [0] * (mul * total)
    offset_in, offset_out = 0, 0
    for d in dims:
        for u in range(mul):
            for m in range(d):
                perm[u * total + offset_out + m] = offset_in + u * d + m
        offset_in += mul * d
        offset_out += d
    return perm


class _Permute(torch.autograd.Function):
    """``x[:, perm]``; its backward is the same op with the inverse permutation."""

    @staticmethod
    def forward(ctx, x: Tensor, perm: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(perm, inverse)
        return x.index_select(1, perm)

    @staticmethod
    def backward(ctx, g: Tensor):
        perm, inverse = ctx.saved_tensors
        return _Permute.apply(g, inverse, perm), None, None


class FusedReshapeIrreps(FusedModule):
    """An interaction block's ``reshape``: ``[N, sum mul d_i] -> [N, mul, sum d_i]``."""

    part = "linears"

    def __init__(self, original: torch.nn.Module, options: AccelOptions) -> None:
        super().__init__(original, options)
        self.mul = int(original.muls[0])
        self.dims = [int(d) for d in original.dims]
        self._perm: Dict[Tuple, Tuple[Tensor, Tensor]] = {}

    @staticmethod
    def describe_shape(original: torch.nn.Module) -> str:
        return (f"to [N, {int(original.muls[0])}, {sum(int(d) for d in original.dims)}] by one "
                "gather per pass")

    def describe(self) -> str:
        return self.describe_shape(self.original)

    def __getstate__(self):
        state = super().__getstate__()
        state["_perm"] = {}
        return state

    def _permutations(self, device: torch.device) -> Tuple[Tensor, Tensor]:
        key = (device.type, device.index)
        cached = self._perm.get(key)
        if cached is None:
            perm = torch.tensor(column_permutation([self.mul] * len(self.dims), self.dims),
                                dtype=torch.long)
            cached = self._perm[key] = (perm.to(device), torch.argsort(perm).to(device))
        return cached

    def forward(self, x: Tensor) -> Tensor:
        width = self.mul * sum(self.dims)
        if x.dim() != 2 or x.shape[1] != width:
            raise InputError(f"the message must have shape [n_nodes, {width}] for the reshape "
                             f"to [n_nodes, {self.mul}, {sum(self.dims)}], got {tuple(x.shape)}")
        perm, inverse = self._permutations(x.device)
        return _Permute.apply(x, perm, inverse).view(x.shape[0], self.mul, sum(self.dims))
