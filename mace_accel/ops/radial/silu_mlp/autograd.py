"""The fused SiLU MLP as ``torch.library`` custom ops with autograd.

``mace_accel::silu_mlp(x, w)`` is ``silu(...silu(x W_1)...W_L)`` of the packed weights ``w``
(:func:`~.spec.pack_weights`), its backward the differentiable torch path of
:func:`mace_accel.ops.radial.mlp.vjp` (the forward recomputed as torch ops). Where the CUDA
kernels run and ``x`` needs a gradient, :func:`silu_mlp` takes ``mace_accel::silu_mlp_keep``
instead, which also keeps each layer's ``silu'(z)``: ``mace_accel::silu_mlp_kept_backward``
takes ``d x`` from them when only ``d x`` is asked for without ``create_graph`` (forces,
stress); a weight gradient (training) or a double backward (training on forces) takes the torch
path. There is no kernel that recomputes the forward in the backward: where the TP weights are
recomputed to save memory, the radial MLP runs its layers as GEMMs instead
(:meth:`~mace_accel.patches.radial.mlp.FusedRadialMLP.route`). ``backend`` picks the CUDA
kernels or the plain-torch reference. Shapes: ``x [E, h0]``, ``w [packed_numel]``, ``g`` and the
output ``[E, h_L]``.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from mace_accel.ops import registry
from mace_accel.ops.custom_op import custom_op
from mace_accel.ops.radial import mlp as radial_mlp
from mace_accel.ops.radial.silu_mlp.spec import SiluMLPSpec, unpack_weights

FAMILY = "silu_mlp"
Tensor = torch.Tensor


def register_spec(spec: SiluMLPSpec) -> str:
    """The registry key of ``spec``."""
    return registry.register(FAMILY, spec)


def _cuda(key: str, t: Tensor):
    from mace_accel.ops.radial.silu_mlp.cuda import CudaSiluMLP

    return registry.kernels_for(key, t, CudaSiluMLP)


def reference(spec: SiluMLPSpec, x: Tensor, w: Tensor) -> Tensor:
    """``[E, h_L]`` with plain differentiable torch ops."""
    return radial_mlp.reference(x, unpack_weights(spec, w), last_act=True)


def _vjp(spec: SiluMLPSpec, x: Tensor, w: Tensor, g: Tensor, need_x: bool,
         need_w: bool) -> tuple:
    """``(d x, d w)`` with torch ops (differentiable under grad mode); ``d w`` in the packed
    layout, in the plain ``W_i`` (the tensor-core fragments are copies of them and get zero)."""
    weights = unpack_weights(spec, w)
    pre, _ = radial_mlp.pre_activations(x, weights, last_act=True)
    gx, gws = radial_mlp.vjp(x, weights, pre, g, True, need_x, [need_w] * len(weights))
    gw: Optional[Tensor] = None
    if need_w:
        parts: List[Tensor] = [gi.reshape(-1) for gi in gws]
        gw = torch.cat(parts + [w.new_zeros(spec.packed_numel - sum(p.numel() for p in parts))])
    return gx, gw


@custom_op("mace_accel::silu_mlp")
def silu_mlp_op(x: Tensor, w: Tensor, key: str, backend: str) -> Tensor:
    """``[E, h_L]``: the SiLU MLP of spec ``key`` applied to ``x [E, h0]``."""
    spec = registry.lookup(key)
    if backend == "reference":
        return reference(spec, x, w)
    return _cuda(key, x).forward(x, w)


@silu_mlp_op.register_fake
def _(x, w, key, backend):
    return x.new_empty((x.shape[0], registry.lookup(key).widths[-1]))


def _setup(ctx, inputs, output) -> None:
    x, w, key, _backend = inputs
    ctx.save_for_backward(x, w)
    ctx.key = key


def _backward(ctx, g):
    # torch ops, differentiable under grad mode (create_graph). A CUDA call whose d x is asked
    # for takes silu_mlp_keep instead (silu_mlp): this runs for the reference backend and for
    # CUDA calls where only the weights need a gradient (nothing to keep slopes for)
    x, w = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    gx, gw = _vjp(registry.lookup(ctx.key), x, w, g, need_x, need_w)
    return gx, gw, None, None


silu_mlp_op.register_autograd(_backward, setup_context=_setup)


@custom_op("mace_accel::silu_mlp_keep")
def silu_mlp_keep_op(x: Tensor, w: Tensor, key: str) -> Tuple[Tensor, Tensor]:
    """``(out [E, h_L], slopes)``: the forward (CUDA) that also keeps every layer's
    ``silu'(z)`` for its backward (an opaque buffer, not differentiable)."""
    return _cuda(key, x).forward(x, w, keep_slopes=True)


@silu_mlp_keep_op.register_fake
def _(x, w, key):
    from mace_accel.ops.radial.silu_mlp import dmma

    spec = registry.lookup(key)
    numel = dmma.plan_kernels(spec).slopes_numel(x.shape[0])
    return x.new_empty((x.shape[0], spec.widths[-1])), x.new_empty((numel,))


@custom_op("mace_accel::silu_mlp_kept_backward")
def silu_mlp_kept_backward_op(slopes: Tensor, w: Tensor, g: Tensor, key: str) -> Tensor:
    """``[E, h0]``: ``d x`` of ``<g, silu_mlp(x, w)>`` from the slopes the forward kept."""
    return _cuda(key, g).backward_kept(slopes, w, g)


@silu_mlp_kept_backward_op.register_fake
def _(slopes, w, g, key):
    return g.new_empty((g.shape[0], registry.lookup(key).widths[0]))


def _setup_keep(ctx, inputs, output) -> None:
    x, w, key = inputs
    ctx.save_for_backward(x, w, output[1])
    ctx.key = key
    ctx.mark_non_differentiable(output[1])
    # no zero-filled [E, widths] gradient for the slopes (a full write of a large tensor)
    ctx.set_materialize_grads(False)


def _backward_keep(ctx, g, _slopes_grad):
    x, w, slopes = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    if g is None:  # the output took no part in the loss
        return None, None, None
    if need_w or torch.is_grad_enabled():  # training, or create_graph: differentiable path
        gx, gw = _vjp(registry.lookup(ctx.key), x, w, g, need_x, need_w)
        return gx, gw, None
    gx = silu_mlp_kept_backward_op(slopes, w, g.contiguous(), ctx.key) if need_x else None
    return gx, None, None


silu_mlp_keep_op.register_autograd(_backward_keep, setup_context=_setup_keep)


def silu_mlp(key: str, x: Tensor, w: Tensor, backend: str = "cuda") -> Tensor:
    """Differentiable ``[E, h_L]`` (see module docstring); ``x`` is made contiguous. Where the
    kernels run and ``x`` needs a gradient, the forward keeps every layer's ``silu'(z)``
    (``[E, sum of the hidden widths]`` doubles) for the backward kernel."""
    x = x.contiguous()
    if backend == "cuda" and x.is_cuda and x.requires_grad and torch.is_grad_enabled():
        return silu_mlp_keep_op(x, w, key)[0]
    return silu_mlp_op(x, w, key, backend)
