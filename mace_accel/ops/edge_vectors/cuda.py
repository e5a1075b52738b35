"""The CUDA side of the edge vectors: both kernels of one dtype and device, launched on torch's
current stream; outputs allocated here with ``torch.empty`` (each kernel writes every element),
nothing synchronises, so the op can be captured in a CUDA graph."""

from __future__ import annotations

from typing import Tuple

import torch

from mace_accel.errors import KernelSizeError
from mace_accel.ops.edge_vectors.codegen import THREADS, kernel_name, render_kernels
from mace_accel.ops.graph import KernelGraph
from mace_accel.ops.runtime import INT32_MAX, CudaKernels, Kernel, compile_soon, i32, ptr
from mace_accel.options import dtype_name

Tensor = torch.Tensor
_WARPS_PER_BLOCK = THREADS // 32


class CudaEdgeVectors(CudaKernels):
    """The forward and backward kernels for ``dtype`` on ``device``."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(dtype, device, "edge vectors")

    def start_compiles(self) -> None:
        """Start compiling the forward and backward (one source:
        :func:`~mace_accel.ops.runtime.compile_soon`)."""
        compile_soon(render_kernels(dtype_name(self.dtype), self.arch), self.arch)

    def _kernel_of(self, which: str) -> Kernel:
        """The kernel ``which`` (``"forward"`` or ``"backward"``; one source)."""
        dtype = dtype_name(self.dtype)
        return self._kernel(kernel_name(which, dtype), lambda: render_kernels(dtype, self.arch))

    def _grid(self, rows: int, per_block: int) -> int:
        return self._blocks(-(-rows // per_block))

    def forward(self, positions: Tensor, shifts: Tensor, sender: Tensor,
                receiver: Tensor) -> Tuple[Tensor, Tensor]:
        """``(vectors [E, 3], lengths [E, 1])`` of ``positions [N, 3]``, ``shifts [E, 3]`` and
        the int32 ``sender`` / ``receiver [E]`` (indices are not range-checked here: the graph
        they come from was, when ``check_indices`` is on)."""
        n, e = int(positions.shape[0]), int(shifts.shape[0])
        self._check_tensor("positions", positions, (n, 3))
        self._check_tensor("shifts", shifts, (e, 3))
        self._check_tensor("sender", sender, (e,), torch.int32)
        self._check_tensor("receiver", receiver, (e,), torch.int32)
        if 3 * max(n, e) > INT32_MAX:
            raise KernelSizeError(f"{e} edges exceed the edge-vector kernels' int32 range")
        vectors, lengths = self._empty(e, 3), self._empty(e, 1)
        if e:
            self._kernel_of("forward").launch(
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
            self._check_tensor(name, t, shape, dtype)
        d_pos = self._empty(n_nodes, 3)
        if n_nodes:
            self._kernel_of("backward").launch(
                self._grid(n_nodes, _WARPS_PER_BLOCK), THREADS,
                (ptr(g_vectors), ptr(g_lengths), ptr(vectors), ptr(lengths), ptr(graph.recv_ptr),
                 ptr(graph.recv_perm), ptr(graph.send_ptr), ptr(graph.send_perm), ptr(d_pos),
                 i32(n_nodes)))
        return d_pos
