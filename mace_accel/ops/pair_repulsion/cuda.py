"""The CUDA side of the ZBL pair repulsion: its kernel for one spec, dtype and device, launched
on torch's current stream (outputs from ``torch.empty``, every element written; nothing
synchronises: the op can be captured in a CUDA graph)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from mace_accel.ops.pair_repulsion import reference
from mace_accel.ops.pair_repulsion.codegen import THREADS, kernel_name, render_kernel
from mace_accel.ops.pair_repulsion.spec import ZBLSpec
from mace_accel.ops.runtime import CudaKernels, device_limits, i32, kernel_device, ptr
from mace_accel.options import dtype_name

Tensor = torch.Tensor
WHAT = "ZBL pair repulsion"


def kernel_source(spec: ZBLSpec, dtype: torch.dtype, device: torch.device) -> Tuple[str, str]:
    """``(source, arch)`` of the ZBL kernel of ``spec`` for ``dtype`` on ``device``."""
    arch = device_limits(kernel_device(dtype, device)).arch
    return render_kernel(spec, dtype_name(dtype)), arch


class CudaZBL(CudaKernels):
    """The ZBL kernel of ``spec`` for ``dtype`` on ``device``, with its per-element tables."""

    def __init__(self, spec: ZBLSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(dtype, device, WHAT)
        self.spec = spec
        self.kernel = self._load(kernel_source(spec, dtype, self.device)[0],
                                 kernel_name(spec, dtype_name(dtype)))
        numbers = torch.tensor(spec.numbers, dtype=dtype, device=self.device)
        self.zpow = torch.pow(numbers, spec.a_exp)  # mace's Z^a_exp, in the model's dtype
        self.radii = torch.tensor(spec.radii, dtype=dtype, device=self.device)
        self._coulomb: Optional[Tuple[torch.dtype, Tensor]] = None

    def _coulomb_factors(self) -> Tensor:
        """mace's ``14.3996 Z_u Z_v`` per pair (rounded in torch's default dtype as its forward
        rounds it: made again if the default dtype changed)."""
        default = torch.get_default_dtype()
        if self._coulomb is None or self._coulomb[0] != default:
            factors = reference.coulomb_factors(self.spec).to(self.device, self.dtype)
            self._coulomb = (default, factors.contiguous())
        return self._coulomb[1]

    def forward(self, lengths: Tensor, elements: Tensor, sender: Tensor, recv_ptr: Tensor,
                recv_perm: Tensor) -> Tuple[Tensor, Tensor]:
        """``(energy [N], slope [E])`` of ``lengths [E]`` with the atoms' ``elements [N]``
        (int64), the int32 ``sender [E]`` and receiver CSR (``recv_ptr [N + 1]``,
        ``recv_perm [E]``). Indices are not range-checked here (that would synchronise): they
        come from the model's own graph."""
        n, e = int(elements.shape[0]), int(lengths.shape[0])
        self._check_tensor("lengths", lengths, (e,))
        self._check_tensor("elements", elements, (n,), torch.int64)
        self._check_tensor("sender", sender, (e,), torch.int32)
        self._check_tensor("recv_ptr", recv_ptr, (n + 1,), torch.int32)
        self._check_tensor("recv_perm", recv_perm, (e,), torch.int32)
        energy, slope = self._empty(n), self._empty(e)
        if n:
            grid = self._blocks(-(-n // (THREADS // 32)))  # a warp per atom
            self.kernel.launch(grid, THREADS, (
                ptr(lengths), ptr(elements), ptr(sender), ptr(recv_ptr), ptr(recv_perm),
                ptr(self.zpow), ptr(self.radii), ptr(self._coulomb_factors()), ptr(energy),
                ptr(slope), i32(n), i32(len(self.spec.numbers))))
        return energy, slope
