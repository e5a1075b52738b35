"""``conv(x, y, h @ W_last)`` with the last layer inside the conv forward, the TP weights kept.

The op behind :func:`hidden_conv_tp`: the forward kernel of :mod:`mace_accel.ops.conv_tp.hidden`
computes ``w = h @ W_last`` on the tensor cores and writes it once, for the backward; the conv
forward never reads it back from memory and the radial MLP never writes it. The backward is the
plain conv backward on the kept ``w``, then ``d h = d w W_last^T`` (and ``d W_last = h^T d w``
where asked for). Double backward (training on forces) composes the differentiable ops with
``w`` rebuilt. Where memory is short the weights are not kept at all:
:func:`mace_accel.ops.conv_tp.folded.folded_conv_tp` with fragments recomputes them.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from mace_accel.ops import registry
from mace_accel.ops.conv_tp import autograd as conv_autograd
from mace_accel.ops.conv_tp.folded import LastLayer, composed_backward, forward_hidden
from mace_accel.ops.graph import ConvGraph

Tensor = torch.Tensor


@torch.library.custom_op("mace_accel::hidden_conv_tp", mutates_args=())
def hidden_conv_tp_op(x: Tensor, y: Tensor, h: Tensor, w_last: Tensor, frag: Tensor,
                      graph: List[Tensor], n_nodes: int, key: str, deterministic: bool,
                      gemm: str) -> Tuple[Tensor, Tensor]:
    """``(out [n_nodes, dim_out], w [E, weight_numel])``: the conv of ``x``, ``y`` and
    ``w = h @ w_last``, ``frag``: ``w_last`` packed (:func:`~.hidden.pack`); ``w`` is kept for
    the backward (``gemm``: what runs ``d h = d w W^T``, :class:`~.folded.LastLayer`)."""
    out, w = forward_hidden(x, y, h, frag, graph, n_nodes, key, deterministic, True)
    return out, w


@hidden_conv_tp_op.register_fake
def _(x, y, h, w_last, frag, graph, n_nodes, key, deterministic, gemm):
    spec = registry.lookup(key)
    return (x.new_empty((n_nodes, spec.dim_out)),
            x.new_empty((h.shape[0], spec.weight_numel)))


def _setup(ctx, inputs, output) -> None:
    x, y, h, w_last, frag, graph, n_nodes, key, deterministic, gemm = inputs
    ctx.save_for_backward(x, y, h, w_last, output[1])
    ctx.static = (graph, n_nodes, key, "cuda", deterministic)
    ctx.gemm = gemm
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, g, _g_w):
    x, y, h, w_last, w = ctx.saved_tensors
    need_x, need_y, need_h, need_w = ctx.needs_input_grad[:4]
    none = (None, [None] * len(ctx.static[0])) + (None,) * 4  # frag, graph, static args
    if g is None or not (need_x or need_y or need_h or need_w):
        return (None,) * 4 + none
    g = g.contiguous()
    if torch.is_grad_enabled():  # create_graph: differentiable ops, w rebuilt
        gx, gy, gh, gw_last = composed_backward(x, y, h, w_last, g, ctx.static,
                                                ctx.needs_input_grad[:4])
    else:
        gx, gy, gw = conv_autograd.conv_tp_backward_op(x, y, w, g, *ctx.static, need_x, need_y,
                                                       need_h or need_w)
        last = LastLayer(w_last, ctx.gemm)
        gh = last.mm_t(gw) if need_h else None
        gw_last = last.weight_grad(h, gw) if need_w else None
    grads = [t if need else None for t, need in
             zip((gx, gy, gh, gw_last), (need_x, need_y, need_h, need_w))]
    return (*grads, *none)


hidden_conv_tp_op.register_autograd(_backward, setup_context=_setup)


def hidden_conv_tp(key: str, graph: ConvGraph, node_feats: Tensor, edge_attrs: Tensor,
                   hidden: Tensor, w_last: Tensor, frag: Tensor, deterministic: bool = True,
                   gemm: str = "cublas") -> Tensor:
    """Differentiable ``conv(node_feats, edge_attrs, hidden @ w_last)`` ``[n_nodes, dim_out]``
    with the last layer applied by the conv forward (CUDA, float64 on sm_90: the caller checks
    :meth:`~.cuda.CudaConvPrimitives.hidden_unsupported`).

    Args:
        hidden: ``[E, h]``; w_last: ``[h, weight_numel]``; frag: :func:`~.hidden.pack` of
            ``w_last``.
        gemm: what runs the backward's ``d w W_last^T`` (:data:`~.folded.GEMMS`).
    """
    out, _ = hidden_conv_tp_op(node_feats.contiguous(), edge_attrs.contiguous(),
                               hidden.contiguous(), w_last, frag, graph.tensors("cuda"),
                               graph.n_nodes, key, deterministic, gemm)
    return out
