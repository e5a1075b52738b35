"""The edge features as ``torch.library`` custom ops: forward, backward, double backward.

Spherical harmonics ``Y = sh(v)`` (``v`` = vectors ``[E, 3]``) and the radial embedding
``(F, C) = radial(r)`` (``r`` = lengths ``[E, 1]``) are per-edge functions of one small input,
so each pass is one kernel::

    sh_backward(v, g)                  = J(v)^T g                       [E, 3]
    sh_double_backward(v, g, a)        = (H_g(v) a, J(v) a)             ([E, 3], [E, dim])
    radial_backward(r, g, gc)          = sum_b g_b F_b' (+ gc C')       [E, 1]
    radial_double_backward(r, g, gc, a) = ((sum_b g_b F_b'' (+ gc C'')) a, F' a, C' a)

The backward op's autograd formula calls the double-backward op: its upstream gradient ``a``
gives the JVP for the upstream-gradient input (``J a``) and the Hessian-vector product for the
vectors/lengths input. Differentiating the double-backward op again raises a
:class:`~mace_accel.errors.KernelError` (third derivatives are not needed by MACE's energy,
forces, stress, Hessians or force training).

Each op has a fake (meta) implementation, so ``torch.compile``, ``torch.export`` and CUDA-graph
capture see one op. The spec travels as a registry key (:mod:`mace_accel.ops.registry`);
``backend`` picks the generated CUDA kernels (:mod:`.cuda`) or the plain-torch reference
(:mod:`.reference`); the composition here is the same for both and is tested on CPU.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from mace_accel.ops import registry
from mace_accel.ops.custom_op import check_backend, custom_op, placeholder, \
    refuse_derivatives, upstream_grad
from mace_accel.ops.edge_features import reference
from mace_accel.ops.edge_features.spec import RadialSpec, SHSpec

SH_FAMILY = "edge_sh"
RADIAL_FAMILY = "edge_radial"
Tensor = torch.Tensor


def register_sh(spec: SHSpec) -> str:
    """The registry key of a spherical-harmonics spec (what the ops take instead of it)."""
    return registry.register(SH_FAMILY, spec)


def register_radial(spec: RadialSpec) -> str:
    """The registry key of a radial-embedding spec."""
    return registry.register(RADIAL_FAMILY, spec)


def _cuda(key: str, t: Tensor):
    from mace_accel.ops.edge_features import cuda

    def build():
        spec = registry.lookup(key)
        cls = cuda.CudaSphericalHarmonics if isinstance(spec, SHSpec) else \
            cuda.CudaRadialEmbedding
        return cls(spec, t.dtype, t.device)

    return registry.cached((key, t.dtype, t.device), build)


def start_compiles(key: str, dtype: torch.dtype, device: torch.device) -> None:
    """Start compiling the CUDA kernels of the spec under ``key`` that a forces call launches."""
    _cuda(key, torch.empty(0, dtype=dtype, device=device)).start_compiles()


# == spherical harmonics ===========================================================================
@custom_op("mace_accel::edge_sh")
def sh_op(vectors: Tensor, key: str, backend: str) -> Tensor:
    """``edge_attrs [E, dim]`` of ``vectors [E, 3]`` (contiguous)."""
    check_backend(backend)
    spec = registry.lookup(key)
    if backend == "reference":
        return reference.sh_forward(spec, vectors).contiguous()
    return _cuda(key, vectors).forward(vectors)


@sh_op.register_fake
def _(vectors, key, backend):
    return vectors.new_empty((vectors.shape[0], registry.lookup(key).dim))


@custom_op("mace_accel::edge_sh_backward")
def sh_backward_op(vectors: Tensor, grad: Tensor, key: str, backend: str) -> Tensor:
    """``d vectors [E, 3]`` of ``<grad, Y(vectors)>``."""
    check_backend(backend)
    spec = registry.lookup(key)
    if backend == "reference":
        return reference.sh_backward(spec, vectors, grad).contiguous()
    return _cuda(key, vectors).backward(vectors, grad)


@sh_backward_op.register_fake
def _(vectors, grad, key, backend):
    return vectors.new_empty((vectors.shape[0], 3))


@custom_op("mace_accel::edge_sh_double_backward")
def sh_double_backward_op(vectors: Tensor, grad: Tensor, upstream: Tensor, key: str,
                          backend: str) -> Tuple[Tensor, Tensor]:
    """``(d vectors [E, 3], d grad [E, dim])`` for the upstream gradient ``[E, 3]`` of the
    backward's output."""
    check_backend(backend)
    spec = registry.lookup(key)
    if backend == "reference":
        d_vectors, d_grad = reference.sh_double_backward(spec, vectors, grad, upstream)
        return d_vectors.contiguous(), d_grad.contiguous()
    return _cuda(key, vectors).double_backward(vectors, grad, upstream)


