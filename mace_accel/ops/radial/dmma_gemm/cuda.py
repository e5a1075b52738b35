"""The CUDA side of the DMMA GEMM: the kernel of one spec on one device, launched on torch's
current stream (it allocates only its output; graph-capturable)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from mace_accel.errors import KernelError
from mace_accel.ops.radial.dmma_gemm import codegen
from mace_accel.ops.radial.dmma_gemm.spec import DmmaGemmSpec
from mace_accel.ops.runtime import (
    Kernel,
    check_aligned,
    check_rows,
    check_tensor,
    device_limits,
    i32,
    kernel_device,
    ptr,
)

Tensor = torch.Tensor


class CudaDmmaGemm:
    """``a [M, narrow] W`` of one :class:`DmmaGemmSpec` on one device (float64, sm_90), below
    :data:`~.codegen.SMALL_ROWS` rows in smaller blocks; ``geometry``: a ``(warps, m-tiles,
    chunk, stages)`` other than the default for every row count (benchmarks and tests)."""

    def __init__(self, spec: DmmaGemmSpec, device: torch.device,
                 geometry: Optional[Tuple[int, int, int, int]] = None) -> None:
        self.spec = spec
        self.device = kernel_device(torch.float64, device)
        arch = device_limits(self.device).arch
        if arch != codegen.ARCH:
            raise KernelError(f"{spec.describe()}: the float64 tensor-core GEMM kernels are for "
                              f"{codegen.ARCH}, this GPU is {arch}")
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.plans = {"forward": codegen.plan_kernel(spec, arch, geometry),
                      "forward_small": codegen.plan_kernel(
                          spec, arch, geometry or codegen.SMALL_GEOMETRY)}
        self._kernels: Dict[str, Kernel] = {}
        self._resident: Dict[str, int] = {}  # blocks an SM holds, read off the loaded kernel

    def forward(self, a: Tensor, packed: Tensor) -> Tensor:
        """``[M, wide]`` = ``a [M, narrow] W`` (``packed``: :func:`~.spec.pack` of ``W``)."""
        small = a.dim() == 2 and a.shape[0] < codegen.SMALL_ROWS
        which = "forward_small" if small else "forward"
        s, plan = self.spec, self.plans[which]
        m = int(a.shape[0]) if a.dim() == 2 else -1
        check_tensor("a", a, (m, s.narrow), torch.float64, self.device, s.describe())
        check_tensor("packed weight", packed, (s.packed_numel,), torch.float64, self.device,
                     s.describe())
        check_aligned("a", a, plan.describe())
        check_aligned("packed weight", packed, plan.describe())
        check_rows(m, plan.block_rows, plan.describe())
        out = torch.empty((m, s.wide), dtype=torch.float64, device=self.device)
        if m == 0:
            return out
        kernel = self._kernel(which)
        kernel.launch(plan.grid(m, self.sms, self._resident[which]), plan.threads,
                      (ptr(a), ptr(packed), ptr(out), i32(m)))
        return out

    def _kernel(self, which: str) -> Kernel:
        kernel = self._kernels.get(which)
        if kernel is None:
            plan = self.plans[which]
            kernel = self._kernels[which] = Kernel(
                codegen.render_kernel(plan), codegen.kernel_name(plan), self.device, plan.arch,
                dynamic_shared=plan.shared_bytes)
            self._resident[which] = kernel.resident_blocks(plan.threads)
        return kernel
