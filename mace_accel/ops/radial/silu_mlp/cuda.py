"""The CUDA side of the fused SiLU MLP: a forward and a backward kernel per spec, dtype and
device, launched on torch's current stream (they allocate nothing but their output, so they
can be captured in a CUDA graph). float64 on sm_90 runs the tensor-core kernels of :mod:`.dmma`
where the widths fit them, everything else the FMA kernels of :mod:`.codegen`."""

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
from mace_accel.ops.radial.silu_mlp import codegen, dmma
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


def kernel_kind(spec: SiluMLPSpec, dtype: torch.dtype, arch: str) -> str:
    """``"dmma"`` where the float64 tensor-core kernels run ``spec`` on ``arch``, else
    ``"simt"``."""
    if dtype == torch.float64 and dmma.unsupported_reason(spec, arch) is None:
        return "dmma"
    return "simt"


class CudaSiluMLP:
    """The kernels of one :class:`SiluMLPSpec` for a dtype and device; ``kind`` (``"dmma"`` or
    ``"simt"``) and ``variant`` (keywords of :func:`.dmma.plan_kernels`: the DMMA kernels'
    geometry) override the default pick (:func:`kernel_kind`; for benchmarks and tests)."""

    def __init__(self, spec: SiluMLPSpec, dtype: torch.dtype, device: torch.device,
                 kind: Optional[str] = None, variant: Optional[dict] = None) -> None:
        self.spec, self.dtype = spec, dtype
        self.device = kernel_device(dtype, device)
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        arch = device_limits(self.device).arch
        self.kind = kind or kernel_kind(spec, dtype, arch)
        if self.kind == "dmma":
            why = dmma.unsupported_reason(spec, arch) if dtype == torch.float64 else \
                "the tensor-core MLP kernels are float64"
            if why is not None:
                raise KernelError(f"{spec.describe()}: {why}")
            self.plan = dmma.plan_kernels(spec, arch, **(variant or {}))
            self._family = dmma
            self._shared = (self.plan.forward_shared_bytes, self.plan.backward_shared_bytes,
                            self.plan.kept_backward_shared_bytes)
        else:
            self.plan = codegen.plan_kernels(spec, dtype_name(dtype), arch)
            self._family = codegen
            self._shared = (0, 0, 0)
        # forward, recomputing backward, backward from the kept slopes (DMMA only)
        self._loaded: List[Optional[Kernel]] = [None, None, None]

    def _kernel(self, which: int) -> Kernel:
        """Kernel ``which`` (see ``_loaded``), compiled and loaded on first use."""
        if self._loaded[which] is None:
            family = self._family
            render = (family.render_forward, family.render_backward,
                      getattr(family, "render_backward_kept", None))[which]
            self._loaded[which] = Kernel(render(self.plan), family.kernel_names(self.plan)[which],
                                         self.device, self.plan.arch,
                                         dynamic_shared=self._shared[which])
        return self._loaded[which]

    def _threads(self, which: int) -> int:
        return self.plan.forward_threads if self.kind == "dmma" and which == 0 \
            else self.plan.threads

    def _grid(self, n: int, which: int) -> int:
        if self.kind == "dmma":
            return self.plan.grid(n, self.sms, self._shared[which], self._threads(which) // 32)
        return self.plan.grid(n, self.sms)

    def _check(self, x: Tensor, w: Tensor) -> int:
        s = self.spec
        n = check_mlp_inputs(s, x, w, self.dtype, self.device, "the SiLU MLP kernel")
        check_rows(n, self._row_tile(), "the SiLU MLP kernel")  # offsets are 64-bit
        return n

    def _row_tile(self) -> int:
        """Edges a block's loop steps over at once (the int32 edge count's headroom)."""
        return dmma.ROWS * max(self.plan.warps, self.plan.forward_warps) \
            if self.kind == "dmma" else self.plan.tile_edges

    def forward(self, x: Tensor, w: Tensor, keep_slopes: bool = False):
        """``[E, h_L]`` of ``x [E, h0]`` and the packed weights ``w``
        (:func:`~.spec.pack_weights`); with ``keep_slopes`` (DMMA kernels) ``(out, slopes)``,
        ``slopes`` every layer's ``silu'(z)`` for :meth:`backward_kept` (an opaque buffer of
        ``plan.slopes_numel(E)`` doubles)."""
        n = self._check(x, w)
        out = torch.empty((n, self.spec.widths[-1]), dtype=self.dtype, device=self.device)
        slopes = None
        if keep_slopes:
            if self.kind != "dmma":
                raise KernelError("only the float64 tensor-core MLP kernels keep the slopes")
            slopes = torch.empty(self.plan.slopes_numel(n), dtype=self.dtype, device=self.device)
        if n > 0:
            x = aligned16(x)  # held until the launch
            self._kernel(0).launch(
                self._grid(n, 0), self._threads(0),
                (ptr(x), ptr(w), ptr(out), *((ptr(slopes),) if self.kind == "dmma" else ()),
                 i32(n)))
        return (out, slopes) if keep_slopes else out

    def backward(self, x: Tensor, w: Tensor, g: Tensor) -> Tensor:
        """``d x [E, h0]`` of ``<g, forward(x, w)>`` for ``g [E, h_L]`` (forward recomputed)."""
        n = self._check(x, w)
        check_tensor("grad", g, (n, self.spec.widths[-1]), self.dtype, self.device,
                     self.spec.describe())
        gx = torch.empty_like(x)
        if n == 0:
            return gx
        x, g = aligned16(x), aligned16(g)  # held until the launch
        self._kernel(1).launch(self._grid(n, 1), self.plan.threads,
                               (ptr(x), ptr(w), ptr(g), ptr(gx), i32(n)))
        return gx

    def backward_kept(self, slopes: Tensor, w: Tensor, g: Tensor) -> Tensor:
        """``d x [E, h0]`` of ``<g, forward(x, w)>`` from the ``slopes`` of
        ``forward(x, w, keep_slopes=True)`` (DMMA kernels)."""
        if self.kind != "dmma":
            raise KernelError("only the float64 tensor-core MLP kernels keep the slopes")
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
        self._kernel(2).launch(self._grid(n, 2), self.plan.threads,
                               (ptr(slopes), ptr(w), ptr(g), ptr(gx), i32(n)))
        return gx
