"""The equivariant linear map as a ``torch.library`` custom op with autograd.

``out = L_W(x)`` is linear in ``x`` and in ``W``. Backward: ``d x = L_{W^T}(g)`` (the same op
for the transposed spec, :meth:`~.spec.LinearSpec.transposed`), ``d W`` from torch ops
(training only). Both are differentiable, so double backward (training on forces) follows.
``backend`` picks the generated CUDA kernel or the plain-torch :func:`reference`.
Shapes: ``x [N, dim_in]``, ``w [weight_numel]`` (effective weights), ``elem [N]`` int32.
"""

from __future__ import annotations

from typing import Dict

import torch

from mace_accel.ops import registry
from mace_accel.ops.custom_op import custom_op
from mace_accel.ops.irreps_linear.spec import LinearSpec, weight_block

FAMILY = "irreps_linear"
Tensor = torch.Tensor


# key -> key of the transposed spec (both ways), filled at registration: the backward looks it
# up without hashing a spec (which a traced backward could not do)
_TRANSPOSED: Dict[str, str] = {}


def register_spec(spec: LinearSpec) -> str:
    """The registry key of ``spec``; its transpose is registered too (for the backward)."""
    key, key_t = registry.register(FAMILY, spec), registry.register(FAMILY, spec.transposed())
    _TRANSPOSED[key], _TRANSPOSED[key_t] = key_t, key
    return key


def _cuda(key: str, t: Tensor):
    from mace_accel.ops.irreps_linear.cuda import CudaIrrepsLinear

    return registry.kernels_for(key, t, CudaIrrepsLinear)


def start_compiles(key: str, dtype: torch.dtype, device: torch.device) -> None:
    """Start compiling the CUDA kernels of the map under ``key`` and of its transpose (what
    the backward applies)."""
    like = torch.empty(0, dtype=dtype, device=device)
    for k in (key, _TRANSPOSED[key]):
        _cuda(k, like).start_compiles()


def reference(spec: LinearSpec, x: Tensor, w: Tensor, elem: Tensor) -> Tensor:
    """``[N, dim_out]`` with plain differentiable torch ops."""
    n = x.shape[0]
    outs = [x.new_zeros((n, b.mul, b.d)) for b in spec.out_blocks]
    for ins in spec.instructions:
        a = spec.in_blocks[ins.i_in]
        xb = x[:, a.offset:a.offset + a.size].reshape(n, a.mul, a.d)
        wb = weight_block(spec, ins, w)
        if spec.indexed:
            outs[ins.i_out] = outs[ins.i_out] + torch.einsum("nud,nuv->nvd", xb,
                                                             wb[elem.long()])
        else:
            outs[ins.i_out] = outs[ins.i_out] + torch.einsum("nud,uv->nvd", xb, wb[0])
    return torch.cat([o.reshape(n, -1) for o in outs], dim=1) if outs else x.new_zeros((n, 0))


def weight_grad(spec: LinearSpec, x: Tensor, g: Tensor, elem: Tensor) -> Tensor:
    """``d W [weight_numel]`` of ``<g, L_W(x)>`` (torch ops, differentiable)."""
    n = x.shape[0]
    parts = []
    for ins in spec.instructions:
        a, b = spec.in_blocks[ins.i_in], spec.out_blocks[ins.i_out]
        xb = x[:, a.offset:a.offset + a.size].reshape(n, a.mul, a.d)
        gb = g[:, b.offset:b.offset + b.size].reshape(n, b.mul, b.d)
        if spec.indexed:
            onehot = torch.nn.functional.one_hot(elem.long(), spec.num_elements).to(x.dtype)
            gw = torch.einsum("nz,nud,nvd->zuv", onehot, xb, gb)
        else:
            gw = torch.einsum("nud,nvd->uv", xb, gb)[None]
        parts.append(gw.reshape(-1))
    return torch.cat(parts)


def _apply(x: Tensor, w: Tensor, elem: Tensor, key: str, backend: str) -> Tensor:
    """``[N, dim_out]``: the map of spec ``key`` applied to ``x`` (no autograd)."""
    spec = registry.lookup(key)
    if backend == "reference":
        return reference(spec, x, w, elem)
    return _cuda(key, x).apply(x, w, elem)


@custom_op("mace_accel::irreps_linear")
def linear_op(x: Tensor, w: Tensor, wt: Tensor, elem: Tensor, key: str,
              backend: str) -> Tensor:
    """``[N, dim_out]``: the map of spec ``key`` applied to ``x``. ``wt`` is ``w`` transposed
    (:func:`~.spec.transpose_weights`): not read here, it is what the backward applies (passed
    in so that callers can cache it; derived from ``w`` differentiably when training)."""
    return _apply(x, w, elem, key, backend)


@linear_op.register_fake
def _(x, w, wt, elem, key, backend):
    return x.new_empty((x.shape[0], registry.lookup(key).dim_out))


def _backward(ctx, g: Tensor) -> tuple:
    """``(d x, d W, None x 4)`` of the map; ``d x`` is the transposed map, differentiable
    (double backward)."""
    x, w, wt, elem = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    g = g.contiguous()
    gx = gw = None
    if need_x:
        gx = linear_op(g, wt, w, elem, _TRANSPOSED[ctx.key], ctx.backend)
    if need_w:
        gw = weight_grad(registry.lookup(ctx.key), x, g, elem)
    return gx, gw, None, None, None, None


def _setup(ctx, inputs, output) -> None:
    x, w, wt, elem, key, backend = inputs
    ctx.save_for_backward(x, w, wt, elem)
    ctx.key, ctx.backend = key, backend


linear_op.register_autograd(_backward, setup_context=_setup)


def irreps_linear(key: str, x: Tensor, w: Tensor, wt: Tensor, elem: Tensor,
                  backend: str = "cuda") -> Tensor:
    """Differentiable map ``[N, dim_out]`` (see module docstring); ``x`` is made contiguous.
    The custom op :func:`linear_op` (eager calls skip the dispatcher:
    :mod:`mace_accel.ops.custom_op`)."""
    return linear_op(x.contiguous(), w, wt, elem, key, backend)
