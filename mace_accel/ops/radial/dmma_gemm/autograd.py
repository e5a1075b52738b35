"""The radial MLP's last layer ``h @ W`` in float64 as a ``torch.library`` custom op on the DMMA
kernel.

``W [narrow, wide]`` is passed as it is and packed (:func:`pack_weight`; the caller caches the
buffer with the weight). One op, ``mm_op(a, packed, w, forward)``, both ways, each the other's
backward, so double backward (training on forces) runs through them too: ``forward``:
``a [M, narrow] W`` on the DMMA kernel; else ``a [M, wide] W^T`` on cuBLAS (on MACE-MP's last
layers cuBLAS's ``g W^T`` beat a DMMA kernel's best geometry, while the forward kernel beats
cuBLAS's forward). No gradient reaches ``W``, so the callers take this path only when no weight
gradient is asked for (inference), or compute it themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mace_accel.ops import registry
from mace_accel.ops.custom_op import custom_op
from mace_accel.ops.radial.dmma_gemm import codegen
from mace_accel.ops.radial.dmma_gemm.spec import DmmaGemmSpec, pack, unsupported_reason
from mace_accel.ops.runtime import aligned16, torch_arch

if TYPE_CHECKING:
    from mace_accel.ops.radial.dmma_gemm.cuda import CudaDmmaGemm

FAMILY = "dmma_gemm"
Tensor = torch.Tensor


def _kernels(narrow: int, wide: int, device: torch.device) -> "CudaDmmaGemm":
    """The compiled kernels of one spec on ``device`` (built once per process)."""
    from mace_accel.ops.radial.dmma_gemm.cuda import CudaDmmaGemm

    return registry.cached((FAMILY, narrow, wide, device),
                           lambda: CudaDmmaGemm(DmmaGemmSpec(narrow, wide), device))


def _mm(a: Tensor, packed: Tensor, w: Tensor, forward: bool) -> Tensor:
    """``a [M, narrow] W`` (``forward``, the DMMA kernel) or ``a [M, wide] W^T`` (cuBLAS)."""
    if not forward:
        return torch.mm(a, w.t())
    kernels = _kernels(int(w.shape[0]), int(w.shape[1]), a.device)
    return kernels.forward(aligned16(a), packed)  # the kernel copies 16-byte pairs


@custom_op("mace_accel::dmma_mm")
def mm_op(a: Tensor, packed: Tensor, w: Tensor, forward: bool) -> Tensor:
    """``a [M, narrow] W`` (``forward``) or ``a [M, wide] W^T``; ``packed``:
    :func:`pack_weight` of ``w``."""
    return _mm(a, packed, w, forward)


@mm_op.register_fake
def _(a, packed, w, forward):
    return a.new_empty((a.shape[0], w.shape[1] if forward else w.shape[0]))


def _setup(ctx, inputs, output) -> None:
    _, packed, w, forward = inputs
    ctx.save_for_backward(packed, w)
    ctx.forward = forward


def _backward(ctx, g):
    packed, w = ctx.saved_tensors
    ga = mm_op(g.contiguous(), packed, w, not ctx.forward) if ctx.needs_input_grad[0] else None
    return ga, None, None, None


mm_op.register_autograd(_backward, setup_context=_setup)


def runs_on(t: Tensor, narrow: int, wide: int) -> bool:
    """Whether ``[M, narrow] x [narrow, wide]`` with ``t``'s dtype and device runs on the
    kernels: float64 on an sm_90 GPU, widths they take."""
    if not (t.is_cuda and t.dtype == torch.float64 and unsupported_reason(narrow, wide) is None):
        return False
    return torch_arch(t.device) == codegen.ARCH


def pack_weight(w: Tensor) -> Tensor:
    """The kernels' buffer of ``w [narrow, wide]`` (not differentiable: cache it with ``w``)."""
    with torch.no_grad():
        return pack(DmmaGemmSpec(int(w.shape[0]), int(w.shape[1])), w.detach())


def linear(h: Tensor, packed: Tensor, w: Tensor) -> Tensor:
    """Differentiable in ``h``: ``h [M, narrow] @ w`` ``[M, wide]`` (``packed``:
    :func:`pack_weight` of ``w``; no gradient reaches ``w``)."""
    return mm_op(h.contiguous(), packed, w, True)


def mm(a: Tensor, packed: Tensor, w: Tensor) -> Tensor:
    """``a [M, narrow] @ w``, no autograd (inside other ops' forward)."""
    return _mm(a.contiguous(), packed, w, True)
