"""The CUDA side of the radial table: both kernels for one row width on one device, launched on
torch's current stream (outputs allocated with ``torch.empty``, each element written; nothing
synchronises, so a lookup can be captured in a CUDA graph)."""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import torch

from mace_accel.ops.radial_table.codegen import FORWARD_EDGES, THREADS, kernel_name, \
    plan_kernel, render_kernel
from mace_accel.ops.runtime import Kernel, check_aligned, check_rows, check_tensor, \
    device_limits, i32, kernel_device, ptr

Tensor = torch.Tensor
WHAT = "radial table"


class CudaRadialTable:
    """Lookups of tables with ``n_out`` weights a row (float32) on ``device``."""

    def __init__(self, n_out: int, device: torch.device) -> None:
        self.n_out = n_out
        self.device = kernel_device(torch.float32, device)
        self.arch = device_limits(self.device).arch
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._kernels: Dict[str, Kernel] = {}

    def _kernel(self, direction: str) -> Kernel:
        if direction not in self._kernels:
            plan = plan_kernel(direction, self.n_out)
            self._kernels[direction] = Kernel(render_kernel(plan), kernel_name(plan),
                                              self.device, self.arch)
        return self._kernels[direction]

    def _check(self, lengths: Tensor, order: Optional[Tensor], coeffs: Tensor) -> int:
        e = int(lengths.shape[0]) if lengths.dim() == 1 else -1
        check_tensor("lengths", lengths, (e,), torch.float32, self.device, WHAT)
        if order is not None:
            check_tensor("order", order, (e,), torch.int64, self.device, WHAT)
        cells = int(coeffs.shape[0]) if coeffs.dim() == 3 else -1
        check_tensor("table", coeffs, (cells, 4, self.n_out), torch.float32, self.device, WHAT)
        if cells < 1:
            raise ValueError(f"{WHAT}: the table has no cells")
        check_aligned("table", coeffs, WHAT)
        check_rows(e, FORWARD_EDGES, WHAT)
        return e

    def forward(self, lengths: Tensor, order: Optional[Tensor], coeffs: Tensor,
                inv_h: float) -> Tensor:
        """``w [E, n_out]`` of ``lengths [E]`` (float32) from the table ``coeffs [cells, 4,
        n_out]`` (``inv_h`` cells per unit of length); ``order [E]`` (int64) lists the edges by
        length (any permutation gives the same result, this one the speed; None: the edges as
        they come). ``order`` is not range-checked: the caller sorts ``lengths`` for it."""
        e = self._check(lengths, order, coeffs)
        w = torch.empty((e, self.n_out), dtype=torch.float32, device=self.device)
        if e:
            self._kernel("forward").launch(
                -(-e // FORWARD_EDGES), THREADS,
                (ptr(lengths), ptr(order), ptr(coeffs), ptr(w), np.float32(inv_h),
                 i32(coeffs.shape[0]), i32(e)))
        return w

    def backward(self, grad: Tensor, lengths: Tensor, order: Optional[Tensor], coeffs: Tensor,
                 inv_h: float) -> Tensor:
        """``d lengths [E]`` of ``<grad, w>`` (``grad [E, n_out]``: d w), as :meth:`forward`
        takes its arguments."""
        e = self._check(lengths, order, coeffs)
        check_tensor("d w", grad, (e, self.n_out), torch.float32, self.device, WHAT)
        check_aligned("d w", grad, WHAT)
        dr = torch.empty((e,), dtype=torch.float32, device=self.device)
        if e:
            warps = THREADS // 32
            blocks = max(1, min(-(-e // warps), self.sms * 16))
            self._kernel("backward").launch(
                blocks, THREADS, (ptr(lengths), ptr(order), ptr(coeffs), ptr(grad), ptr(dr),
                                  np.float32(inv_h), i32(coeffs.shape[0]), i32(e)))
        return dr
