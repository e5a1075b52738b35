"""The radial MLP of an interaction block (e3nn ``FullyConnectedNet`` with SiLU) in the fewest
kernels: one GEMM per layer and one SiLU per hidden layer forward, one GEMM and one SiLU
derivative per layer backward.

e3nn's net scales every layer's weights by ``1/sqrt(fan_in)`` and every hidden activation by
two constants (the SiLU's second-moment normalisation and ``sqrt(var_out)``), which costs three
elementwise passes over ``[E, hidden]`` per hidden layer, forward and backward. Here the
constants are folded into the next layer's weights once (:func:`effective_weights`), so the
passes are gone; the result equals e3nn's to rounding.

``radial_mlp(x, weights)`` is an ``autograd.Function``: the backward gives the gradient of the
input (forces, stress) and of the weights (training); with ``create_graph`` it rebuilds the
pre-activations from the inputs, so double backward (training on forces) is exact.
Shapes: ``x [E, h0]``, ``weights[i] [h_i, h_{i+1}]``, output ``[E, h_L]``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def effective_weights(weights: Sequence[Tensor], scales: Sequence[float]) -> List[Tensor]:
    """Layer weights with every constant folded in: ``weights[i] * scales[i]`` (``scales``
    from :func:`layer_scales`). Differentiable in ``weights``."""
    return [w * s for w, s in zip(weights, scales)]


def layer_scales(fan_in: Sequence[int], var_in: Sequence[float], var_out: Sequence[float],
                 act_cst: Sequence[float]) -> List[float]:
    """The factor of each layer's raw weight in the folded net.

    e3nn's hidden layer i computes ``h_i = silu(h_{i-1} @ W_i / sqrt(fan_in_i var_in_i)) *
    cst_i * sqrt(var_out_i)`` and the last ``h_{L-1} @ W_L / sqrt(fan_in_L var_in_L /
    var_out_L)``. Folding ``cst_i sqrt(var_out_i)`` of hidden layer i into layer i+1 leaves
    ``h_i = silu(h_{i-1} @ W'_i)``.

    Args:
        fan_in, var_in, var_out: per layer (e3nn ``_Layer.h_in``, ``var_in``, ``var_out``).
        act_cst: per hidden layer, the activation's normalisation constant (1 if none).
    """
    n = len(fan_in)
    scales = []
    carry = 1.0  # the constant of the previous hidden layer's output
    for i in range(n):
        if i < n - 1:
            scale = carry / (fan_in[i] * var_in[i]) ** 0.5
            carry = act_cst[i] * var_out[i] ** 0.5
        else:
            scale = carry / (fan_in[i] * var_in[i] / var_out[i]) ** 0.5
        scales.append(scale)
    return scales


def pre_activations(x: Tensor, weights: Sequence[Tensor],
                    last_act: bool = False) -> Tuple[List[Tensor], Tensor]:
    """``(z_1..z_{L-1}, out)``: the hidden pre-activations and the output (``last_act``: the
    last layer has a SiLU too, and its pre-activation ``z_L`` is listed)."""
    pre = []
    h = x
    for i, w in enumerate(weights):
        if i == len(weights) - 1 and not last_act:
            return pre, torch.mm(h, w)
        z = torch.mm(h, w)
        h = F.silu(z)
        pre.append(z)
    return pre, h


def _silu_grad(g: Tensor, z: Tensor) -> Tensor:
    """``g * silu'(z)``: one fused kernel, or differentiable ops under ``create_graph``
    (aten's ``silu_backward`` has no derivative)."""
    if not torch.is_grad_enabled():
        return torch.ops.aten.silu_backward(g, z)
    s = torch.sigmoid(z)
    return g * s * (1 + z * (1 - s))


class _RadialMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, last_act: bool, *weights: Tensor) -> Tensor:
        pre, out = pre_activations(x, weights, last_act)
        ctx.save_for_backward(x, *weights, *pre)
        ctx.n_layers, ctx.last_act = len(weights), last_act
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        n = ctx.n_layers
        saved = ctx.saved_tensors
        x, weights, pre = saved[0], saved[1:1 + n], list(saved[1 + n:])
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2:]
        if torch.is_grad_enabled():  # create_graph: pre-activations connected to x and W
            pre, _ = pre_activations(x, weights, ctx.last_act)
        grad_x, grads_w = vjp(x, weights, pre, grad, ctx.last_act, need_x, need_w)
        return (grad_x, None, *grads_w)


def vjp(x: Tensor, weights: Sequence[Tensor], pre: Sequence[Tensor], grad: Tensor,
        last_act: bool, need_x: bool, need_w: Sequence[bool]
        ) -> Tuple[Optional[Tensor], List[Optional[Tensor]]]:
    """``(d x, [d W_i])`` of ``<grad, net(x)>`` from the pre-activations ``pre``
    (:func:`pre_activations`), only those asked for; torch ops, differentiable when grad mode
    is on (double backward)."""
    n = len(weights)
    lowest = 0 if need_x else next((i for i, w in enumerate(need_w) if w), n)
    grads_w: List[Optional[Tensor]] = [None] * n
    g = grad.contiguous()
    if last_act:
        g = _silu_grad(g, pre[n - 1])
    for i in range(n - 1, lowest - 1, -1):
        if need_w[i]:
            h_in = x if i == 0 else F.silu(pre[i - 1])
            grads_w[i] = torch.mm(h_in.t(), g)
        if i == lowest:
            break
        g = _silu_grad(torch.mm(g, weights[i].t()), pre[i - 1])
    grad_x = torch.mm(g, weights[0].t()) if need_x else None
    return grad_x, grads_w


def radial_mlp(x: Tensor, weights: Sequence[Tensor], last_act: bool = False) -> Tensor:
    """``[E, h_L]``: the folded SiLU MLP of ``x [E, h0]`` (see module docstring); with
    ``last_act`` the last layer has a SiLU too (the hidden part of a net whose own last layer
    is folded into the convolution)."""
    return _RadialMLP.apply(x, last_act, *weights)


def reference(x: Tensor, weights: Sequence[Tensor], last_act: bool = False) -> Tensor:
    """The same net as plain differentiable torch ops (for tests)."""
    return pre_activations(x, weights, last_act)[1]
