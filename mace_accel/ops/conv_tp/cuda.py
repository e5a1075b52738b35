"""The CUDA side of the fused convolution: the generated kernels of one spec, dtype and device.

Kernels are compiled on first use by :mod:`mace_accel.ops.runtime` and launched on torch's
current stream; launch geometry comes from the :class:`~.schedule.ConvPlan`.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from mace_accel.errors import KernelError
from mace_accel.ops.conv_tp.codegen import (
    SENDER_SUM,
    backward_name,
    forward_name,
    render_backward,
    render_forward,
    render_sender_sum,
)
from mace_accel.ops.conv_tp.schedule import ConvPlan, plan_kernels
from mace_accel.ops.conv_tp.spec import TPSpec
from mace_accel.ops.graph import KernelGraph
from mace_accel.ops.runtime import (
    INT32_MAX,
    Kernel,
    check_tensor,
    kernel_device,
    device_limits,
    i32,
    ptr,
)
from mace_accel.options import dtype_name


class CudaConvPrimitives:
    """The generated forward and backward kernels of one spec, dtype and device.

    Called by the custom ops of :mod:`mace_accel.ops.conv_tp.autograd`. Kernels are compiled
    lazily (the backward for each selection of gradients on first use). ``deterministic=False`` selects the atomic
    backward: d(node_feats) is added into the sender rows with float atomics, which skips the
    per-edge message buffer and the per-sender sum (faster, not bit-reproducible).
    """

    def __init__(self, spec: TPSpec, dtype: torch.dtype, device: torch.device,
                 deterministic: bool = True) -> None:
        self.spec, self.dtype = spec, dtype
        self.deterministic = deterministic
        self.device = kernel_device(dtype, device)
        limits = device_limits(self.device)
        self.arch = limits.arch
        self.plan: ConvPlan = plan_kernels(spec, dtype_name(dtype), limits)
        self._kernels: Dict[str, Kernel] = {}
        # columns no path writes must read as zeros (e3nn semantics)
        self._out_all_written = {p.i_out for p in spec.paths} == set(range(len(spec.irreps_out)))
        self._in1_all_read = {p.i_in1 for p in spec.paths} == set(range(len(spec.irreps_in1)))

    def _kernel(self, name: str, render) -> Kernel:
        k = self._kernels.get(name)
        if k is None:
            k = Kernel(render(), name, self.device, self.arch)
            self._kernels[name] = k
        return k

    # -- checks before launch -------------------------------------------------------------------
    def _check(self, n: int, graph: KernelGraph, **tensors: torch.Tensor) -> None:
        e = graph.n_edges
        s = self.spec
        rows = {"x": (n, s.dim_in1), "y": (e, s.dim_in2), "w": (e, s.weight_numel),
                "g": (n, s.dim_out)}
        for name, t in tensors.items():
            check_tensor(name, t, rows[name], self.dtype, self.device)
        if n > INT32_MAX or e > INT32_MAX:
            raise KernelError(f"{n} nodes / {e} edges exceed the kernels' int32 indexing")
        lengths = {"sender": e, "recv_ptr": n + 1, "recv_perm": e, "send_ptr": n + 1,
                   "send_perm": e}
        for name, t in graph._asdict().items():
            if (t.device != self.device or t.dtype != torch.int32 or not t.is_contiguous()
                    or tuple(t.shape) != (lengths[name],)):
                raise KernelError(f"graph.{name}: expected a contiguous int32 tensor of shape "
                                  f"({lengths[name]},) on {self.device}, got {t.dtype} "
                                  f"{tuple(t.shape)} on {t.device}")

    # -- primitives -------------------------------------------------------------------------------
    def forward(self, n: int, graph: KernelGraph, x: torch.Tensor, y: torch.Tensor,
                w: torch.Tensor) -> torch.Tensor:
        """``out [n, dim_out]``: the fused convolution (see :mod:`.reference`)."""
        self._check(n, graph, x=x, y=y, w=w)
        alloc = torch.empty if self._out_all_written else torch.zeros
        out = alloc((n, self.spec.dim_out), dtype=self.dtype, device=x.device)
        if n == 0:
            return out
        for plan in self.plan.launches:
            name = forward_name(plan)
            k = self._kernel(name, lambda: render_forward(plan))
            k.launch(n, plan.threads,
                     (ptr(x), ptr(y), ptr(w), ptr(graph.sender), ptr(graph.recv_ptr),
                      ptr(graph.recv_perm), ptr(out), i32(n)))
        return out

    def backward(self, n: int, graph: KernelGraph, x: torch.Tensor, y: torch.Tensor,
                 w: torch.Tensor, g: torch.Tensor, needs: Tuple[bool, bool, bool]):
        """``(gx [N, dim_in1], gy [E, dim_in2], gw [E, weight_numel])``, None where not needed."""
        self._check(n, graph, x=x, y=y, w=w, g=g)
        needs = tuple(bool(v) for v in needs)
        e, s = graph.n_edges, self.spec
        opts = dict(dtype=self.dtype, device=x.device)
        atomic = needs[0] and not self.deterministic  # d(node_feats) added into sender rows
        gx = (torch.zeros if atomic else torch.empty)((n, s.dim_in1), **opts) \
            if needs[0] else None
        gy = torch.empty((e, s.dim_in2), **opts) if needs[1] else None
        gw = torch.empty((e, s.weight_numel), **opts) if needs[2] else None
        if n == 0 or not any(needs):
            return gx, gy, gw
        if atomic:
            gxm = gx
        else:  # per-edge messages, summed per sender below (columns of segments without
            # paths are never written, so they must start at zero)
            gxm = (torch.empty if self._in1_all_read else torch.zeros)((e, s.dim_in1), **opts) \
                if needs[0] else None
        for plan in self.plan.launches:  # launch 0 writes gy, later launches add to it
            name = backward_name(plan, needs, atomic)
            k = self._kernel(name, lambda: render_backward(plan, needs, atomic))
            k.launch(n, plan.threads,
                     (ptr(x), ptr(y), ptr(w), ptr(g), ptr(graph.sender), ptr(graph.recv_ptr),
                      ptr(graph.recv_perm), ptr(gxm), ptr(gy), ptr(gw), i32(n)))
        if gx is not None and not atomic:
            k = self._kernel(SENDER_SUM, lambda: render_sender_sum(self.plan.launches[0]))
            k.launch(n, self.plan.sender_sum_threads,
                     (ptr(gxm), ptr(graph.send_ptr), ptr(graph.send_perm), ptr(gx), i32(n)))
        return gx, gy, gw
