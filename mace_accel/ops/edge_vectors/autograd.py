"""Edge vectors and lengths as a differentiable op.

``vectors = positions[receiver] - positions[sender] + shifts`` ``[E, 3]`` and
``lengths = |vectors|`` ``[E, 1]``, as mace's ``get_edge_vectors_and_lengths`` computes them.
mace's indexing makes the backward to positions two sort-based ``index_put_`` (about 40 small
kernels per call); here the forward is one kernel and the backward one kernel that adds, per
node, the gradients of the edges it receives minus those it sends, over the receiver and sender
CSRs the convolution builds anyway (:mod:`mace_accel.ops.graph`): deterministic, no atomics.

The gradient of ``shifts`` (stress and virials) is per edge, from torch ops. When the backward
itself must be differentiable (``create_graph``: training on forces, Hessians), it runs as plain
torch ops that mirror torch's own gradient formulas, so higher derivatives are exact.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from mace_accel.ops import registry
from mace_accel.ops.graph import ConvGraph, KernelGraph, graph_from_edge_index

Tensor = torch.Tensor


def reference(positions: Tensor, edge_index: Tensor, shifts: Tensor) -> Tuple[Tensor, Tensor]:
    """``(vectors [E, 3], lengths [E, 1])`` with mace's own torch ops (differentiable)."""
    vectors = positions[edge_index[1]] - positions[edge_index[0]] + shifts
    return vectors, torch.linalg.norm(vectors, dim=-1, keepdim=True)


def _cuda(t: Tensor):
    from mace_accel.ops.edge_vectors.cuda import CudaEdgeVectors

    return registry.cached(("edge_vectors", t.dtype, t.device),
                           lambda: CudaEdgeVectors(t.dtype, t.device))


def start_compiles(dtype: torch.dtype, device: torch.device) -> None:
    """Start compiling the edge vectors' CUDA kernels for ``dtype`` on ``device``."""
    _cuda(torch.empty(0, dtype=dtype, device=device)).start_compiles()


def edge_gradient(g_vec: Tensor, g_len: Tensor, vectors: Tensor, lengths: Tensor) -> Tensor:
    """``[E, 3]``: the gradient each edge's vector gets from ``g_vec [E, 3]`` and, through its
    length, from ``g_len [E, 1]`` (torch's norm backward: zero where the length is zero)."""
    safe = torch.where(lengths > 0, lengths, torch.ones_like(lengths))
    return g_vec + torch.where(lengths > 0, g_len / safe, torch.zeros_like(lengths)) * vectors


class _EdgeVectors(torch.autograd.Function):
    @staticmethod
    def forward(ctx, positions: Tensor, shifts: Tensor, edge_index: Tensor,
                graph: ConvGraph) -> Tuple[Tensor, Tensor]:
        vectors, lengths = _cuda(positions).forward(positions, shifts,
                                                    graph.index32("sender"),
                                                    graph.index32("receiver"))
        ctx.save_for_backward(positions, shifts, edge_index, vectors, lengths)
        ctx.graph = graph
        return vectors, lengths

    @staticmethod
    def backward(ctx, g_vec: Optional[Tensor], g_len: Optional[Tensor]):
        positions, shifts, edge_index, vectors, lengths = ctx.saved_tensors
        need_pos, need_shifts = ctx.needs_input_grad[:2]
        g_vec = torch.zeros_like(vectors) if g_vec is None else g_vec.contiguous()
        g_len = torch.zeros_like(lengths) if g_len is None else g_len.contiguous()
        if torch.is_grad_enabled():  # create_graph: differentiable torch ops
            vec, length = reference(positions, edge_index, shifts)
            g_edge = edge_gradient(g_vec, g_len, vec, length)
            d_pos = None
            if need_pos:
                d_pos = torch.zeros_like(positions).index_put(
                    (edge_index[1],), g_edge, accumulate=True).index_put(
                    (edge_index[0],), -g_edge, accumulate=True)
            return d_pos, (g_edge if need_shifts else None), None, None
        d_pos = d_shifts = None
        if need_pos:
            d_pos = _cuda(positions).backward(g_vec, g_len, vectors, lengths,
                                              KernelGraph(*ctx.graph.tensors("cuda")),
                                              int(positions.shape[0]))
        if need_shifts:
            d_shifts = edge_gradient(g_vec, g_len, vectors, lengths)
        return d_pos, d_shifts, None, None


def edge_vectors(positions: Tensor, edge_index: Tensor, shifts: Tensor,
                 backend: str = "cuda", check_indices: bool = False) -> Tuple[Tensor, Tensor]:
    """``(vectors [E, 3], lengths [E, 1])`` of ``positions [N, 3]``, ``edge_index [2, E]``
    (sender, receiver) and ``shifts [E, 3]``; ``backend`` ``"cuda"`` or ``"reference"``.

    Raises:
        InputError: a malformed ``edge_index`` (or, with ``check_indices``, an index out of
            range).
        KernelError: a tensor the kernels cannot take (dtype, device, shape).
    """
    if backend == "reference":
        return reference(positions, edge_index, shifts)
    graph = graph_from_edge_index(edge_index, int(positions.shape[0]), check_indices)
    return _EdgeVectors.apply(positions.contiguous(), shifts.contiguous(), edge_index, graph)
