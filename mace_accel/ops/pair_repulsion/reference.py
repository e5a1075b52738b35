"""The ZBL pair repulsion in plain torch: the CPU path, the double backward and the oracle of
the GPU tests. mace's formulas in mace's order (:mod:`.spec`), the elements per atom given.

mace multiplies ``14.3996 * Z_u * Z_v`` with integer atomic numbers, which torch evaluates in
its *default* dtype (float32 unless changed) before the model's dtype takes over:
:func:`coulomb_factors` rounds the same way, so a float64 model gives mace's numbers."""

from __future__ import annotations

from typing import Tuple

import torch

from mace_accel.ops import registry
from mace_accel.ops.pair_repulsion.spec import BOHR, COULOMB, EXPONENTS, ZBLSpec

Tensor = torch.Tensor


def coulomb_factors(spec: ZBLSpec) -> Tensor:
    """``[n, n]`` float64: ``14.3996 Z_a Z_b`` of every pair of the model's elements, rounded
    as mace's forward rounds it (in torch's current default dtype)."""
    z = torch.tensor(spec.numbers, dtype=torch.int64)
    return (COULOMB * z[:, None] * z[None, :]).to(torch.float64)


def edge_energies(spec: ZBLSpec, lengths: Tensor, z_u: Tensor, z_v: Tensor, k: Tensor,
                  r_u: Tensor, r_v: Tensor) -> Tensor:
    """``[E, 1]``: half the ZBL repulsion of each edge (``lengths [E, 1]``; per edge
    ``[E, 1]``: the atomic numbers ``z_u, z_v`` (as reals), the Coulomb factor ``k``
    (:func:`coulomb_factors`) and covalent radii ``r_u, r_v`` of its sender and receiver)."""
    a = spec.a_prefactor * BOHR / (torch.pow(z_u, spec.a_exp) + torch.pow(z_v, spec.a_exp))
    r_over_a = lengths / a
    c = spec.c
    phi = (c[0] * torch.exp(-EXPONENTS[0] * r_over_a) + c[1] * torch.exp(-EXPONENTS[1] * r_over_a)
           + c[2] * torch.exp(-EXPONENTS[2] * r_over_a)
           + c[3] * torch.exp(-EXPONENTS[3] * r_over_a))
    v = k / lengths * phi
    r_max = r_u + r_v
    c1, c2, c3 = spec.envelope_coefficients()
    s = lengths / r_max
    p = spec.p
    envelope = (1.0 - c1 * torch.pow(s, p) + c2 * torch.pow(s, p + 1)
                - c3 * torch.pow(s, p + 2)) * (lengths < r_max)
    return 0.5 * v * envelope


def per_edge_constants(spec: ZBLSpec, elements: Tensor, edge_index: Tensor,
                       like: Tensor) -> Tuple[Tensor, ...]:
    """``(z_u, z_v, k, r_u, r_v)`` ``[E, 1]`` of the edges, in ``like``'s dtype and device."""
    # made once per device (a training step captured as a CUDA graph cannot copy from the host)
    numbers = registry.device_constant(spec.numbers, like.dtype, like.device)
    radii = registry.device_constant(spec.radii, like.dtype, like.device)
    factors = registry.cached(("zbl_coulomb", spec, like.dtype, like.device),
                              lambda: coulomb_factors(spec).to(like.device, like.dtype))
    u, v = elements[edge_index[0]], elements[edge_index[1]]
    return (numbers[u].unsqueeze(-1), numbers[v].unsqueeze(-1), factors[u, v].unsqueeze(-1),
            radii[u].unsqueeze(-1), radii[v].unsqueeze(-1))


def repulsion(spec: ZBLSpec, lengths: Tensor, elements: Tensor, edge_index: Tensor,
              n_nodes: int) -> Tensor:
    """``[N]``: each atom's ZBL repulsion (the edges it receives), differentiable in
    ``lengths [E, 1]``."""
    energies = edge_energies(spec, lengths, *per_edge_constants(spec, elements, edge_index,
                                                                lengths))
    out = lengths.new_zeros((n_nodes, 1))
    return out.index_add(0, edge_index[1], energies).squeeze(-1)
