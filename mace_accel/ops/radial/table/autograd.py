"""The table lookup as a differentiable op: ``lookup(lengths, order, coeffs, inv_h, slots,
tables)`` gives the per-edge weights; its backward ``d lengths`` runs the backward kernel, or,
under ``create_graph`` (double backward: training on forces, Hessians), the gradient of the
table's torch evaluation (:func:`~mace_accel.ops.radial.table.table.evaluate`), differentiable
again."""

from __future__ import annotations

from typing import Optional

import torch

from mace_accel.ops import registry
from mace_accel.ops.radial.table.table import evaluate

Tensor = torch.Tensor


def _kernels_for(n_out: int, dtype: torch.dtype, degree: int, device: torch.device):
    """The kernels of tables of ``n_out`` weights a row, ``dtype`` and ``degree``."""
    from mace_accel.ops.radial.table.cuda import CudaRadialTable

    return registry.cached(("radial_table", n_out, dtype, degree, device),
                           lambda: CudaRadialTable(n_out, dtype, degree, device))


def _kernels(coeffs: Tensor):
    """The kernels of tables shaped and typed as ``coeffs`` on its device."""
    return _kernels_for(int(coeffs.shape[2]), coeffs.dtype, int(coeffs.shape[1]) - 1,
                        coeffs.device)


def start_compiles(n_out: int, dtype: torch.dtype, degree: int, device: torch.device) -> None:
    """Start compiling the kernels of tables of ``n_out`` weights a row (a forces call's)."""
    _kernels_for(n_out, dtype, degree, torch.device(device)).start_compiles()


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lengths: Tensor, order: Optional[Tensor], coeffs: Tensor,
                inv_h: float, slots: Optional[Tensor], tables: int) -> Tensor:
        ctx.save_for_backward(lengths, coeffs)
        ctx.order, ctx.slots = order, slots  # integers, never differentiated
        ctx.inv_h, ctx.tables = inv_h, tables
        return _kernels(coeffs).forward(lengths, order, coeffs, inv_h, slots, tables)

    @staticmethod
    def backward(ctx, grad: Tensor):
        lengths, coeffs = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        if torch.is_grad_enabled():  # create_graph: the table's own torch ops, differentiated
            (d,) = torch.autograd.grad(
                evaluate(coeffs, ctx.inv_h, lengths, ctx.slots, ctx.tables), lengths, grad,
                create_graph=True)
            return d, None, None, None, None, None
        d = _kernels(coeffs).backward(grad.contiguous(), lengths, ctx.order, coeffs, ctx.inv_h,
                                      ctx.slots, ctx.tables)
        return d, None, None, None, None, None


def lookup(lengths: Tensor, order: Optional[Tensor], coeffs: Tensor, inv_h: float,
           slots: Optional[Tensor] = None, tables: int = 1) -> Tensor:
    """``w [E, n]`` of ``lengths [E]`` (CUDA) from the table ``coeffs [tables * cells,
    degree + 1, n]`` of the same dtype (:class:`~mace_accel.ops.radial.table.table.RadialTable`
    rounded), differentiable in ``lengths``; ``slots [E]`` (int32): the table of each edge
    (None: the one table); ``order [E]`` (int64): the edges sorted by table and length
    (faster), or None."""
    return _Lookup.apply(lengths, order, coeffs, inv_h, slots, tables)
