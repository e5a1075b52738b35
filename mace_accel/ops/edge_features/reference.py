"""Plain-torch edge features: the CPU backend of the fused ops and the oracle of the GPU tests.

The forwards are e3nn's and mace's own formulas (the spherical harmonics *are* e3nn's
``o3.spherical_harmonics``); the backward and double backward are ``torch.func`` transforms of
those forwards (``torch.func`` also works inside a custom op, where plain autograd is off):

    backward:         dv = J(v)^T g
    double backward:  d_grad = J(v) a,  dv = H_g(v) a   (H_g: Hessian of <g, Y(v)>)

Layouts: vectors ``[E, 3]``, edge_attrs ``[E, (lmax+1)^2]``, lengths ``[E, 1]``, radial
``[E, num_basis]``, cutoff ``[E, 1]``. Every function returns new tensors.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from mace_accel.ops.edge_features.spec import RadialSpec, SHSpec

Tensor = torch.Tensor


# -- spherical harmonics ---------------------------------------------------------------------------
def sh_forward(spec: SHSpec, vectors: Tensor) -> Tensor:
    """``[E, dim]``: e3nn's spherical harmonics of orders ``0..lmax`` of ``vectors [E, 3]``."""
    from mace_accel._e3nn_compat import o3

    return o3().spherical_harmonics(list(range(spec.lmax + 1)), vectors, spec.normalize,
                                    spec.normalization)


def _on_cpu(fn):
    """Run ``fn`` on CPU copies of its tensor arguments and move the results back.

    e3nn's polynomials are a TorchScript function; on a GPU, TorchScript's fuser compiles it and
    the compiled kernels cannot read ``torch.func``'s wrapped tensors ("Cannot access data
    pointer of Tensor that doesn't have storage"). On the CPU there is no fuser, so the
    ``torch.func`` transforms below run there (the reference is the oracle, not a fast path).
    """
    def wrapped(spec, *tensors):
        device = tensors[0].device
        if device.type == "cpu":
            return fn(spec, *tensors)
        out = fn(spec, *(t.cpu() for t in tensors))
        return tuple(o.to(device) for o in out) if isinstance(out, tuple) else out.to(device)

    wrapped.__doc__, wrapped.__name__ = fn.__doc__, fn.__name__
    return wrapped


@_on_cpu
def sh_backward(spec: SHSpec, vectors: Tensor, grad: Tensor) -> Tensor:
    """``[E, 3]``: d/d vectors of ``<grad, Y(vectors)>``."""
    _, vjp = torch.func.vjp(lambda v: sh_forward(spec, v), vectors)
    return vjp(grad)[0]


@_on_cpu
def sh_double_backward(spec: SHSpec, vectors: Tensor, grad: Tensor,
                       upstream: Tensor) -> Tuple[Tensor, Tensor]:
    """``(d_vectors [E, 3], d_grad [E, dim])`` for the upstream gradient ``upstream [E, 3]`` of
    :func:`sh_backward`'s output."""
    def backward(v: Tensor) -> Tensor:
        return sh_backward(spec, v, grad)

    _, d_vectors = torch.func.jvp(backward, (vectors,), (upstream,))
    _, d_grad = torch.func.jvp(lambda v: sh_forward(spec, v), (vectors,), (upstream,))
    return d_vectors, d_grad


# -- radial embedding ------------------------------------------------------------------------------
def _const(value, like: Tensor) -> Tensor:
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def radial_basis(spec: RadialSpec, lengths: Tensor) -> Tensor:
    """``[E, num_basis]``: mace's ``BesselBasis``, ``prefactor * (sin(w r) / r)``."""
    w = _const(spec.frequencies, lengths)
    return _const(spec.prefactor, lengths) * (torch.sin(w * lengths) / lengths)


def radial_cutoff(spec: RadialSpec, lengths: Tensor) -> Tensor:
    """``[E, 1]``: mace's ``PolynomialCutoff`` (envelope times the mask ``r < r_max``)."""
    r_max = _const(spec.r_max, lengths)
    p = spec.p
    c1, c2, c3 = spec.envelope_coefficients()
    r_over_r_max = lengths / r_max
    envelope = (1.0 - c1 * torch.pow(r_over_r_max, p) + c2 * torch.pow(r_over_r_max, p + 1)
                - c3 * torch.pow(r_over_r_max, p + 2))
    return envelope * (lengths < r_max)


def radial_forward(spec: RadialSpec, lengths: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
    """``(radial * cutoff, None)`` if ``apply_cutoff``, else ``(radial, cutoff)``."""
    cutoff = radial_cutoff(spec, lengths)
    radial = radial_basis(spec, lengths)
    if not spec.apply_cutoff:
        return radial, cutoff
    return radial * cutoff, None


def _outputs(spec: RadialSpec, lengths: Tensor) -> Tuple[Tensor, ...]:
    """The op's tensor outputs: ``(feats,)`` or ``(radial, cutoff)``."""
    feats, cutoff = radial_forward(spec, lengths)
    return (feats,) if cutoff is None else (feats, cutoff)


def radial_backward(spec: RadialSpec, lengths: Tensor, grad: Tensor,
                    grad_cutoff: Optional[Tensor]) -> Tensor:
    """``[E, 1]``: d/d lengths of ``<grad, feats> (+ <grad_cutoff, cutoff>)``; a missing
    ``grad_cutoff`` (cutoff applied, or not used) counts as zero."""
    _, vjp = torch.func.vjp(lambda r: _outputs(spec, r), lengths)
    if spec.apply_cutoff:
        cotangents: Tuple[Tensor, ...] = (grad,)
    else:
        cotangents = (grad, grad_cutoff if grad_cutoff is not None else
                      torch.zeros_like(lengths))
    return vjp(cotangents)[0]


def radial_double_backward(spec: RadialSpec, lengths: Tensor, grad: Tensor,
                           grad_cutoff: Optional[Tensor], upstream: Tensor
                           ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(d_lengths [E, 1], d_grad [E, B], d_grad_cutoff [E, 1] or None)`` for the upstream
    gradient ``upstream [E, 1]`` of :func:`radial_backward`'s output."""
    def backward(r: Tensor) -> Tensor:
        return radial_backward(spec, r, grad, grad_cutoff)

    _, d_lengths = torch.func.jvp(backward, (lengths,), (upstream,))
    _, tangents = torch.func.jvp(lambda r: _outputs(spec, r), (lengths,), (upstream,))
    return d_lengths, tangents[0], (tangents[1] if len(tangents) > 1 else None)
