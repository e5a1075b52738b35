"""The ZBL pair repulsion as a differentiable op: ``repulsion(spec, lengths, elements,
edge_index, backend)`` gives each atom's repulsion; the backward is each edge's slope (written
by the forward kernel) times its receiver's upstream gradient, and under ``create_graph``
(training on forces) the gradient of the plain-torch op (:mod:`.reference`), differentiable
again."""

from __future__ import annotations

import torch

from mace_accel.ops import registry
from mace_accel.ops.graph import graph_from_edge_index
from mace_accel.ops.pair_repulsion import reference
from mace_accel.ops.pair_repulsion.spec import ZBLSpec
from mace_accel.ops.runtime import compile_soon

Tensor = torch.Tensor


def _kernels(spec: ZBLSpec, like: Tensor):
    from mace_accel.ops.pair_repulsion.cuda import CudaZBL

    return registry.cached(("pair_repulsion", spec, like.dtype, like.device),
                           lambda: CudaZBL(spec, like.dtype, like.device))


def start_compiles(spec: ZBLSpec, dtype: torch.dtype, device: torch.device) -> None:
    """Start compiling the CUDA kernel of ``spec`` (:func:`~mace_accel.ops.runtime.compile_soon`)
    without loading it (its primitives compile when they are made)."""
    from mace_accel.ops.pair_repulsion.cuda import kernel_source

    compile_soon(*kernel_source(spec, dtype, device))


class _Repulsion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lengths: Tensor, elements: Tensor, edge_index: Tensor,
                spec: ZBLSpec) -> Tensor:
        n = int(elements.shape[0])
        graph = graph_from_edge_index(edge_index, n)
        recv_ptr, recv_perm = graph.csr("receiver")
        energy, slope = _kernels(spec, lengths).forward(
            lengths.reshape(-1).contiguous(), elements.contiguous(), graph.index32("sender"),
            recv_ptr, recv_perm)
        ctx.save_for_backward(lengths, slope, elements, edge_index)
        ctx.spec = spec
        return energy

    @staticmethod
    def backward(ctx, grad: Tensor):
        lengths, slope, elements, edge_index = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        if torch.is_grad_enabled():  # create_graph: the reference's own ops, differentiated
            with torch.enable_grad():
                r = lengths.detach().requires_grad_(True)
                energy = reference.repulsion(ctx.spec, r, elements, edge_index,
                                             int(elements.shape[0]))
            (d,) = torch.autograd.grad(energy, r, grad, create_graph=True)
            return d, None, None, None
        return (grad[edge_index[1]] * slope).reshape(lengths.shape), None, None, None


def repulsion(spec: ZBLSpec, lengths: Tensor, elements: Tensor, edge_index: Tensor,
              backend: str) -> Tensor:
    """``[N]``: each atom's ZBL repulsion from the edges it receives (``lengths [E, 1]``, the
    atoms' ``elements [N]`` int64, ``edge_index [2, E]``); ``backend`` ``"cuda"`` (one kernel,
    deterministic) or ``"reference"`` (torch ops)."""
    if backend == "cuda":
        return _Repulsion.apply(lengths, elements, edge_index, spec)
    return reference.repulsion(spec, lengths, elements, edge_index, int(elements.shape[0]))
