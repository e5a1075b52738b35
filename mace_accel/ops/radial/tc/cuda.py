"""The CUDA side of the radial-MLP kernels: per spec and device (float32), launched on torch's
current stream (they allocate nothing but their outputs, so they can be captured in a CUDA
graph). On sm_90 (H100, H200) the ``wgmma`` forward of :mod:`.wgmma` runs, and the input
gradient has a kernel too (:mod:`.wgmma_backward`); elsewhere the ``mma.sync`` forward of
:mod:`.codegen`, the gradient on the 3xTF32 layer kernels. Each layout reads its own packing of
the weights (:meth:`CudaRadialMLP.pack`; the wgmma one holds the backward's after the
forward's)."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from mace_accel.errors import KernelError
from mace_accel.ops.radial.tc import codegen, wgmma, wgmma_backward
from mace_accel.ops.radial.tc.spec import RadialSpec, pack_weights
from mace_accel.ops.runtime import (Kernel, check_aligned, check_rows, check_tensor,
                                    device_limits, i32, kernel_device, ptr)
from mace_accel.ops.radial.silu_mlp.cuda import check_mlp_inputs

Tensor = torch.Tensor
WGMMA_ARCH = "sm_90"


def layout_for(arch: str) -> str:
    """``"wgmma"`` where the Hopper kernel runs (sm_90), else ``"mma"``."""
    return "wgmma" if arch == WGMMA_ARCH else "mma"


class CudaRadialMLP:
    """The kernels of one :class:`RadialSpec` on one device; ``layout``, ``variant`` (the
    wgmma forward's ``(wg, stages, bn, splits)``) and ``backward_variant`` (the wgmma
    backward's ``(wg, stages)``) are for benchmarks and tests, the default picks by the
    device."""

    def __init__(self, spec: RadialSpec, device: torch.device, layout: Optional[str] = None,
                 variant: Optional[Tuple[int, ...]] = None,
                 backward_variant: Optional[Tuple[int, int]] = None) -> None:
        self.spec = spec
        self.device = kernel_device(torch.float32, device)
        arch = device_limits(self.device).arch
        self.layout = layout or layout_for(arch)
        # the module that plans, names and renders this layout's kernel
        self._family = wgmma if self.layout == "wgmma" else codegen
        if self.layout == "wgmma":
            self.plan = wgmma.plan_kernel(spec, *(variant or wgmma.default_variant(spec)))
            self._shared, self._rows = self.plan.shared_bytes, self.plan.block_rows
            self.backward_plan: Optional[wgmma_backward.BackwardPlan] = \
                wgmma_backward.plan_backward(spec, *(backward_variant or ()))
            self._forward_numel = self.plan.packed_numel
            self.packed_numel = self._forward_numel + self.backward_plan.packed_numel
        else:
            self.plan = codegen.plan_kernel(spec, arch)
            self._shared, self._rows = self.plan.fwd_shared_bytes, codegen.BM
            self.backward_plan = None
            self.packed_numel = spec.packed_numel
        self._kernel: Optional[Kernel] = None
        self._backward_kernel: Optional[Kernel] = None
        self._sms = torch.cuda.get_device_properties(self.device).multi_processor_count

    def describe(self) -> str:
        return ("wgmma (sm_90a)" if self.layout == "wgmma" else "mma.sync") + " kernel"

    @property
    def has_backward(self) -> bool:
        """Whether the input gradient has a kernel here (the wgmma layout)."""
        return self.backward_plan is not None

    def _max_blocks(self, sm_share: Optional[float], min_blocks: int) -> Optional[int]:
        if sm_share is None:
            return None
        return max(1, round(sm_share * self._sms * min_blocks))

    def pack(self, weights: Sequence[Tensor]) -> Tensor:
        """The layers' ``[w_i, w_{i+1}]`` folded weights packed for this kernel (float32, on
        its device)."""
        w32 = [w.detach().to(self.device, torch.float32) for w in weights]
        if self.layout == "wgmma":
            return torch.cat([wgmma.pack_weights(self.plan, self.spec, w32),
                              wgmma_backward.pack_backward(self.backward_plan, self.spec, w32)])
        return pack_weights(self.spec, w32)

    def forward(self, x: Tensor, w: Tensor, sm_share: Optional[float] = None
                ) -> Tuple[Tensor, Tensor]:
        """``(out [E, n_out], z [n_hidden, E, hidden_width])`` of ``x [E, h0]`` and the packed
        weights ``w`` (:meth:`pack`): the output and each hidden layer's pre-activations (a
        narrower layer in its first columns). ``sm_share`` (wgmma kernel): launch at most that
        share of the blocks the GPU holds at once; they stride over the rest of the edges,
        leaving the other multiprocessors to work on other streams."""
        s = self.spec
        what = f"the radial MLP {self.describe()}"
        n = check_mlp_inputs(s, x, w, torch.float32, self.device, what, self.packed_numel)
        check_rows(n, self._rows, what)  # offsets are 64-bit
        out = torch.empty((n, s.widths[-1]), dtype=torch.float32, device=self.device)
        z = torch.empty((len(s.widths) - 2, n, s.hidden_width), dtype=torch.float32,
                        device=self.device)
        if n:
            if self._kernel is None:
                self._kernel = Kernel(self._family.render_kernel(self.plan),
                                      self._family.kernel_name(self.plan), self.device,
                                      self.plan.arch, dynamic_shared=self._shared)
            grid = (self.plan.grid(n, self._max_blocks(sm_share, self.plan.min_blocks))
                    if self.layout == "wgmma" else self.plan.grid(n))
            self._kernel.launch(grid, self.plan.threads,
                                (ptr(x), ptr(w), ptr(out), ptr(z), i32(n)))
        return out, z

    def backward(self, grad: Tensor, z: Tensor, w: Tensor, sm_share: Optional[float] = None
                 ) -> Tensor:
        """``d x [E, h0]`` of ``<grad, out>`` (``grad [E, n_out]``) from the forward's
        pre-activations ``z`` (:meth:`forward`) and the packed weights ``w`` (:meth:`pack`);
        ``sm_share`` as for :meth:`forward`. The wgmma layout only (:attr:`has_backward`).

        Raises:
            KernelError: no backward kernel here, or the inputs are not what it takes.
        """
        plan, s = self.backward_plan, self.spec
        if plan is None:
            raise KernelError(f"the radial MLP {self.describe()} has no backward kernel: its "
                              "gradient runs on the 3xTF32 layer kernels")
        what = f"the radial MLP backward ({self.describe()})"
        n = int(grad.shape[0]) if grad.dim() == 2 else -1
        check_tensor("grad", grad, (n, s.widths[-1]), torch.float32, self.device, s.describe())
        check_tensor("pre-activations", z, (len(s.widths) - 2, n, s.hidden_width),
                     torch.float32, self.device, s.describe())
        check_tensor("packed weights", w, (self.packed_numel,), torch.float32, self.device,
                     s.describe())
        check_aligned("grad", grad, what)
        check_aligned("packed weights", w, what)
        check_rows(n, plan.block_rows, what)
        dx = torch.empty((n, s.widths[0]), dtype=torch.float32, device=self.device)
        if n:
            if self._backward_kernel is None:
                self._backward_kernel = Kernel(
                    wgmma_backward.render_backward(plan), wgmma_backward.kernel_name(plan),
                    self.device, plan.arch, dynamic_shared=plan.shared_bytes)
            grid = plan.grid(n, self._max_blocks(sm_share, plan.min_blocks))
            self._backward_kernel.launch(grid, plan.threads,
                                         (ptr(grad), ptr(z), ptr(w[self._forward_numel:]),
                                          ptr(dx), i32(n)))
        return dx
