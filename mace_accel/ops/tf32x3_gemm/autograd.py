"""The radial MLP's last layer ``h @ W`` as ``torch.library`` custom ops on the 3xTF32 kernels.

``W [k, n]`` is passed as ``wt = W^T``, a contiguous ``[n, k]`` (the radial MLP keeps its
weights column-major). One op, ``mm_op(a, wt, transposed)``, both ways:

* ``transposed``: ``h @ wt^T`` ``[M, n]``, the forward (kernel layout ``"nk"``)
* else: ``g @ wt`` ``[M, k]``, its ``d h`` (kernel layout ``"kn"``)

each the other's backward, so double backward (training on forces) runs through them too.
Weight gradients (training only) are cuBLAS float32 GEMMs. Shapes and dtype are checked by the
kernels (float32, CUDA, ``k`` and ``n`` multiples of 4: :func:`~.spec.unsupported_reason`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Tuple

import torch

from mace_accel.ops import registry
from mace_accel.ops.custom_op import custom_op
from mace_accel.ops.tf32x3_gemm.spec import GemmSpec, unsupported_reason

if TYPE_CHECKING:
    from mace_accel.ops.tf32x3_gemm.cuda import CudaGemm

FAMILY = "tf32x3_gemm"
Tensor = torch.Tensor


def _kernels(k: int, n: int, layout: str, epilogue: str, device: torch.device) -> "CudaGemm":
    """The compiled kernel of one spec on ``device`` (built once per process)."""
    from mace_accel.ops.tf32x3_gemm.cuda import CudaGemm

    return registry.cached((FAMILY, k, n, layout, epilogue, device),
                           lambda: CudaGemm(GemmSpec(k, n, layout, epilogue), device))


def _gemm(a: Tensor, b: Tensor, k: int, n: int, layout: str) -> Tensor:
    return _kernels(k, n, layout, "none", a.device).apply(a, b)


def _mm(a: Tensor, wt: Tensor, transposed: bool) -> Tensor:
    """``a [M, k] @ wt^T`` ``[M, n]`` (``transposed``: kernel layout ``"nk"``), else
    ``a [M, n] @ wt`` ``[M, k]`` (layout ``"kn"``); ``wt [n, k]``."""
    n, k = int(wt.shape[0]), int(wt.shape[1])
    return _gemm(a, wt, k, n, "nk") if transposed else _gemm(a, wt, n, k, "kn")


@custom_op("mace_accel::tf32x3_mm")
def mm_op(a: Tensor, wt: Tensor, transposed: bool) -> Tensor:
    """:func:`_mm` as a differentiable op."""
    return _mm(a, wt, transposed)


@mm_op.register_fake
def _(a, wt, transposed):
    return a.new_empty((a.shape[0], wt.shape[0] if transposed else wt.shape[1]))


def _setup(ctx, inputs, output) -> None:
    a, wt, transposed = inputs
    ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, wt)
    ctx.transposed = transposed


def _backward(ctx, g):
    a, wt = ctx.saved_tensors
    g = g.contiguous()
    ga = mm_op(g, wt, not ctx.transposed) if ctx.needs_input_grad[0] else None
    gwt = None
    if ctx.needs_input_grad[1]:  # training: cuBLAS float32
        gwt = torch.mm(g.t(), a) if ctx.transposed else torch.mm(a.t(), g)
    return ga, gwt, None


mm_op.register_autograd(_backward, setup_context=_setup)


def runs_on(t: Tensor, k: int, n: int) -> bool:
    """Whether ``[M, k] x [k, n]`` with ``t``'s dtype and device can run on the kernels."""
    return t.is_cuda and t.dtype == torch.float32 and unsupported_reason(k, n) is None


def linear(h: Tensor, w: Tensor) -> Tensor:
    """Differentiable ``h [M, k] @ w [k, n]`` on the 3xTF32 kernels (``w`` column-major, as
    the radial MLP keeps it, costs no copy; ``h`` is made contiguous)."""
    return mm_op(h.contiguous(), w.t().contiguous(), True)


def mm(a: Tensor, w: Tensor) -> Tensor:
    """``a [M, k] @ w [k, n]`` on the kernel, no autograd (inside other ops' forward)."""
    return _mm(a.contiguous(), w.t().contiguous(), True)


def mm_t(g: Tensor, w: Tensor) -> Tensor:
    """``g [M, n] @ w^T`` (``w [k, n]``) on the kernel, no autograd (inside other ops'
    backward)."""
    return _mm(g.contiguous(), w.t().contiguous(), False)


def mm_silu(h: Tensor, w: Tensor) -> Tuple[Tensor, Tensor]:
    """``(z, silu(z))``, ``z = h [M, k] @ w [k, n]``: a hidden layer's forward in one kernel, no
    autograd (inside the radial MLP's own autograd function)."""
    k, n = int(w.shape[0]), int(w.shape[1])
    return _kernels(k, n, "nk", "silu", h.device).apply_silu(h.contiguous(), w.t().contiguous())


def mm_t_silu_grad(g: Tensor, w: Tensor, z: Tensor) -> Tensor:
    """``(g [M, n] @ w^T) * silu'(z)`` ``[M, k]`` (``w [k, n]``, ``z [M, k]`` the layer below's
    pre-activations): a hidden layer's backward in one kernel, no autograd."""
    k, n = int(w.shape[0]), int(w.shape[1])
    return _kernels(n, k, "kn", "silu_grad", g.device).apply(g.contiguous(), w.t().contiguous(),
                                                             z.contiguous())
