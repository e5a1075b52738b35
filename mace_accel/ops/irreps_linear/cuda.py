"""The CUDA side of the equivariant linear maps: one generated kernel per spec, dtype, device,
launched on torch's current stream (allocates nothing but its output; graph-capturable)."""

from __future__ import annotations

import torch

from mace_accel.errors import KernelSizeError
from mace_accel.ops.irreps_linear import codegen, gemm
from mace_accel.ops.irreps_linear.spec import LinearSpec
from mace_accel.ops.runtime import INT32_MAX, CudaKernels, check_rows, compile_soon, i32, ptr
from mace_accel.options import dtype_name

Tensor = torch.Tensor


class CudaIrrepsLinear(CudaKernels):
    """The kernel of one :class:`LinearSpec` (a map or its transpose) for a dtype and device."""

    def __init__(self, spec: LinearSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(dtype, device, spec.describe())
        self.spec = spec
        self.plan = codegen.plan_kernel(spec, dtype_name(dtype), self.arch)
        self.gemm_min_nodes = gemm.MIN_NODES_FLOAT64  # (benchmarks set it to time the kernel)
        self._grouped_float32 = dtype == torch.float32 and gemm.grouped_in_float32(spec)

    def start_compiles(self) -> None:
        """Start compiling the kernel (:func:`~mace_accel.ops.runtime.compile_soon`)."""
        compile_soon(codegen.render_kernel(self.plan), self.plan.arch)

    def runs_gemm(self, n: int) -> bool:
        """Whether ``n`` nodes run as GEMMs on the tensor cores (:mod:`.gemm`) rather than the
        kernel."""
        return gemm.takes(self.spec, self.dtype, n, self.gemm_min_nodes, self._grouped_float32)

    def apply(self, x: Tensor, w: Tensor, elem: Tensor) -> Tensor:
        """``out [N, dim_out]`` of ``x [N, dim_in]``, effective weights ``w [weight_numel]`` and
        ``elem [N]`` int32 (read only for element-indexed weights); as GEMMs on the tensor
        cores where :func:`.gemm.takes` them."""
        s = self.spec
        n = int(x.shape[0]) if x.dim() == 2 else -1
        self._check_tensor("x", x, (n, s.dim_in))
        self._check_tensor("weights", w, (s.weight_numel,))
        if s.indexed:
            self._check_tensor("elem", elem, (n,), torch.int32)
        # node counts in int32, every global offset in 64 bits (the row width does not count)
        check_rows(n, self.plan.tile_nodes, "the linear kernel")
        if s.weight_numel > INT32_MAX:
            raise KernelSizeError(f"{s.weight_numel} weights exceed the linear kernel's int32 "
                                  "weight index")
        if self.runs_gemm(n):
            return gemm.apply(s, x, w)
        out = self._empty(n, s.dim_out)
        if n == 0:
            return out
        kernel = self._kernel(codegen.kernel_name(self.plan),
                              lambda: codegen.render_kernel(self.plan))
        kernel.launch(self.plan.grid(n, self.limits.multiprocessors), self.plan.threads,
                      (ptr(x), ptr(w), ptr(elem if s.indexed else None), ptr(out), i32(n)))
        return out