@sh_double_backward_op.register_fake
def _(vectors, grad, upstream, key, backend):
    return vectors.new_empty((vectors.shape[0], 3)), grad.new_empty(grad.shape)


def _sh_setup_forward(ctx, inputs, output) -> None:
    vectors, key, backend = inputs
    ctx.save_for_backward(vectors)
    ctx.key, ctx.backend = key, backend


def _sh_backward_of_forward(ctx, grad):
    if grad is None or not ctx.needs_input_grad[0]:
        return None, None, None
    (vectors,) = ctx.saved_tensors
    return sh_backward_op(vectors, grad.contiguous(), ctx.key, ctx.backend), None, None


def _sh_setup_backward(ctx, inputs, output) -> None:
    vectors, grad, key, backend = inputs
    ctx.save_for_backward(vectors, grad)
    ctx.key, ctx.backend = key, backend


def _sh_backward_of_backward(ctx, upstream):
    upstream = upstream_grad(upstream)
    want_v, want_g = ctx.needs_input_grad[:2]
    if upstream is None or not (want_v or want_g):
        return None, None, None, None
    vectors, grad = ctx.saved_tensors
    d_vectors, d_grad = sh_double_backward_op(vectors, grad, upstream, ctx.key, ctx.backend)
    return (d_vectors if want_v else None), (d_grad if want_g else None), None, None


sh_op.register_autograd(_sh_backward_of_forward, setup_context=_sh_setup_forward)
sh_backward_op.register_autograd(_sh_backward_of_backward, setup_context=_sh_setup_backward)
refuse_derivatives(sh_double_backward_op, "edge-feature")


def spherical_harmonics(key: str, vectors: Tensor, backend: str = "cuda") -> Tensor:
    """Differentiable fused spherical harmonics ``[E, dim]`` of ``vectors [E, 3]``.

    Args:
        key: :func:`register_sh` of the problem.
        vectors: ``[E, 3]`` edge vectors (float32 or float64).
        backend: ``"cuda"`` or ``"reference"``.
    """
    return sh_op(vectors.contiguous(), key, backend)


# == radial embedding ==============================================================================
def _r0(spec, r0: Tensor) -> Optional[Tensor]:
    """Each edge's ``r0 [E, 1]`` where the spec has a distance transform (else None: the ops
    take an empty tensor there)."""
    return None if spec.transform is None else r0


@custom_op("mace_accel::edge_radial")
def radial_op(lengths: Tensor, r0: Tensor, key: str, backend: str) -> Tuple[Tensor, Tensor]:
    """``(feats [E, B], cutoff [E, 1])`` of ``lengths [E, 1]`` (and each edge's ``r0 [E, 1]``
    of a distance transform, else empty); ``cutoff`` is an empty tensor when the spec applies
    it (``feats = radial * cutoff``)."""
    check_backend(backend)
    spec = registry.lookup(key)
    if backend == "reference":
        feats, cutoff = reference.radial_forward(spec, lengths, _r0(spec, r0))
    else:
        feats, cutoff = _cuda(key, lengths).forward(lengths, _r0(spec, r0))
    return feats.contiguous(), (placeholder(lengths) if cutoff is None else cutoff.contiguous())


@radial_op.register_fake
def _(lengths, r0, key, backend):
    spec = registry.lookup(key)
    n = lengths.shape[0]
    return (lengths.new_empty((n, spec.num_basis)),
            placeholder(lengths) if spec.apply_cutoff else lengths.new_empty((n, 1)))


@custom_op("mace_accel::edge_radial_backward")
def radial_backward_op(lengths: Tensor, r0: Tensor, grad: Tensor, grad_cutoff: Tensor,
                       key: str, backend: str) -> Tensor:
    """``d lengths [E, 1]`` of ``<grad, feats> + <grad_cutoff, cutoff>`` (``grad_cutoff``
    empty when the cutoff is applied)."""
    check_backend(backend)
    spec = registry.lookup(key)
    gc = None if spec.apply_cutoff else grad_cutoff
    if backend == "reference":
        return reference.radial_backward(spec, lengths, grad, gc, _r0(spec, r0)).contiguous()
    return _cuda(key, lengths).backward(lengths, grad, gc, _r0(spec, r0))


@radial_backward_op.register_fake
def _(lengths, r0, grad, grad_cutoff, key, backend):
    return lengths.new_empty(lengths.shape)


