"""The symmetric contraction as ``torch.library`` custom ops: forward, backward, double backward.

``out = sc(x, W)`` (x = node features ``[N, C, D]``, W = the element-indexed weights, ``elem``
the element of each node) is a polynomial in ``x`` and linear in ``W``. Its passes::

    backward       gx = J_x(out)^T g                     (op ``symmetric_contraction_backward``)
                   gW = onehot(elem)^T Q(x, g)           (op ``symmetric_contraction_weight_grad``)
    double backward, for an upstream v of gx:
                   d x = H_x(<g, out>) v,  d g = J_x(out) v   (op ``..._double_backward``)
                   d W = onehot(elem)^T Q_v(x, g, v)     (the weight-grad op along v)

That is every derivative that energies, forces, stresses and training on forces take. The
weight-gradient and double-backward ops cannot be differentiated again: they raise a
:class:`~mace_accel.errors.KernelError` saying so (third derivatives: run the model unpatched).

Each op has a fake (meta) implementation, so ``torch.compile``, ``torch.export`` and CUDA-graph
capture see one op. The spec travels as a registry key (:mod:`mace_accel.ops.registry`);
``backend`` picks the generated CUDA kernels (:mod:`.cuda`) or the plain-torch reference
(:mod:`.reference`); the composition here is the same for both
and is tested on the CPU.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from mace_accel.ops import registry
from mace_accel.ops.custom_op import check_backend, custom_op, placeholder, \
    refuse_derivatives, upstream_grad
from mace_accel.ops.symmetric_contraction import reference
from mace_accel.ops.symmetric_contraction.spec import SCSpec

FAMILY = "symmetric_contraction"
Tensor = torch.Tensor


def register_spec(spec: SCSpec) -> str:
    """The registry key of ``spec`` (what the ops take instead of the spec)."""
    return registry.register(FAMILY, spec)


def _cuda(key: str, t: Tensor):
    from mace_accel.ops.symmetric_contraction.cuda import CudaSymmetricContraction

    return registry.kernels_for(key, t, CudaSymmetricContraction)


def start_compiles(key: str, dtype: torch.dtype, device: torch.device) -> None:
    """Start compiling the CUDA kernels of the spec under ``key`` that a forces call launches."""
    _cuda(key, torch.empty(0, dtype=dtype, device=device)).start_compiles()


# -- forward ---------------------------------------------------------------------------------------
@custom_op("mace_accel::symmetric_contraction")
def sc_op(x: Tensor, elem: Tensor, weights: List[Tensor], key: str, backend: str) -> Tensor:
    """``[N, dim_out]``: the product basis of ``x [N, C, D]`` (mace's mul_ir layout)."""
    spec = registry.lookup(key)
    if backend == "reference":
        return reference.symmetric_contraction(spec, x, elem.long(), weights)
    return _cuda(key, x).forward(x, elem, weights)


@sc_op.register_fake
def _(x, elem, weights, key, backend):
    return x.new_empty((x.shape[0], registry.lookup(key).dim_out))


# -- backward to x -----------------------------------------------------------------------------
@custom_op("mace_accel::symmetric_contraction_backward")
def sc_backward_op(x: Tensor, elem: Tensor, weights: List[Tensor], g: Tensor, key: str,
                   backend: str) -> Tensor:
    """``d x [N, C, D]`` of ``<g, sc(x, W)>``."""
    spec = registry.lookup(key)
    if backend == "reference":
        return reference.backward_x(spec, x, elem.long(), weights, g)
    return _cuda(key, x).backward_x(x, elem, weights, g)


@sc_backward_op.register_fake
def _(x, elem, weights, g, key, backend):
    return torch.empty_like(x)


# -- weight gradients ------------------------------------------------------------------------------
@custom_op("mace_accel::symmetric_contraction_weight_grad")
def sc_weight_grad_op(x: Tensor, v: Tensor, elem: Tensor, weights: List[Tensor], g: Tensor,
                      key: str, backend: str) -> List[Tensor]:
    """``d W_j [Z, K_j, C]`` of ``<g, sc(x, W)>``, or with a non-empty ``v [N, C, D]`` of
    ``<g, J_x(sc) v>``. ``weights`` only fix the shapes (the result does not depend on them)."""
    spec = registry.lookup(key)
    directional = v.numel() > 0
    if backend == "reference":
        return reference.weight_grads(spec, x, elem.long(), weights, g,
                                      v if directional else None)
    return _cuda(key, x).weight_grads(x, elem, g, v if directional else None)


@sc_weight_grad_op.register_fake
def _(x, v, elem, weights, g, key, backend):
    return [torch.empty_like(w) for w in weights]


# -- double backward ---------------------------------------------------------------------------
@custom_op("mace_accel::symmetric_contraction_double_backward")
def sc_double_backward_op(x: Tensor, v: Tensor, elem: Tensor, weights: List[Tensor], g: Tensor,
                          key: str, backend: str, need_x: bool,
                          need_g: bool) -> Tuple[Tensor, Tensor]:
    """``(d x [N, C, D], d g [N, dim_out])`` for an upstream ``v`` of the backward's ``d x``;
    one not asked for comes back empty."""
    spec = registry.lookup(key)
    if backend == "reference":
        dx, dg = reference.double_backward(spec, x, v, elem.long(), weights, g, need_x, need_g)
    else:
        dx, dg = _cuda(key, x).double_backward(x, v, elem, weights, g, need_x, need_g)
    return (dx if dx is not None else placeholder(x), dg if dg is not None else placeholder(x))


@sc_double_backward_op.register_fake
def _(x, v, elem, weights, g, key, backend, need_x, need_g):
    spec = registry.lookup(key)
    return (torch.empty_like(x) if need_x else placeholder(x),
            x.new_empty((x.shape[0], spec.dim_out)) if need_g else placeholder(x))


# -- autograd ------------------------------------------------------------------------------------
def _any(flags) -> bool:
    """Whether a gradient is wanted for the weights: torch gives a list input's flags as a list
    (one per tensor), and a list of ``False`` is truthy."""
    return any(flags) if isinstance(flags, (list, tuple)) else bool(flags)


def _setup_forward(ctx, inputs, output) -> None:
    x, elem, weights, key, backend = inputs
    ctx.save_for_backward(x, elem, *weights)
    ctx.key, ctx.backend = key, backend


def _backward_of_forward(ctx, g):
    x, elem, *weights = ctx.saved_tensors
    need_x, _, need_w = ctx.needs_input_grad[:3]
    need_w = _any(need_w)
    no_w = [None] * len(weights)
    if g is None:
        return None, None, no_w, None, None
    g = g.contiguous()
    gx = sc_backward_op(x, elem, weights, g, ctx.key, ctx.backend) if need_x else None
    gw = no_w
    if need_w:
        gw = sc_weight_grad_op(x, placeholder(x), elem, weights, g, ctx.key, ctx.backend)
    return gx, None, gw, None, None


def _setup_backward(ctx, inputs, output) -> None:
    x, elem, weights, g, key, backend = inputs
    ctx.save_for_backward(x, elem, g, *weights)
    ctx.key, ctx.backend = key, backend


def _backward_of_backward(ctx, v):
    x, elem, g, *weights = ctx.saved_tensors
    need_x, _, need_w, need_g = ctx.needs_input_grad[:4]
    need_w = _any(need_w)
    v = upstream_grad(v)
    no_w = [None] * len(weights)
    if v is None:
        return None, None, no_w, None, None, None
    dx = dg = None
    if need_x or need_g:
        dx, dg = sc_double_backward_op(x, v, elem, weights, g, ctx.key, ctx.backend,
                                       need_x, need_g)
        dx, dg = (dx if need_x else None), (dg if need_g else None)
    dw = sc_weight_grad_op(x, v, elem, weights, g, ctx.key, ctx.backend) if need_w else no_w
    return dx, None, dw, dg, None, None


sc_op.register_autograd(_backward_of_forward, setup_context=_setup_forward)
sc_backward_op.register_autograd(_backward_of_backward, setup_context=_setup_backward)
refuse_derivatives(sc_weight_grad_op, "symmetric contraction")
refuse_derivatives(sc_double_backward_op, "symmetric contraction")


def symmetric_contraction(key: str, x: Tensor, elem: Tensor, weights: Sequence[Tensor],
                          backend: str = "cuda") -> Tensor:
    """Differentiable fused symmetric contraction ``[N, dim_out]``.

    Args:
        key: :func:`register_spec` of the problem.
        x: node features ``[N, C, D]`` (mace's layout after ``reshape_irreps``).
        elem: ``[N]`` int32 element index of every node.
        weights: ``[Z, K_j, C]`` per output and degree, in :attr:`SCSpec.weight_shapes` order.
        backend: ``"cuda"`` or ``"reference"``.
    """
    check_backend(backend)
    return sc_op(x.contiguous(), elem.contiguous(), [w.contiguous() for w in weights], key,
                 backend)
