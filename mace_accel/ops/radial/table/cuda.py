"""The CUDA side of the radial table: its kernels for one row width on one device, launched on
torch's current stream (outputs allocated with ``torch.empty``, each element written; nothing
synchronises, so a lookup can be captured in a CUDA graph)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np
import torch

from mace_accel.errors import KernelError
from mace_accel.ops.radial.table.codegen import DIRECTIONS, TABLE_EDGES, TablePlan, grid, \
    kernel_name, plan_kernel, render_kernel
from mace_accel.ops.runtime import CudaKernels, Kernel, check_aligned, check_rows, compile_soon, \
    i32, ptr
from mace_accel.options import dtype_name

Tensor = torch.Tensor
WHAT = "radial table"


class CudaRadialTable(CudaKernels):
    """Lookups of tables with ``n_out`` weights a row, of ``dtype`` and polynomial ``degree``,
    on ``device``."""

    def __init__(self, n_out: int, dtype: torch.dtype, degree: int,
                 device: torch.device) -> None:
        super().__init__(dtype, device, WHAT)
        self.n_out, self.degree = n_out, degree
        self._plans: Dict[str, TablePlan] = {}

    def start_compiles(self) -> None:
        """Start compiling the lookup and both backwards (which one a call takes depends on
        its edge count: :func:`~mace_accel.patches.radial.table.walks_sorted`)."""
        for direction in DIRECTIONS:
            compile_soon(render_kernel(self._plan(direction)), self.arch)

    def _plan(self, direction: str) -> TablePlan:
        """The plan of ``direction``: made when a call first needs it, after the call's
        arguments are checked (a table of a degree no kernel takes is then refused as an
        argument), and kept: a lookup does not plan again."""
        plan = self._plans.get(direction)
        if plan is None:
            plan = self._plans[direction] = plan_kernel(direction, self.n_out,
                                                        dtype_name(self.dtype), self.degree)
        return plan

    def _kernel_of(self, direction: str) -> Tuple[Kernel, TablePlan]:
        """The kernel of ``direction`` (loaded on first use) and its plan."""
        plan = self._plan(direction)
        return self._kernel(kernel_name(plan), lambda: render_kernel(plan)), plan

    def _real(self, v: float):
        return np.float32(v) if self.dtype == torch.float32 else np.float64(v)

    def _check(self, lengths: Tensor, order: Optional[Tensor], slots: Optional[Tensor],
               coeffs: Tensor, tables: int) -> Tuple[int, int]:
        """``(E, cells per table)`` after checking every argument."""
        e = int(lengths.shape[0]) if lengths.dim() == 1 else -1
        self._check_tensor("lengths", lengths, (e,))
        if order is not None:
            self._check_tensor("order", order, (e,), torch.int64)
        if slots is not None:
            self._check_tensor("slots", slots, (e,), torch.int32)
        rows = int(coeffs.shape[0]) if coeffs.dim() == 3 else -1
        self._check_tensor("table", coeffs, (rows, self.degree + 1, self.n_out))
        if tables < 1 or rows < tables or rows % tables:
            raise KernelError(f"{WHAT}: {rows} table rows do not make {tables} tables of "
                              "whole cells")
        if tables > 1 and slots is None:
            raise KernelError(f"{WHAT}: {tables} tables need each edge's slot")
        check_aligned("table", coeffs, WHAT)
        check_rows(e, TABLE_EDGES, WHAT)
        return e, rows // tables

    def forward(self, lengths: Tensor, order: Optional[Tensor], coeffs: Tensor,
                inv_h: float, slots: Optional[Tensor] = None, tables: int = 1) -> Tensor:
        """``w [E, n_out]`` of ``lengths [E]`` from the table ``coeffs [tables * cells,
        degree + 1, n_out]`` (``inv_h`` cells per unit of length; ``tables`` tables laid end to
        end, edge ``e`` reading table ``slots[e]`` (int32; None: the one table)); ``order [E]``
        (int64) lists the edges by table and length (any permutation gives the same result,
        this one the speed; None: the edges as they come). ``order`` and ``slots`` are not
        range-checked (that would synchronise): the caller makes them."""
        e, cells = self._check(lengths, order, slots, coeffs, tables)
        w = self._empty(e, self.n_out)
        if e:
            kernel, plan = self._kernel_of("forward")
            kernel.launch(
                grid(plan, e, self.limits.multiprocessors), plan.threads,
                (ptr(lengths), ptr(order), ptr(slots), ptr(coeffs), ptr(w), self._real(inv_h),
                 i32(cells), i32(e)))
        return w

    def backward(self, grad: Tensor, lengths: Tensor, order: Optional[Tensor], coeffs: Tensor,
                 inv_h: float, slots: Optional[Tensor] = None, tables: int = 1) -> Tensor:
        """``d lengths [E]`` of ``<grad, w>`` (``grad [E, n_out]``: d w), as :meth:`forward`
        takes its arguments. With ``order`` the kernel walks the edges by length, keeping each
        cell's coefficients in registers; without, it reads them per edge. Each is
        deterministic (the same bits on a repeat); the two differ in the last bits (their sums
        run in different orders)."""
        e, cells = self._check(lengths, order, slots, coeffs, tables)
        self._check_tensor("d w", grad, (e, self.n_out))
        check_aligned("d w", grad, WHAT)
        dr = self._empty(e)
        if e:
            kernel, plan = self._kernel_of("backward" if order is None else "sorted_backward")
            kernel.launch(grid(plan, e, self.limits.multiprocessors), plan.threads,
                          (ptr(lengths), ptr(order), ptr(slots), ptr(coeffs), ptr(grad),
                           ptr(dr), self._real(inv_h), i32(cells), i32(e)))
        return dr
