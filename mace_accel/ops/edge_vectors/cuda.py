"""The CUDA side of the edge vectors: both kernels of one dtype and device, launched on torch's
current stream; outputs allocated here with ``torch.empty`` (each kernel writes every element),
nothing synchronises, so the op can be captured in a CUDA graph."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from mace_accel.errors import KernelSizeError
from mace_accel.ops.edge_vectors.codegen import THREADS, kernel_name, render_kernels
from mace_accel.ops.graph import KernelGraph
from mace_accel.ops.limits import resident_blocks
from mace_accel.ops.runtime import INT32_MAX, Kernel, check_tensor, compile_soon, device_limits, \
    i32, kernel_device, ptr
from mace_accel.options import dtype_name

Tensor = torch.Tensor
_WARPS_PER_BLOCK = THREADS // 32


class CudaEdgeVectors:
    """The forward and backward kernels for ``dtype`` on ``device``."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = kernel_device(dtype, device)
        self.arch = device_limits(self.device).arch
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._kernels: Dict[str, Kernel] = {}

    def start_compiles(self) -> None:
        """Start compiling the forward and backward (one source:
        :func:`~mace_accel.ops.runtime.compile_soon`)."""
        compile_soon(render_kernels(dtype_name(self.dtype), self.arch), self.arch)

    def _kernel(self, which: str) -> Kernel:
        if which not in self._kernels:
            name = dtype_name(self.dtype)
            self._kernels[which] = Kernel(render_kernels(name, self.arch),
                                          kernel_name(which, name), self.device, self.arch)
        return self._kernels[which]

    def _grid(self, rows: int, per_block: int) -> int:
        return resident_blocks(-(-rows // per_block), self.sms)

    def _check(self, name: str, t: Tensor, shape, dtype: torch.dtype) -> None:
        check_tensor(name, t, shape, dtype, self.device, "edge vectors")

    def forward(self, positions: Tensor, shifts: Tensor, sender: Tensor,
                receiver: Tensor) -> Tuple[Tensor, Tensor]:
        """``(vectors [E, 3], lengths [E, 1])`` of ``positions [N, 3]``, ``shifts [E, 3]`` and
        the int32 ``sender`` / ``receiver [E]`` (indices are not range-checked here: the graph
        they come from was, when ``check_indices`` is on)."""
        n, e = int(positions.shape[0]), int(shifts.shape[0])
        self._check("positions", positions, (n, 3), self.dtype)
        self._check("shifts", shifts, (e, 3), self.dtype)
        self._check("sender", sender, (e,), torch.int32)
        self._check("receiver", receiver, (e,), torch.int32)
        if 3 * max(n, e) > INT32_MAX:
            raise KernelSizeError(f"{e} edges exceed the edge-vector kernels' int32 range")
        vectors = torch.empty((e, 3), dtype=self.dtype, device=self.device)
        lengths = torch.empty((e, 1), dtype=self.dtype, device=self.device)
        if e:
            self._kernel("forward").launch(
                self._grid(e, THREADS), THREADS,
                (ptr(positions), ptr(shifts), ptr(sender), ptr(receiver), ptr(vectors),
                 ptr(lengths), i32(e)))
        return vectors, lengths

    def backward(self, g_vectors: Tensor, g_lengths: Tensor, vectors: Tensor, lengths: Tensor,
                 graph: KernelGraph, n_nodes: int) -> Tensor:
        """``d positions [N, 3]`` of the gradients ``g_vectors [E, 3]`` and ``g_lengths [E, 1]``
        (the forward's ``vectors`` and ``lengths`` saved), over ``graph``'s CSRs."""
        e = int(vectors.shape[0])
        for name, t, shape, dtype in (
                ("d vectors", g_vectors, (e, 3), self.dtype),
                ("d lengths", g_lengths, (e, 1), self.dtype),
                ("vectors", vectors, (e, 3), self.dtype), ("lengths", lengths, (e, 1), self.dtype),
                ("recv_ptr", graph.recv_ptr, (n_nodes + 1,), torch.int32),
                ("recv_perm", graph.recv_perm, (e,), torch.int32),
                ("send_ptr", graph.send_ptr, (n_nodes + 1,), torch.int32),
                ("send_perm", graph.send_perm, (e,), torch.int32)):
            self._check(name, t, shape, dtype)
        d_pos = torch.empty((n_nodes, 3), dtype=self.dtype, device=self.device)
        if n_nodes:
            self._kernel("backward").launch(
                self._grid(n_nodes, _WARPS_PER_BLOCK), THREADS,
                (ptr(g_vectors), ptr(g_lengths), ptr(vectors), ptr(lengths), ptr(graph.recv_ptr),
                 ptr(graph.recv_perm), ptr(graph.send_ptr), ptr(graph.send_perm), ptr(d_pos),
                 i32(n_nodes)))
        return d_pos
