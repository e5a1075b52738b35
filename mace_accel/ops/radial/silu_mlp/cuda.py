"""The CUDA side of the fused SiLU MLP: the float64 tensor-core kernels of :mod:`.dmma` per spec
and device (sm_90), launched on torch's current stream (they allocate nothing but their outputs,
so they can be captured in a CUDA graph)."""

from __future__ import annotations

from typing import List, Optional

import torch

from mace_accel.errors import KernelError
from mace_accel.ops.runtime import (
    Kernel,
    aligned16,
    check_aligned,
    check_rows,
    check_tensor,
    device_limits,
    i32,
    kernel_device,
    ptr,
)
from mace_accel.ops.radial.silu_mlp import dmma
from mace_accel.ops.radial.silu_mlp.spec import SiluMLPSpec
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
    """The float64 tensor-core kernels (:mod:`.dmma`) of one :class:`SiluMLPSpec` on a device;
    ``variant`` (keywords of :func:`.dmma.plan_kernels`: the kernels' geometry) is for
    benchmarks and tests.

    Raises:
        KernelError: the dtype is not float64, or the kernels cannot run the spec on this GPU
            (:func:`.dmma.unsupported_reason`).
    """

    def __init__(self, spec: SiluMLPSpec, dtype: torch.dtype, device: torch.device,
                 variant: Optional[dict] = None) -> None:
        self.spec, self.dtype = spec, dtype
        self.device = kernel_device(dtype, device)
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        arch = device_limits(self.device).arch
        why = dmma.unsupported_reason(spec, arch) if dtype == torch.float64 else \
            f"the fused SiLU MLP kernels are float64, got {dtype_name(dtype)}"
        if why is not None:
            raise KernelError(f"{spec.describe()}: {why}")
        self.plan = dmma.plan_kernels(spec, arch, **(variant or {}))
        p = self.plan
        self._shared = (p.forward_shared_bytes, p.kept_backward_shared_bytes)
        self._threads = (p.forward_threads, p.threads)
        # forward, backward from the kept slopes
        self._render = (dmma.render_forward, dmma.render_backward_kept)
        self._loaded: List[Optional[Kernel]] = [None, None]

    def _launch(self, which: int, n: int, args: tuple) -> None:
        """Kernel ``which`` (see ``_loaded``; compiled and loaded on first use) over ``n``
        edges."""
        if self._loaded[which] is None:
            self._loaded[which] = Kernel(self._render[which](self.plan),
                                         dmma.kernel_names(self.plan)[which], self.device,
                                         self.plan.arch, dynamic_shared=self._shared[which])
        threads = self._threads[which]
        grid = self.plan.grid(n, self.sms, self._shared[which], threads // 32)
        self._loaded[which].launch(grid, threads, args)

    def _check(self, x: Tensor, w: Tensor) -> int:
        n = check_mlp_inputs(self.spec, x, w, self.dtype, self.device, "the SiLU MLP kernel")
        check_rows(n, self._row_tile(), "the SiLU MLP kernel")  # offsets are 64-bit
        return n

    def _row_tile(self) -> int:
        """Edges a block's loop steps over at once (the int32 edge count's headroom)."""
        return dmma.ROWS * max(self.plan.warps, self.plan.forward_warps)

    def forward(self, x: Tensor, w: Tensor, keep_slopes: bool = False):
        """``[E, h_L]`` of ``x [E, h0]`` and the packed weights ``w``
        (:func:`~.spec.pack_weights`); with ``keep_slopes`` ``(out, slopes)``, ``slopes`` every
        layer's ``silu'(z)`` for :meth:`backward_kept` (an opaque buffer of
        ``plan.slopes_numel(E)`` doubles)."""
        n = self._check(x, w)
        out = torch.empty((n, self.spec.widths[-1]), dtype=self.dtype, device=self.device)
        slopes = None
        if keep_slopes:
            slopes = torch.empty(self.plan.slopes_numel(n), dtype=self.dtype, device=self.device)
        if n > 0:
            x = aligned16(x)  # held until the launch
            # a null slopes pointer: the forward keeps none
            self._launch(0, n, (ptr(x), ptr(w), ptr(out), ptr(slopes), i32(n)))
        return (out, slopes) if keep_slopes else out

    def backward_kept(self, slopes: Tensor, w: Tensor, g: Tensor) -> Tensor:
        """``d x [E, h0]`` of ``<g, forward(x, w)>`` for ``g [E, h_L]`` from the ``slopes`` of
        ``forward(x, w, keep_slopes=True)``."""
        s = self.spec
        n = int(g.shape[0]) if g.dim() == 2 else -1
        check_tensor("grad", g, (n, s.widths[-1]), self.dtype, self.device, s.describe())
        check_rows(n, self._row_tile(), "the SiLU MLP kernel")
        check_tensor("slopes", slopes, (self.plan.slopes_numel(n),), self.dtype, self.device,
                     s.describe())
        check_tensor("packed weights", w, (s.packed_numel,), self.dtype, self.device,
                     s.describe())
        check_aligned("packed weights", w, "the SiLU MLP kernel")
        check_aligned("slopes", slopes, "the SiLU MLP kernel")
        gx = torch.empty((n, s.widths[0]), dtype=self.dtype, device=self.device)
        if n == 0:
            return gx
        g = aligned16(g)  # held until the launch
        self._launch(1, n, (ptr(slopes), ptr(w), ptr(g), ptr(gx), i32(n)))
        return gx