@custom_op("mace_accel::edge_radial_double_backward")
def radial_double_backward_op(lengths: Tensor, r0: Tensor, grad: Tensor, grad_cutoff: Tensor,
                              upstream: Tensor, key: str,
                              backend: str) -> Tuple[Tensor, Tensor, Tensor]:
    """``(d lengths [E, 1], d grad [E, B], d grad_cutoff [E, 1] or empty)`` for the upstream
    gradient ``[E, 1]`` of the backward's output."""
    check_backend(backend)
    spec = registry.lookup(key)
    gc = None if spec.apply_cutoff else grad_cutoff
    if backend == "reference":
        out = reference.radial_double_backward(spec, lengths, grad, gc, upstream,
                                               _r0(spec, r0))
    else:
        out = _cuda(key, lengths).double_backward(lengths, grad, gc, upstream, _r0(spec, r0))
    d_lengths, d_grad, d_cutoff = out
    return (d_lengths.contiguous(), d_grad.contiguous(),
            placeholder(lengths) if d_cutoff is None else d_cutoff.contiguous())


@radial_double_backward_op.register_fake
def _(lengths, r0, grad, grad_cutoff, upstream, key, backend):
    spec = registry.lookup(key)
    return (lengths.new_empty(lengths.shape), grad.new_empty(grad.shape),
            placeholder(lengths) if spec.apply_cutoff else lengths.new_empty(lengths.shape))


def _radial_setup_forward(ctx, inputs, output) -> None:
    lengths, r0, key, backend = inputs
    ctx.save_for_backward(lengths, r0)
    ctx.key, ctx.backend = key, backend
    ctx.apply_cutoff = registry.lookup(key).apply_cutoff


def _cutoff_grad(ctx, lengths: Tensor, grad_cutoff: Optional[Tensor]) -> Tensor:
    """The cutoff's upstream gradient as the backward op takes it (empty / zeros if unused)."""
    if ctx.apply_cutoff:
        return placeholder(lengths)
    grad_cutoff = upstream_grad(grad_cutoff)
    return torch.zeros_like(lengths) if grad_cutoff is None else grad_cutoff


def _radial_backward_of_forward(ctx, grad, grad_cutoff):
    grad, grad_cutoff_used = upstream_grad(grad), upstream_grad(grad_cutoff)
    if not ctx.needs_input_grad[0] or (grad is None and grad_cutoff_used is None):
        return None, None, None, None
    lengths, r0 = ctx.saved_tensors
    if grad is None:
        grad = lengths.new_zeros((lengths.shape[0], registry.lookup(ctx.key).num_basis))
    gc = _cutoff_grad(ctx, lengths, grad_cutoff)
    return radial_backward_op(lengths, r0, grad, gc, ctx.key, ctx.backend), None, None, None


def _radial_setup_backward(ctx, inputs, output) -> None:
    lengths, r0, grad, grad_cutoff, key, backend = inputs
    ctx.save_for_backward(lengths, r0, grad, grad_cutoff)
    ctx.key, ctx.backend = key, backend
    ctx.apply_cutoff = registry.lookup(key).apply_cutoff


def _radial_backward_of_backward(ctx, upstream):
    upstream = upstream_grad(upstream)
    want_r, _, want_g, want_gc = ctx.needs_input_grad[:4]
    if upstream is None or not (want_r or want_g or want_gc):
        return None, None, None, None, None, None
    lengths, r0, grad, grad_cutoff = ctx.saved_tensors
    d_lengths, d_grad, d_cutoff = radial_double_backward_op(lengths, r0, grad, grad_cutoff,
                                                            upstream, ctx.key, ctx.backend)
    return ((d_lengths if want_r else None), None, (d_grad if want_g else None),
            (d_cutoff if want_gc and not ctx.apply_cutoff else None), None, None)


radial_op.register_autograd(_radial_backward_of_forward, setup_context=_radial_setup_forward)
radial_backward_op.register_autograd(_radial_backward_of_backward,
                                     setup_context=_radial_setup_backward)
refuse_derivatives(radial_double_backward_op, "edge-feature")


def radial_embedding(key: str, lengths: Tensor, backend: str = "cuda",
                     r0: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Differentiable fused radial embedding of ``lengths [E, 1]`` (with a distance transform:
    the Bessel functions of ``T(lengths, r0)``, ``r0 [E, 1]`` each edge's length scale, held
    constant).

    Returns:
        ``(radial * cutoff [E, B], None)`` if the spec applies the cutoff, else
        ``(radial [E, B], cutoff [E, 1])``, as mace's ``RadialEmbeddingBlock``.
    """
    r0 = placeholder(lengths) if r0 is None else r0.reshape(-1, 1).to(lengths.dtype).contiguous()
    feats, cutoff = radial_op(lengths.contiguous(), r0, key, backend)
    return feats, (None if registry.lookup(key).apply_cutoff else cutoff)
