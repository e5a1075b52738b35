"""Autograd for the fused convolution tensor product: forward, backward, double backward.

The op ``out = conv(x, y, w)`` (x = node_feats, y = edge_attrs, w = tp_weights; gather by sender,
scatter-sum to receiver) is linear in each of x, y and w. So its backward is three "transposed"
convolutions, and the backward of the backward needs nothing new: with upstream gradients
``(ax, ay, aw)`` for the backward's outputs ``(gx, gy, gw)``::

    d/d grad_out = conv(ax, y, w) + conv(x, ay, w) + conv(x, y, aw)
    d/dx         = bwd(x, ay, w, g).gx + bwd(x, y, aw, g).gx
    d/dy         = bwd(ax, y, w, g).gy + bwd(x, y, aw, g).gy
    d/dw         = bwd(ax, y, w, g).gw + bwd(x, ay, w, g).gw

Both Functions call each other through ``.apply``, so derivatives of any order compose with
``torch.autograd.grad(..., create_graph=True)``. A *primitives* object supplies the two raw
kernels (CUDA in :mod:`mace_accel.runtime`, plain torch in :class:`ReferencePrimitives`); the
composition here is backend-independent and is tested on CPU with the reference primitives.
"""

from __future__ import annotations

from typing import Optional, Protocol, Tuple

import torch

from . import reference
from .graph import ConvGraph
from .spec import TPSpec

Grads = Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]


class ConvPrimitives(Protocol):
    """The two raw (non-differentiable) kernels a backend provides."""

    spec: TPSpec

    def forward(self, graph: ConvGraph, x: torch.Tensor, y: torch.Tensor,
                w: torch.Tensor) -> torch.Tensor:
        """``[n_nodes, dim_out]`` fused convolution."""

    def backward(self, graph: ConvGraph, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
                 g: torch.Tensor, needs: Tuple[bool, bool, bool]) -> Grads:
        """``(gx [N, dim_in1], gy [E, dim_in2], gw [E, weight_numel])``, None where not needed."""


class ReferencePrimitives:
    """Plain-torch primitives (CPU, or the oracle on GPU)."""

    def __init__(self, spec: TPSpec) -> None:
        self.spec = spec

    def forward(self, graph: ConvGraph, x, y, w):
        return reference.conv_tp_forward(self.spec, x, y, w, graph.sender, graph.receiver,
                                         graph.n_nodes)

    def backward(self, graph: ConvGraph, x, y, w, g, needs):
        return reference.conv_tp_backward(self.spec, x, y, w, g, graph.sender, graph.receiver,
                                          needs)


class _ConvForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, prims: ConvPrimitives, graph: ConvGraph, x, y, w):  # type: ignore[override]
        ctx.prims, ctx.graph = prims, graph
        ctx.save_for_backward(x, y, w)
        return prims.forward(graph, x, y, w)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, y, w = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[2:5])
        if g is None or not any(needs):
            return None, None, None, None, None
        gx, gy, gw = _ConvBackward.apply(ctx.prims, ctx.graph, x, y, w, g.contiguous(), needs)
        return None, None, gx, gy, gw


class _ConvBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, prims: ConvPrimitives, graph: ConvGraph, x, y, w, g,  # type: ignore[override]
                needs: Tuple[bool, bool, bool]):
        ctx.prims, ctx.graph = prims, graph
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, y, w, g)
        return prims.backward(graph, x, y, w, g, needs)

    @staticmethod
    def backward(ctx, ax, ay, aw):  # type: ignore[override]
        x, y, w, g = ctx.saved_tensors
        prims, graph = ctx.prims, ctx.graph
        want_x, want_y, want_w, want_g = ctx.needs_input_grad[2:6]
        dx = dy = dw = dg = None

        def add(acc, t):
            return t if acc is None else (acc if t is None else acc + t)

        def bwd(x_, y_, w_, needs):
            return _ConvBackward.apply(prims, graph, x_, y_, w_, g, needs)

        if want_g:
            for args in ((ax, y, w), (x, ay, w), (x, y, aw)):
                if all(a is not None for a in args):
                    dg = add(dg, _ConvForward.apply(prims, graph, *args))
        if ax is not None and (want_y or want_w):
            _, gy, gw = bwd(ax, y, w, (False, want_y, want_w))
            dy, dw = add(dy, gy), add(dw, gw)
        if ay is not None and (want_x or want_w):
            gx, _, gw = bwd(x, ay, w, (want_x, False, want_w))
            dx, dw = add(dx, gx), add(dw, gw)
        if aw is not None and (want_x or want_y):
            gx, gy, _ = bwd(x, y, aw, (want_x, want_y, False))
            dx, dy = add(dx, gx), add(dy, gy)
        return None, None, dx, dy, dw, dg, None


def conv_tp(prims: ConvPrimitives, graph: ConvGraph, node_feats: torch.Tensor,
            edge_attrs: torch.Tensor, tp_weights: torch.Tensor) -> torch.Tensor:
    """Differentiable fused convolution ``[n_nodes, dim_out]`` through ``prims``.

    Args:
        node_feats: ``[N, dim_in1]``; edge_attrs: ``[E, dim_in2]``; tp_weights:
            ``[E, weight_numel]``; all of one floating dtype and device.
    """
    return _ConvForward.apply(prims, graph, node_feats.contiguous(), edge_attrs.contiguous(),
                              tp_weights.contiguous())
