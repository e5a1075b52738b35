"""The CUDA side of the 3xTF32 GEMMs: one generated kernel per spec and device, launched on
torch's current stream (allocates only its outputs; graph-capturable)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from mace_accel.errors import KernelError
from mace_accel.ops.runtime import (Kernel, check_aligned, check_rows, check_tensor, device_limits,
                                    i32, kernel_device, ptr)
from mace_accel.ops.tf32x3_gemm import codegen
from mace_accel.ops.tf32x3_gemm.spec import GemmSpec

Tensor = torch.Tensor


class CudaGemm:
    """``C [M, n] = A [M, k] . op(B)`` of one :class:`GemmSpec` on one device (float32)."""

    def __init__(self, spec: GemmSpec, device: torch.device,
                 geometry: Optional[Tuple[int, int, int, int, int, int]] = None) -> None:
        self.spec = spec
        self.device = kernel_device(torch.float32, device)
        self.plan = codegen.plan_kernel(spec, device_limits(self.device).arch, geometry)
        self._kernel: Optional[Kernel] = None

    def apply(self, a: Tensor, b: Tensor, z: Optional[Tensor] = None) -> Tensor:
        """``C [M, n]`` of ``a [M, k]`` and ``b`` (``[k, n]`` for layout ``"kn"``, ``[n, k]``
        for ``"nk"``), all contiguous float32 on the kernel's device; epilogue ``"silu_grad"``
        reads the pre-activations ``z [M, n]``, ``"silu"`` is :meth:`apply_silu`."""
        if (z is None) != (self.spec.epilogue == "none"):
            raise KernelError(f"{self.spec.describe()}: pre-activations are read by the "
                              "silu_grad epilogue only")
        out = self._empty(a)
        self._launch(a, b, out, z)
        return out

    def apply_silu(self, a: Tensor, b: Tensor) -> Tuple[Tensor, Tensor]:
        """``(z, silu(z))`` with ``z = a op(b)`` ``[M, n]`` (epilogue ``"silu"``)."""
        if self.spec.epilogue != "silu":
            raise KernelError(f"{self.spec.describe()} has no silu epilogue")
        z, out = self._empty(a), self._empty(a)
        self._launch(a, b, out, z)
        return z, out

    def _empty(self, a: Tensor) -> Tensor:
        return torch.empty((int(a.shape[0]), self.spec.n), dtype=torch.float32,
                           device=self.device)

    def _launch(self, a: Tensor, b: Tensor, out: Tensor, z: Optional[Tensor]) -> None:
        s = self.spec
        m = int(a.shape[0]) if a.dim() == 2 else -1
        check_tensor("a", a, (m, s.k), torch.float32, self.device, s.describe())
        check_tensor("b", b, (s.k, s.n) if s.b_layout == "kn" else (s.n, s.k), torch.float32,
                     self.device, s.describe())
        if z is not None:
            check_tensor("z", z, (m, s.n), torch.float32, self.device, s.describe())
        for name, t in (("a", a), ("b", b), ("z", z)):
            check_aligned(name, t, "the 3xTF32 GEMM")
        self._run(m, (ptr(a), ptr(b), ptr(out), ptr(z), i32(m)))

    def _run(self, m: int, args: tuple) -> None:
        """The kernel (compiled on first use) over ``m`` rows with ``args``, after checking
        that the row count indexes in int32."""
        check_rows(m, self.plan.bm, "the 3xTF32 GEMM")  # offsets are 64-bit
        if m == 0:
            return
        if self._kernel is None:
            self._kernel = Kernel(codegen.render_kernel(self.plan), codegen.kernel_name(self.plan),
                                  self.device, self.plan.arch)
        self._kernel.launch(self.plan.grid(m), self.plan.threads, args)
