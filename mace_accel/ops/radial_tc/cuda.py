"""The CUDA side of the radial-MLP kernel: one kernel per spec and device (float32), launched on
torch's current stream (it allocates nothing but its outputs, so it can be captured in a CUDA
graph)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from mace_accel.ops.radial_tc import codegen
from mace_accel.ops.radial_tc.spec import RadialSpec
from mace_accel.ops.runtime import Kernel, check_rows, device_limits, i32, kernel_device, ptr
from mace_accel.ops.silu_mlp.cuda import check_mlp_inputs

Tensor = torch.Tensor


class CudaRadialMLP:
    """The kernel of one :class:`RadialSpec` on one device."""

    def __init__(self, spec: RadialSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = kernel_device(torch.float32, device)
        self.plan = codegen.plan_kernel(spec, device_limits(self.device).arch)
        self._kernel: Optional[Kernel] = None

    def forward(self, x: Tensor, w: Tensor) -> Tuple[Tensor, Tensor]:
        """``(out [E, n_out], z [n_hidden, E, hidden_width])`` of ``x [E, h0]`` and the packed
        weights ``w`` (:func:`~.spec.pack_weights`): the output and each hidden layer's
        pre-activations (a narrower layer in its first columns)."""
        s = self.spec
        n = check_mlp_inputs(s, x, w, torch.float32, self.device, "the radial MLP kernel")
        check_rows(n, codegen.BM, "the radial MLP kernel")  # offsets are 64-bit
        out = torch.empty((n, s.widths[-1]), dtype=torch.float32, device=self.device)
        z = torch.empty((len(s.widths) - 2, n, s.hidden_width), dtype=torch.float32,
                        device=self.device)
        if n:
            if self._kernel is None:
                self._kernel = Kernel(codegen.render_kernel(self.plan),
                                      codegen.kernel_name(self.plan), self.device,
                                      self.plan.arch, dynamic_shared=self.plan.fwd_shared_bytes)
            self._kernel.launch(self.plan.grid(n), self.plan.threads,
                                (ptr(x), ptr(w), ptr(out), ptr(z), i32(n)))
        return out, z
