"""The CUDA side of the fused SiLU MLP: a forward and a backward kernel per spec, dtype and
device, launched on torch's current stream (they allocate nothing but their output, so they
can be captured in a CUDA graph)."""

from __future__ import annotations

from typing import List, Optional

import torch

from mace_accel.errors import KernelError
from mace_accel.ops.runtime import (
    INT32_MAX,
    Kernel,
    check_aligned,
    check_tensor,
    device_limits,
    i32,
    kernel_device,
    ptr,
)
from mace_accel.ops.silu_mlp import codegen
from mace_accel.ops.silu_mlp.spec import SiluMLPSpec
from mace_accel.options import dtype_name

Tensor = torch.Tensor


def check_mlp_inputs(spec, x: Tensor, w: Tensor, dtype: torch.dtype, device: torch.device,
                     what: str, packed_numel: Optional[int] = None) -> int:
    """The edge count of ``x [E, widths[0]]``, after checking it and the packed weights
    ``w [packed_numel]`` (16-byte aligned; by default the spec's ``packed_numel``) of an MLP
    ``spec`` (widths, packed_numel, describe()) for ``what``, a kernel that takes them in
    ``dtype`` on ``device``."""
    n = int(x.shape[0]) if x.dim() == 2 else -1
    numel = spec.packed_numel if packed_numel is None else packed_numel
    check_tensor("x", x, (n, spec.widths[0]), dtype, device, spec.describe())
    check_tensor("packed weights", w, (numel,), dtype, device, spec.describe())
    check_aligned("packed weights", w, what)
    return n


class CudaSiluMLP:
    """The kernels of one :class:`SiluMLPSpec` for a dtype and device."""

    def __init__(self, spec: SiluMLPSpec, dtype: torch.dtype, device: torch.device) -> None:
        self.spec, self.dtype = spec, dtype
        self.device = kernel_device(dtype, device)
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.plan = codegen.plan_kernels(spec, dtype_name(dtype), device_limits(self.device).arch)
        self._loaded: List[Optional[Kernel]] = [None, None]  # forward, backward

    def _kernel(self, which: int) -> Kernel:
        """The forward (0) or backward (1) kernel, compiled and loaded on first use."""
        if self._loaded[which] is None:
            render = (codegen.render_forward, codegen.render_backward)[which]
            self._loaded[which] = Kernel(render(self.plan), codegen.kernel_names(self.plan)[which],
                                         self.device, self.plan.arch)
        return self._loaded[which]

    def _check(self, x: Tensor, w: Tensor) -> int:
        s = self.spec
        n = check_mlp_inputs(s, x, w, self.dtype, self.device, "the SiLU MLP kernel")
        if n * max(s.widths) > INT32_MAX:
            raise KernelError(f"{n} edges exceed the SiLU MLP kernel's int32 edge count")
        return n

    def forward(self, x: Tensor, w: Tensor) -> Tensor:
        """``[E, h_L]`` of ``x [E, h0]`` and the packed weights ``w``
        (:func:`~.spec.pack_weights`)."""
        n = self._check(x, w)
        out = torch.empty((n, self.spec.widths[-1]), dtype=self.dtype, device=self.device)
        if n == 0:
            return out
        self._kernel(0).launch(self.plan.grid(n, self.sms), self.plan.threads,
                               (ptr(x), ptr(w), ptr(out), i32(n)))
        return out

    def backward(self, x: Tensor, w: Tensor, g: Tensor) -> Tensor:
        """``d x [E, h0]`` of ``<g, forward(x, w)>`` for ``g [E, h_L]`` (forward recomputed)."""
        n = self._check(x, w)
        check_tensor("grad", g, (n, self.spec.widths[-1]), self.dtype, self.device,
                     self.spec.describe())
        gx = torch.empty_like(x)
        if n == 0:
            return gx
        self._kernel(1).launch(self.plan.grid(n, self.sms), self.plan.threads,
                               (ptr(x), ptr(w), ptr(g), ptr(gx), i32(n)))
        return gx
