"""Frozen, hashable description of one mace ``SymmetricContraction`` (the product basis).

For each output irrep ``L`` (``M = 2L+1`` components) with correlation order ``nu_max`` the
contraction is a polynomial of degree ``nu_max`` in each node's and channel's features::

    out[n, c, m] = sum_nu sum_K W_nu[z_n, K, c] * sum_t C_nu[m, t, K] * x[n, c, t_1] ... x[n, c, t_nu]

where ``x[n, c, :]`` are the ``D = sum (2l+1)`` components of channel ``c`` (mace's
``[N, C, D]`` layout after ``reshape_irreps``), ``z_n`` the element of node ``n`` (node_attrs
is one-hot), ``W_nu`` mace's element-indexed weights ``[Z, K_nu, C]`` and ``C_nu`` mace's
``U_matrix_nu`` summed over the orderings of each index tuple (``x_i x_j = x_j x_i``), so ``t``
runs over sorted tuples ``t_1 <= ... <= t_nu`` only. The coefficients are read from the model's
own buffers in float64 (a float32-built model keeps its float32-rounded values).

Output layout is mace's: the outputs concatenated, each ``[N, C * M]`` channel-major (mul_ir).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Dict, List, Tuple

from mace_accel.errors import UnsupportedModelError

Term = Tuple[int, Tuple[int, ...], int, float]  # (m, sorted index tuple, K, coefficient)


@dataclasses.dataclass(frozen=True)
class Polynomial:
    """The degree-``nu`` part of one output: ``sum_K W[z, K, c] sum_t C[m, t, K] x^t``.

    Attributes:
        nu: the degree (correlation order of this part).
        num_params: ``K``, the number of weights per element and channel.
        terms: nonzero ``(m, t, K, C[m, t, K])``, ``t`` sorted, float64 coefficients.
    """

    nu: int
    num_params: int
    terms: Tuple[Term, ...]

    def tuples(self) -> Tuple[Tuple[int, ...], ...]:
        """The distinct monomials ``t`` this part uses, sorted."""
        return tuple(sorted({t for _, t, _, _ in self.terms}))


@dataclasses.dataclass(frozen=True)
class OutputIrrep:
    """One output irrep ``L`` of the contraction and its polynomial parts (highest degree first,
    in the order of mace's weights: ``weights_max`` then ``weights[0], weights[1], ...``)."""

    l: int  # noqa: E741 - e3nn's name
    p: int
    correlation: int
    parts: Tuple[Polynomial, ...]

    @property
    def dim(self) -> int:
        return 2 * self.l + 1


@dataclasses.dataclass(frozen=True)
class SCSpec:
    """A mace ``SymmetricContraction``: input channels and components, outputs, elements.

    Attributes:
        num_features: ``C``, the channels (the multiplicity of every input irrep).
        coupling: ``(l, p)`` of the input irreps, in order; ``D = sum 2l+1`` components.
        num_elements: ``Z``, rows of every weight tensor.
        outputs: the output irreps, in mace's order.
    """

    num_features: int
    coupling: Tuple[Tuple[int, int], ...]
    num_elements: int
    outputs: Tuple[OutputIrrep, ...]

    @property
    def num_components(self) -> int:
        """``D``: components per channel of the input (``x`` is ``[N, C, D]``)."""
        return sum(2 * l + 1 for l, _ in self.coupling)

    @property
    def dim_out(self) -> int:
        return self.num_features * sum(o.dim for o in self.outputs)

    @property
    def weight_shapes(self) -> Tuple[Tuple[int, int, int], ...]:
        """``[Z, K, C]`` of every weight tensor, in the order the ops take them."""
        return tuple((self.num_elements, part.num_params, self.num_features)
                     for o in self.outputs for part in o.parts)

    def describe(self) -> str:
        def irrep(l: int, p: int) -> str:
            return f"{l}{'e' if p == 1 else 'o'}"

        ins = "+".join(irrep(l, p) for l, p in self.coupling)
        outs = "+".join(f"{irrep(o.l, o.p)}(nu<={o.correlation})" for o in self.outputs)
        terms = sum(len(part.terms) for o in self.outputs for part in o.parts)
        return (f"SCSpec({self.num_features}x({ins}) -> {outs}, {self.num_elements} elements, "
                f"{terms} terms)")

    def key(self) -> str:
        """Stable hex digest of the spec (kernel names and cache keys)."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]


def _contraction_parts(contraction: Any, num_components: int) -> Tuple[Tuple[Polynomial, ...],
                                                                       int]:
    """The polynomial parts of one mace ``Contraction`` (one output irrep) and its ``M``."""
    import torch

    correlation = int(contraction.correlation)
    buffers = dict(contraction.named_buffers())
    parts: List[Polynomial] = []
    m_dim = None
    for nu in range(correlation, 0, -1):  # weights_max first, then weights[0], [1], ...
        u = buffers[f"U_matrix_{nu}"].detach().to("cpu", torch.float64)
        has_m = u.dim() == nu + 2  # L = 0 outputs come without the m axis
        if not has_m:
            u = u.unsqueeze(0)
        if u.shape[1:-1] != (num_components,) * nu:
            raise UnsupportedModelError(
                f"U_matrix_{nu} has shape {tuple(u.shape)}, expected [M, {num_components} x "
                f"{nu}, K]")
        m_dim = u.shape[0] if m_dim is None else m_dim
        coef: Dict[Tuple[int, Tuple[int, ...], int], float] = {}
        nonzero = (u != 0).nonzero().tolist()
        values = u[u != 0].tolist()
        for index, value in zip(nonzero, values):
            m, idx, k = index[0], tuple(sorted(index[1:-1])), index[-1]
            coef[(m, idx, k)] = coef.get((m, idx, k), 0.0) + value
        terms = tuple((m, idx, k, v) for (m, idx, k), v in sorted(coef.items()) if v != 0.0)
        parts.append(Polynomial(nu=nu, num_params=int(u.shape[-1]), terms=terms))
    return tuple(parts), int(m_dim)


def spec_from_mace(module: Any) -> SCSpec:
    """Freeze a mace ``SymmetricContraction`` into an :class:`SCSpec`.

    Raises:
        UnsupportedModelError: not a mace SymmetricContraction with internal element-indexed
            weights, or input irreps of different multiplicities.
    """
    for attr in ("irreps_in", "irreps_out", "contractions"):
        if not hasattr(module, attr):
            raise UnsupportedModelError(
                f"expected mace's SymmetricContraction, got {type(module).__name__} (no {attr!r})")
    muls = {int(mul) for mul, _ in module.irreps_in}
    if len(muls) != 1:
        raise UnsupportedModelError(
            f"symmetric contraction input {module.irreps_in} mixes multiplicities; mace's layout "
            "[N, C, D] needs one")
    coupling = tuple((int(ir.l), int(ir.p)) for _, ir in module.irreps_in)
    num_components = sum(2 * l + 1 for l, _ in coupling)
    outputs, num_elements, channels = [], None, muls.pop()
    irreps_out = [ir for _, ir in module.irreps_out]
    if len(irreps_out) != len(module.contractions):
        raise UnsupportedModelError("one contraction per output irrep expected")
    for ir, contraction in zip(irreps_out, module.contractions):
        weights = [contraction.weights_max, *contraction.weights]
        parts, m_dim = _contraction_parts(contraction, num_components)
        if m_dim != 2 * int(ir.l) + 1:
            raise UnsupportedModelError(f"output {ir}: U matrices have M={m_dim}")
        for part, w in zip(parts, weights):
            z, k, c = (int(s) for s in w.shape)
            if k != part.num_params or c != channels:
                raise UnsupportedModelError(
                    f"output {ir}, correlation {part.nu}: weights {tuple(w.shape)} do not match "
                    f"[Z, {part.num_params}, {channels}]")
            num_elements = z if num_elements is None else num_elements
            if z != num_elements:
                raise UnsupportedModelError("weights of one contraction with different Z")
        outputs.append(OutputIrrep(l=int(ir.l), p=int(ir.p),
                                   correlation=int(contraction.correlation), parts=parts))
    return SCSpec(num_features=channels, coupling=coupling, num_elements=int(num_elements),
                  outputs=tuple(outputs))


def make_mace_contraction(irreps_in: str, irreps_out: str, correlation: int,
                          num_elements: int, use_reduced_cg: bool = True) -> Any:
    """mace's ``SymmetricContraction`` as ``EquivariantProductBasisBlock`` builds it (tests,
    catalog, benchmarks), in torch's current default dtype."""
    from mace_accel._e3nn_compat import import_mace, o3

    import_mace()
    from mace.modules.symmetric_contraction import SymmetricContraction

    return SymmetricContraction(o3().Irreps(irreps_in), o3().Irreps(irreps_out),
                                correlation=correlation, num_elements=num_elements,
                                use_reduced_cg=use_reduced_cg)
