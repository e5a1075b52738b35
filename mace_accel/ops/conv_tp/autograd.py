"""The fused convolution as ``torch.library`` custom ops: forward, backward, double backward.

``out = conv(x, y, w)`` (x = node_feats, y = edge_attrs, w = tp_weights; gather by sender,
scatter-sum to receiver) is linear in each of x, y and w. So its backward is three "transposed"
convolutions, and the backward of the backward needs nothing new: with upstream gradients
``(ax, ay, aw)`` for the backward's outputs ``(gx, gy, gw)``::

    d/d grad_out = conv(ax, y, w) + conv(x, ay, w) + conv(x, y, aw)
    d/dx         = bwd(x, ay, w, g).gx + bwd(x, y, aw, g).gx
    d/dy         = bwd(ax, y, w, g).gy + bwd(x, y, aw, g).gy
    d/dw         = bwd(ax, y, w, g).gw + bwd(x, ay, w, g).gw

Two ops, ``mace_accel::conv_tp`` and ``mace_accel::conv_tp_backward``, each with a fake (meta)
implementation and a registered autograd formula that calls the two ops again, so derivatives of
any order compose, and ``torch.compile``, ``torch.export`` and CUDA-graph capture see each as one
op. The spec travels as a registry key (:mod:`mace_accel.ops.registry`); the edge graph as the
tensors of :meth:`~mace_accel.ops.graph.ConvGraph.tensors`. ``backend`` picks the generated CUDA
kernels (:mod:`.cuda`) or the plain-torch reference (:mod:`.reference`); the composition here is
the same for both and is tested on CPU with the reference.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from mace_accel.ops import registry
from mace_accel.ops.custom_op import custom_op, placeholder, upstream_grad
from mace_accel.ops.conv_tp import reference
from mace_accel.ops.conv_tp.spec import TPSpec
from mace_accel.ops.graph import ConvGraph, KernelGraph

FAMILY = "conv_tp"
Tensor = torch.Tensor


def register_spec(spec: TPSpec) -> str:
    """The registry key of ``spec`` (what the ops take instead of the spec)."""
    return registry.register(FAMILY, spec)


def _cuda(key: str, t: Tensor, deterministic: bool):
    from mace_accel.ops.conv_tp.cuda import CudaConvPrimitives

    return registry.cached((key, t.dtype, t.device, deterministic),
                           lambda: CudaConvPrimitives(registry.lookup(key), t.dtype, t.device,
                                                      deterministic=deterministic))


def start_compiles(key: str, dtype: torch.dtype, device: torch.device,
                   deterministic: bool) -> None:
    """Start compiling the CUDA kernels of the spec under ``key`` that a forces call launches."""
    _cuda(key, torch.empty(0, dtype=dtype, device=device), deterministic).start_compiles()


# -- forward ---------------------------------------------------------------------------------------
@custom_op("mace_accel::conv_tp")
def conv_tp_op(x: Tensor, y: Tensor, w: Tensor, graph: List[Tensor], n_nodes: int, key: str,
               backend: str, deterministic: bool) -> Tensor:
    """``[n_nodes, dim_out]``: gather ``x`` by sender, tensor product with ``y`` weighted by
    ``w``, sum to receiver. ``graph``: :meth:`ConvGraph.tensors` for ``backend``."""
    spec = registry.lookup(key)
    if backend == "reference":
        sender, receiver = graph
        return reference.conv_tp_forward(spec, x, y, w, sender, receiver, n_nodes)
    return _cuda(key, x, deterministic).forward(n_nodes, KernelGraph(*graph), x, y, w)


@conv_tp_op.register_fake
def _(x, y, w, graph, n_nodes, key, backend, deterministic):
    return x.new_empty((n_nodes, registry.lookup(key).dim_out))


# -- backward --------------------------------------------------------------------------------------
@custom_op("mace_accel::conv_tp_backward")
def conv_tp_backward_op(x: Tensor, y: Tensor, w: Tensor, g: Tensor, graph: List[Tensor],
                        n_nodes: int, key: str, backend: str, deterministic: bool, need_x: bool,
                        need_y: bool, need_w: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """``(gx [N, dim_in1], gy [E, dim_in2], gw [E, weight_numel])`` of ``<g, conv(x, y, w)>``;
    a gradient not asked for comes back as an empty tensor."""
    spec = registry.lookup(key)
    needs = (need_x, need_y, need_w)
    if backend == "reference":
        sender, receiver = graph
        grads = reference.conv_tp_backward(spec, x, y, w, g, sender, receiver, needs)
    else:
        grads = _cuda(key, x, deterministic).backward(n_nodes, KernelGraph(*graph), x, y, w, g,
                                                      needs)
    return tuple(t if t is not None else placeholder(x) for t in grads)


@conv_tp_backward_op.register_fake
def _(x, y, w, g, graph, n_nodes, key, backend, deterministic, need_x, need_y, need_w):
    spec = registry.lookup(key)
    n_edges = y.shape[0]
    return (x.new_empty((n_nodes, spec.dim_in1)) if need_x else placeholder(x),
            x.new_empty((n_edges, spec.dim_in2)) if need_y else placeholder(x),
            x.new_empty((n_edges, spec.weight_numel)) if need_w else placeholder(x))


# -- autograd ------------------------------------------------------------------------------------
def _static(ctx) -> tuple:
    return ctx.graph, ctx.n_nodes, ctx.key, ctx.backend, ctx.deterministic


def _setup_forward(ctx, inputs, output) -> None:
    x, y, w, graph, n_nodes, key, backend, deterministic = inputs
    ctx.save_for_backward(x, y, w)
    ctx.graph, ctx.n_nodes, ctx.key, ctx.backend, ctx.deterministic = (
        graph, n_nodes, key, backend, deterministic)


def _backward_of_forward(ctx, g):
    x, y, w = ctx.saved_tensors
    need_x, need_y, need_w = ctx.needs_input_grad[:3]
    no_graph = [None] * len(ctx.graph)  # the structure of the inputs: a list for the graph
    if g is None or not (need_x or need_y or need_w):
        return None, None, None, no_graph, None, None, None, None
    gx, gy, gw = conv_tp_backward_op(x, y, w, g.contiguous(), *_static(ctx), need_x, need_y,
                                     need_w)
    return (_grad(gx, need_x), _grad(gy, need_y), _grad(gw, need_w),
            no_graph, None, None, None, None)


def _setup_backward(ctx, inputs, output) -> None:
    x, y, w, g, graph, n_nodes, key, backend, deterministic = inputs[:9]
    ctx.save_for_backward(x, y, w, g)
    ctx.graph, ctx.n_nodes, ctx.key, ctx.backend, ctx.deterministic = (
        graph, n_nodes, key, backend, deterministic)


def _backward_of_backward(ctx, ax, ay, aw):
    x, y, w, g = ctx.saved_tensors
    static = _static(ctx)
    ax, ay, aw = (upstream_grad(a) for a in (ax, ay, aw))
    want_x, want_y, want_w, want_g = ctx.needs_input_grad[:4]
    dx = dy = dw = dg = None

    def add(acc: Optional[Tensor], t: Optional[Tensor]) -> Optional[Tensor]:
        return t if acc is None else (acc if t is None else acc + t)

    def bwd(x_, y_, w_, needs: Sequence[bool]):
        grads = conv_tp_backward_op(x_, y_, w_, g, *static, *needs)
        return [_grad(t, need) for t, need in zip(grads, needs)]

    if want_g:
        for args in ((ax, y, w), (x, ay, w), (x, y, aw)):
            if all(a is not None for a in args):
                dg = add(dg, conv_tp_op(*args, *static))
    if ax is not None and (want_y or want_w):
        _, gy, gw = bwd(ax, y, w, (False, want_y, want_w))
        dy, dw = add(dy, gy), add(dw, gw)
    if ay is not None and (want_x or want_w):
        gx, _, gw = bwd(x, ay, w, (want_x, False, want_w))
        dx, dw = add(dx, gx), add(dw, gw)
    if aw is not None and (want_x or want_y):
        gx, gy, _ = bwd(x, y, aw, (want_x, want_y, False))
        dx, dy = add(dx, gx), add(dy, gy)
    return (dx, dy, dw, dg, [None] * len(ctx.graph)) + (None,) * 7


def _grad(t: Tensor, needed: bool) -> Optional[Tensor]:
    return t if needed else None


conv_tp_op.register_autograd(_backward_of_forward, setup_context=_setup_forward)
conv_tp_backward_op.register_autograd(_backward_of_backward, setup_context=_setup_backward)


def conv_tp(key: str, graph: ConvGraph, node_feats: Tensor, edge_attrs: Tensor,
            tp_weights: Tensor, backend: str = "cuda", deterministic: bool = True) -> Tensor:
    """Differentiable fused convolution ``[n_nodes, dim_out]``.

    Args:
        key: :func:`register_spec` of the problem.
        graph: the edges (:func:`~mace_accel.ops.graph.graph_from_edge_index`).
        node_feats: ``[N, dim_in1]``; edge_attrs: ``[E, dim_in2]``; tp_weights:
            ``[E, weight_numel]``; all of one floating dtype and device.
        backend: ``"cuda"`` or ``"reference"``.
        deterministic: CUDA backend: no float atomics (bit-identical repeats).
    """
    return conv_tp_op(node_feats.contiguous(), edge_attrs.contiguous(), tp_weights.contiguous(),
                      graph.tensors(backend), graph.n_nodes, key, backend, deterministic)
