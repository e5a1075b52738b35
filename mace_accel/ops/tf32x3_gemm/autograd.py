"""The radial MLP's last layer ``h @ W`` as ``torch.library`` custom ops on the 3xTF32 kernels.

``W [k, n]`` is passed as ``wt = W^T``, a contiguous ``[n, k]`` (the radial MLP keeps its
weights column-major). Two ops, each the other's backward:

* ``linear(h, wt) = h @ wt^T``   ``[M, n]``: the forward (kernel layout ``"nk"``)
* ``linear_t(g, wt) = g @ wt``   ``[M, k]``: its ``d h`` (kernel layout ``"kn"``)

so double backward (training on forces) runs through them too. Weight gradients
(``g^T @ h``, training only) are cuBLAS float32 GEMMs. Shapes and dtype are checked by the
kernels (float32, CUDA, ``k`` and ``n`` multiples of 4: :func:`~.spec.unsupported_reason`).
"""

from __future__ import annotations

import torch

from mace_accel.ops import registry
from mace_accel.ops.tf32x3_gemm.spec import GemmSpec, unsupported_reason

FAMILY = "tf32x3_gemm"
Tensor = torch.Tensor


def _gemm(a: Tensor, b: Tensor, k: int, n: int, layout: str) -> Tensor:
    from mace_accel.ops.tf32x3_gemm.cuda import CudaGemm

    spec_key = (FAMILY, k, n, layout, a.device)
    kernels = registry.cached(spec_key, lambda: CudaGemm(GemmSpec(k, n, layout), a.device))
    return kernels.apply(a, b)


@torch.library.custom_op("mace_accel::tf32x3_linear", mutates_args=())
def linear_op(h: Tensor, wt: Tensor) -> Tensor:
    """``[M, n]`` = ``h [M, k] @ wt^T`` (``wt [n, k]``)."""
    return _gemm(h, wt, int(wt.shape[1]), int(wt.shape[0]), "nk")


@linear_op.register_fake
def _(h, wt):
    return h.new_empty((h.shape[0], wt.shape[0]))


@torch.library.custom_op("mace_accel::tf32x3_linear_t", mutates_args=())
def linear_t_op(g: Tensor, wt: Tensor) -> Tensor:
    """``[M, k]`` = ``g [M, n] @ wt`` (``wt [n, k]``)."""
    return _gemm(g, wt, int(wt.shape[0]), int(wt.shape[1]), "kn")


@linear_t_op.register_fake
def _(g, wt):
    return g.new_empty((g.shape[0], wt.shape[1]))


def _setup(ctx, inputs, output) -> None:
    a, wt = inputs
    ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, wt)


def _linear_backward(ctx, g):
    h, wt = ctx.saved_tensors
    g = g.contiguous()
    gh = linear_t_op(g, wt) if ctx.needs_input_grad[0] else None
    gwt = torch.mm(g.t(), h) if ctx.needs_input_grad[1] else None
    return gh, gwt


def _linear_t_backward(ctx, gg):
    g, wt = ctx.saved_tensors
    gg = gg.contiguous()
    dg = linear_op(gg, wt) if ctx.needs_input_grad[0] else None
    dwt = torch.mm(g.t(), gg) if ctx.needs_input_grad[1] else None
    return dg, dwt


linear_op.register_autograd(_linear_backward, setup_context=_setup)
linear_t_op.register_autograd(_linear_t_backward, setup_context=_setup)


def runs_on(t: Tensor, k: int, n: int) -> bool:
    """Whether ``[M, k] x [k, n]`` with ``t``'s dtype and device can run on the kernels."""
    return t.is_cuda and t.dtype == torch.float32 and unsupported_reason(k, n) is None


def linear(h: Tensor, w: Tensor) -> Tensor:
    """Differentiable ``h [M, k] @ w [k, n]`` on the 3xTF32 kernels (``w`` column-major, as
    the radial MLP keeps it, costs no copy; ``h`` is made contiguous)."""
    return linear_op(h.contiguous(), w.t().contiguous())


def mm(a: Tensor, w: Tensor) -> Tensor:
    """``a [M, k] @ w [k, n]`` on the kernel, no autograd (inside other ops' forward)."""
    return _gemm(a.contiguous(), w.t().contiguous(), int(w.shape[0]), int(w.shape[1]), "nk")


def mm_t(g: Tensor, w: Tensor) -> Tensor:
    """``g [M, n] @ w^T`` (``w [k, n]``) on the kernel, no autograd (inside other ops'
    backward)."""
    return _gemm(g.contiguous(), w.t().contiguous(), int(w.shape[1]), int(w.shape[0]), "kn")
