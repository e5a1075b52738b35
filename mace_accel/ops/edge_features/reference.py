"""Plain-torch edge features: the CPU backend of the fused ops and the oracle of the GPU tests.

The forwards are e3nn's and mace's own formulas (the spherical harmonics *are* e3nn's
``o3.spherical_harmonics``); the backward and double backward are ``torch.func`` transforms of
those forwards (``torch.func`` also works inside a custom op, where plain autograd is off;
e3nn's TorchScript polynomials are run as plain Python for that, see ``_plain_e3nn_sh``):

    backward:         dv = J(v)^T g
    double backward:  d_grad = J(v) a,  dv = H_g(v) a   (H_g: Hessian of <g, Y(v)>)

Layouts: vectors ``[E, 3]``, edge_attrs ``[E, (lmax+1)^2]``, lengths ``[E, 1]``, radial
``[E, num_basis]``, cutoff ``[E, 1]``. Every function returns new tensors.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Optional, Tuple

import torch

from mace_accel.ops import registry
from mace_accel.ops.edge_features.spec import DistanceTransform, RadialSpec, SHSpec

Tensor = torch.Tensor


# -- spherical harmonics ---------------------------------------------------------------------------
def sh_forward(spec: SHSpec, vectors: Tensor) -> Tensor:
    """``[E, dim]``: e3nn's spherical harmonics of orders ``0..lmax`` of ``vectors [E, 3]``.

    e3nn's own function, with its polynomials run as plain Python (see :func:`_plain_e3nn_sh`).
    """
    from mace_accel._e3nn_compat import o3

    module, plain = _plain_e3nn_sh()
    scripted = module._spherical_harmonics
    module._spherical_harmonics = plain
    try:
        return o3().spherical_harmonics(list(range(spec.lmax + 1)), vectors, spec.normalize,
                                        spec.normalization)
    finally:
        module._spherical_harmonics = scripted


@functools.lru_cache(maxsize=None)
def _plain_e3nn_sh():
    """``(e3nn's SH module, its polynomial function compiled from e3nn's source as plain Python)``.

    e3nn's polynomials are a TorchScript function. Once TorchScript has profiled and optimised
    it (after a few calls, in any process), it no longer sees ``torch.func``'s wrapped tensors
    correctly: on the CPU the forward-mode derivatives below come out silently wrong, on a GPU
    its fused kernels fail. The same source run as Python has neither problem.
    """
    import inspect

    from mace_accel._e3nn_compat import o3

    o3()
    module = importlib.import_module("e3nn.o3._spherical_harmonics")
    source = inspect.getsource(module)
    start = source.index("def _spherical_harmonics(")
    end = source.index("\ndef ", start)
    namespace = {"torch": torch, "math": math}
    exec(compile(source[start:end], module.__file__, "exec"), namespace)  # noqa: S102
    return module, namespace["_spherical_harmonics"]


def sh_backward(spec: SHSpec, vectors: Tensor, grad: Tensor) -> Tensor:
    """``[E, 3]``: d/d vectors of ``<grad, Y(vectors)>``."""
    _, vjp = torch.func.vjp(lambda v: sh_forward(spec, v), vectors)
    return vjp(grad)[0]


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
    # made once per device (a training step captured as a CUDA graph cannot copy from the host)
    return registry.device_constant(value, like.dtype, like.device)


def radial_basis(spec: RadialSpec, lengths: Tensor,
                 frequencies: Optional[Tensor] = None) -> Tensor:
    """``[E, num_basis]``: mace's ``BesselBasis``, ``prefactor * (sin(w r) / r)``;
    ``frequencies``: ``w`` as a tensor on ``lengths``' device (else made from the spec)."""
    w = _const(spec.frequencies, lengths) if frequencies is None else frequencies
    return spec.prefactor * (torch.sin(w * lengths) / lengths)


def distance_transform(transform: DistanceTransform, lengths: Tensor, r0: Tensor) -> Tensor:
    """``x [E, 1]``: mace's ``AgnesiTransform`` / ``SoftTransform`` of ``lengths [E, 1]`` with
    each edge's ``r0 [E, 1]`` (:meth:`DistanceTransform.r0`), in mace's order of operations."""
    if transform.kind == "Agnesi":
        q, p, a = transform.params
        ratio = lengths / r0
        return (1 + (a * torch.pow(ratio, q) / (1 + torch.pow(ratio, q - p)))).reciprocal()
    (alpha,) = transform.params
    p0, p1 = (3 / 4) * r0, (4 / 3) * r0
    m = 0.5 * (p0 + p1)
    s = 0.5 * (1.0 + torch.tanh(alpha / (p1 - p0) * (lengths - m)))
    return p0 + (lengths - p0) * s


