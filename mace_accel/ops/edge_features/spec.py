"""Frozen, hashable descriptions of MACE's two edge-feature modules (what the kernels solve).

``SHSpec`` describes the model's ``spherical_harmonics`` (an e3nn ``o3.SphericalHarmonics``):
``edge_attrs [E, (lmax+1)^2] = Y(vectors [E, 3])``, orders ``0..lmax`` in e3nn's layout.

``RadialSpec`` describes the model's ``radial_embedding`` (mace's ``RadialEmbeddingBlock`` with a
``BesselBasis`` and a ``PolynomialCutoff``), for ``lengths [E, 1]``::

    radial[e, b] = prefactor * sin(frequencies[b] * r) / r
    cutoff[e]    = (1 - (p+1)(p+2)/2 s^p + p(p+2) s^(p+1) - p(p+1)/2 s^(p+2)) * (r < r_max),
                   s = r / r_max
    returns (radial * cutoff, None) if apply_cutoff else (radial, cutoff)

With a distance transform (mace's ``AgnesiTransform`` or ``SoftTransform``) the Bessel functions
take ``x = T(r, r0)`` instead of ``r`` (the cutoff still takes ``r``), where ``r0`` depends on
the edge's two elements through their covalent radii (:class:`DistanceTransform`).

Constants are read off the module's own buffers (so a float32-built model gets its float32
values) and kept as float64 Python floats. Reading a spec needs the module, nothing else:
no torch import happens here beyond what the module already brought.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Optional, Tuple

SH_LMAX = 4                      # the largest order the fused kernels are generated for
SH_NORMALIZATIONS = ("component", "integral", "norm")
RADIAL_MAX_BASIS = 128           # generated code is unrolled per basis function
NORMALIZE_EPS = 1e-12            # torch.nn.functional.normalize's default eps (e3nn uses it)


def _digest(obj: Any) -> str:
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class SHSpec:
    """Spherical harmonics of orders ``0..lmax`` of edge vectors, as e3nn computes them.

    Attributes:
        lmax: largest order (the output has ``(lmax + 1)^2`` columns).
        normalization: e3nn's ``"component"`` (MACE), ``"integral"`` or ``"norm"``.
        normalize: divide the vectors by ``max(|v|, 1e-12)`` first (MACE: True).
    """

    lmax: int
    normalization: str = "component"
    normalize: bool = True

    @property
    def dim(self) -> int:
        return (self.lmax + 1) ** 2

    def key(self) -> str:
        """Stable hex digest of the spec (used in cache keys)."""
        return _digest(self)

    def describe(self) -> str:
        return (f"SHSpec(lmax={self.lmax}, {self.normalization}, "
                f"normalize={self.normalize}, dim={self.dim})")

    def unsupported_reason(self) -> Optional[str]:
        """Why the fused kernels cannot compute this spec, or None."""
        if not 0 <= self.lmax <= SH_LMAX:
            return f"lmax {self.lmax} (the fused kernels are generated for lmax <= {SH_LMAX})"
        if self.normalization not in SH_NORMALIZATIONS:
            return f"normalization {self.normalization!r} (supported: {SH_NORMALIZATIONS})"
        return None


TRANSFORMS = ("Agnesi", "Soft")


@dataclasses.dataclass(frozen=True)
class DistanceTransform:
    """mace's distance transform of the edge length, as the radial basis sees it.

    ``Agnesi`` (``params = (q, p, a)``, ``r0 = (R_u + R_v) / 2``)::

        x = 1 / (1 + a (r / r0)^q / (1 + (r / r0)^(q - p)))

    ``Soft`` (``params = (alpha,)``, ``r0 = R_u + R_v``, ``p0 = 3 r0 / 4``, ``p1 = 4 r0 / 3``)::

        x = p0 + (r - p0) (1 + tanh(alpha / (p1 - p0) (r - (p0 + p1) / 2))) / 2

    Attributes:
        kind: ``"Agnesi"`` or ``"Soft"``.
        params: the module's constants (float64 values of its buffers).
        radii: the covalent radius ``R`` of each of the model's elements, in the order of its
            ``atomic_numbers`` (the module's ``covalent_radii`` buffer read at them).
    """

    kind: str
    params: Tuple[float, ...]
    radii: Tuple[float, ...]

    def r0(self, a: int, b: int) -> float:
        """The transform's length scale for an edge between the model's elements ``a`` and
        ``b`` (indices into ``atomic_numbers``)."""
        total = self.radii[a] + self.radii[b]
        return 0.5 * total if self.kind == "Agnesi" else total

    def describe(self) -> str:
        names = {"Agnesi": ("q", "p", "a"), "Soft": ("alpha",)}[self.kind]
        return f"{self.kind}({', '.join(f'{n}={v:.4g}' for n, v in zip(names, self.params))})"


@dataclasses.dataclass(frozen=True)
class RadialSpec:
    """mace's Bessel radial basis times its polynomial cutoff envelope.

    Attributes:
        num_basis: number of Bessel functions (``out_dim``).
        frequencies: the module's ``bessel_weights`` (``pi / r_max * [1..num_basis]``) as
            float64 values of the buffer.
        prefactor: the module's ``prefactor`` buffer (``sqrt(2 / r_max)``).
        r_max: the cutoff's ``r_max`` buffer.
        p: the cutoff polynomial's exponent.
        apply_cutoff: return ``radial * cutoff`` (True, also for old checkpoints without the
            attribute) or ``radial`` and ``cutoff`` apart (False).
        transform: the distance transform the Bessel functions see, or None.
    """

    num_basis: int
    frequencies: Tuple[float, ...]
    prefactor: float
    r_max: float
    p: int
    apply_cutoff: bool = True
    transform: Optional[DistanceTransform] = None

    @property
    def dim(self) -> int:
        return self.num_basis

    def envelope_coefficients(self) -> Tuple[float, float, float]:
        """``((p+1)(p+2)/2, p(p+2), p(p+1)/2)``: the terms of the cutoff polynomial."""
        p = self.p
        return ((p + 1.0) * (p + 2.0) / 2.0, p * (p + 2.0), p * (p + 1.0) / 2.0)

    def key(self) -> str:
        """Stable hex digest of the spec (used in cache keys)."""
        return _digest(self)

    def describe(self) -> str:
        transform = "" if self.transform is None else f", {self.transform.describe()}"
        return (f"RadialSpec({self.num_basis} Bessel, r_max={self.r_max:g}, p={self.p}, "
                f"apply_cutoff={self.apply_cutoff}{transform})")

    def unsupported_reason(self) -> Optional[str]:
        """Why the fused kernels cannot compute this spec, or None."""
        if not 1 <= self.num_basis <= RADIAL_MAX_BASIS:
            return (f"{self.num_basis} basis functions (the fused kernels take "
                    f"1..{RADIAL_MAX_BASIS})")
        if len(self.frequencies) != self.num_basis:
            return f"{len(self.frequencies)} frequencies for {self.num_basis} basis functions"
        values = self.frequencies + (self.prefactor, self.r_max)
        if not all(math.isfinite(v) for v in values):
            return "non-finite Bessel frequencies, prefactor or r_max"
        if self.r_max <= 0:
            return f"r_max {self.r_max} <= 0"
        if self.p < 1:
            return f"cutoff exponent p = {self.p} (must be a positive integer)"
        return None


def make_radial_spec(r_max: float, num_basis: int = 8, p: int = 6,
                     apply_cutoff: bool = True) -> RadialSpec:
    """The spec of a ``RadialEmbeddingBlock(r_max, num_basis, p)`` built in float64.

    Same arithmetic as mace's ``BesselBasis`` (``pi / r_max * linspace(1, n, n)``, whose
    values are exact integers) and ``sqrt(2 / r_max)``.
    """
    scale = math.pi / r_max
    return RadialSpec(num_basis=num_basis, frequencies=tuple(scale * k for k in
                                                             range(1, num_basis + 1)),
                      prefactor=math.sqrt(2.0 / r_max), r_max=float(r_max), p=int(p),
                      apply_cutoff=bool(apply_cutoff))


def _qualname(module: Any) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__name__}"


def sh_spec_from_module(module: Any) -> Tuple[Optional[SHSpec], Optional[str]]:
    """Freeze a model's ``spherical_harmonics`` module.

    Returns:
        ``(spec, None)`` if the fused kernels compute exactly what ``module`` does, else
        ``(None, reason)`` with the reason in words.
    """
    cls = type(module)
    if cls.__name__ != "SphericalHarmonics" or not cls.__module__.startswith("e3nn."):
        return None, f"{_qualname(module)} is not e3nn's o3.SphericalHarmonics"
    ls = [int(v) for v in getattr(module, "_ls_list", [])]
    if not ls:
        return None, "e3nn SphericalHarmonics without _ls_list (unknown e3nn version)"
    lmax = max(ls)
    if ls != list(range(lmax + 1)):
        return None, f"orders {ls} (only the full range 0..lmax is fused)"
    spec = SHSpec(lmax=lmax, normalization=str(getattr(module, "normalization", "")),
                  normalize=bool(getattr(module, "normalize", True)))
    reason = spec.unsupported_reason()
    return (None, reason) if reason else (spec, None)


def _buffer_float(module: Any, name: str) -> Optional[float]:
    value = getattr(module, name, None)
    if value is None:
        return None
    if hasattr(value, "detach"):
        if value.numel() != 1:
            return None
        return float(value.detach().to("cpu").double().item())
    return float(value)


def radial_spec_from_module(module: Any, atomic_numbers: Optional[Tuple[int, ...]] = None
                            ) -> Tuple[Optional[RadialSpec], Optional[str]]:
    """Freeze a model's ``radial_embedding`` (mace ``RadialEmbeddingBlock``); a distance
    transform needs the model's ``atomic_numbers`` (its elements' covalent radii).

    Returns:
        ``(spec, None)`` if the fused op computes exactly what ``module`` does, else
        ``(None, reason)``: another basis (Gaussian, Chebyshev), another distance transform,
        trainable Bessel frequencies, another cutoff, ...
    """
    if type(module).__name__ != "RadialEmbeddingBlock":
        return None, f"{_qualname(module)} is not mace's RadialEmbeddingBlock"
    transform, reason = transform_from_module(getattr(module, "distance_transform", None),
                                              atomic_numbers)
    if reason is not None:
        return None, reason
    basis = getattr(module, "bessel_fn", None)
    if basis is None or type(basis).__name__ != "BesselBasis":
        name = "none" if basis is None else type(basis).__name__
        return None, f"radial basis {name} (only BesselBasis is fused)"
    weights = getattr(basis, "bessel_weights", None)
    if weights is None or not hasattr(weights, "dim") or weights.dim() != 1:
        return None, "BesselBasis without a 1-D bessel_weights tensor"
    if weights.requires_grad:
        return None, ("trainable Bessel frequencies (bessel_weights requires grad); the fused "
                      "op treats them as constants")
    cutoff = getattr(module, "cutoff_fn", None)
    if cutoff is None or type(cutoff).__name__ != "PolynomialCutoff":
        name = "none" if cutoff is None else type(cutoff).__name__
        return None, f"cutoff {name} (only PolynomialCutoff is fused)"
    prefactor, r_max, p = (_buffer_float(basis, "prefactor"), _buffer_float(cutoff, "r_max"),
                           _buffer_float(cutoff, "p"))
    if prefactor is None or r_max is None or p is None:
        return None, "BesselBasis/PolynomialCutoff without scalar prefactor, r_max or p"
    if p != int(p):
        return None, f"cutoff exponent p = {p} (must be an integer)"
    frequencies = tuple(float(v) for v in weights.detach().to("cpu").double().tolist())
    spec = RadialSpec(num_basis=len(frequencies), frequencies=frequencies, prefactor=prefactor,
                      r_max=r_max, p=int(p),
                      apply_cutoff=bool(getattr(module, "apply_cutoff", True)),
                      transform=transform)
    reason = spec.unsupported_reason()
    return (None, reason) if reason else (spec, None)


def transform_from_module(module: Any, atomic_numbers: Optional[Tuple[int, ...]]
                          ) -> Tuple[Optional[DistanceTransform], Optional[str]]:
    """``(None, None)`` without a transform, ``(transform, None)`` for mace's Agnesi or Soft
    transform with constant (not trainable) parameters, else ``(None, reason)``."""
    if module is None:
        return None, None
    kind = type(module).__name__.replace("Transform", "")
    if kind not in TRANSFORMS:
        return None, f"distance transform {_qualname(module)} (Agnesi and Soft are fused)"
    names = ("q", "p", "a") if kind == "Agnesi" else ("alpha",)
    if any(getattr(getattr(module, n, None), "requires_grad", False) for n in names):
        return None, "a trainable distance transform (its parameters require grad)"
    params = tuple(_buffer_float(module, n) for n in names)
    radii = getattr(module, "covalent_radii", None)
    if any(v is None for v in params) or radii is None or atomic_numbers is None:
        return None, f"a {kind} transform without its constants or the model's elements"
    table = radii.detach().to("cpu").double()
    if any(not 0 <= int(z) < table.numel() for z in atomic_numbers):
        return None, f"an element beyond the {kind} transform's covalent radii"
    return DistanceTransform(kind, params, tuple(float(table[int(z)]) for z in atomic_numbers)
                             ), None