# r0 = scale (radius_a + radius_b) per transform (mace: Agnesi the mean, Soft the sum)
R0_SCALE = {"Agnesi": 0.5, "Soft": 1.0}


def pair_r0(transform: DistanceTransform, radii: Tensor, elements: Tensor,
            edge_index: Tensor) -> Tensor:
    """``[E, 1]``: the transform's ``r0`` of each edge from the radii of the model's elements
    ``radii [n]`` and the atoms' element indices ``elements [N]`` (mace's arithmetic)."""
    total = radii[elements[edge_index[0]]] + radii[elements[edge_index[1]]]
    return (R0_SCALE[transform.kind] * total).unsqueeze(-1)


def radial_cutoff(spec: RadialSpec, lengths: Tensor) -> Tensor:
    """``[E, 1]``: mace's ``PolynomialCutoff`` (envelope times the mask ``r < r_max``)."""
    r_max = spec.r_max  # a number, not a tensor: nothing is copied to the device (CUDA graphs)
    p = spec.p
    c1, c2, c3 = spec.envelope_coefficients()
    r_over_r_max = lengths / r_max
    envelope = (1.0 - c1 * torch.pow(r_over_r_max, p) + c2 * torch.pow(r_over_r_max, p + 1)
                - c3 * torch.pow(r_over_r_max, p + 2))
    return envelope * (lengths < r_max)


def radial_forward(spec: RadialSpec, lengths: Tensor, r0: Optional[Tensor] = None,
                   frequencies: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """``(radial * cutoff, None)`` if ``apply_cutoff``, else ``(radial, cutoff)``; with a
    distance transform the basis takes ``x = T(lengths, r0)`` (``r0 [E, 1]``, or a number: one
    pair of elements)."""
    cutoff = radial_cutoff(spec, lengths)
    x = lengths
    if spec.transform is not None:
        if r0 is None:
            raise ValueError("a transformed radial embedding needs each edge's r0")
        x = distance_transform(spec.transform, lengths, r0)
    radial = radial_basis(spec, x, frequencies)
    if not spec.apply_cutoff:
        return radial, cutoff
    return radial * cutoff, None


def _outputs(spec: RadialSpec, lengths: Tensor, r0: Optional[Tensor] = None
             ) -> Tuple[Tensor, ...]:
    """The op's tensor outputs: ``(feats,)`` or ``(radial, cutoff)``."""
    feats, cutoff = radial_forward(spec, lengths, r0)
    return (feats,) if cutoff is None else (feats, cutoff)


def radial_backward(spec: RadialSpec, lengths: Tensor, grad: Tensor,
                    grad_cutoff: Optional[Tensor], r0: Optional[Tensor] = None) -> Tensor:
    """``[E, 1]``: d/d lengths of ``<grad, feats> (+ <grad_cutoff, cutoff>)``; a missing
    ``grad_cutoff`` (cutoff applied, or not used) counts as zero; ``r0``: each edge's length
    scale of a distance transform (held constant)."""
    _, vjp = torch.func.vjp(lambda r: _outputs(spec, r, r0), lengths)
    if spec.apply_cutoff:
        cotangents: Tuple[Tensor, ...] = (grad,)
    else:
        cotangents = (grad, grad_cutoff if grad_cutoff is not None else
                      torch.zeros_like(lengths))
    return vjp(cotangents)[0]


def radial_double_backward(spec: RadialSpec, lengths: Tensor, grad: Tensor,
                           grad_cutoff: Optional[Tensor], upstream: Tensor,
                           r0: Optional[Tensor] = None
                           ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(d_lengths [E, 1], d_grad [E, B], d_grad_cutoff [E, 1] or None)`` for the upstream
    gradient ``upstream [E, 1]`` of :func:`radial_backward`'s output."""
    def backward(r: Tensor) -> Tensor:
        return radial_backward(spec, r, grad, grad_cutoff, r0)

    _, d_lengths = torch.func.jvp(backward, (lengths,), (upstream,))
    _, tangents = torch.func.jvp(lambda r: _outputs(spec, r, r0), (lengths,), (upstream,))
    return d_lengths, tangents[0], (tangents[1] if len(tangents) > 1 else None)
