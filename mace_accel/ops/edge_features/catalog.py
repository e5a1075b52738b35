"""The one catalog of edge-feature problems: released models' settings and edge cases, tagged.

Each entry pairs a spherical-harmonics problem (``lmax``, normalisation, normalize) with a
radial one (``r_max``, Bessel functions, cutoff exponent ``p``, ``apply_cutoff``), as a MACE
model builds its ``spherical_harmonics`` and ``radial_embedding``. Tags:

* ``model``: the setting of a released model (MACE-MP-0: r_max 6, MACE-OFF23: r_max 5; both
  lmax 3, 10 Bessel functions, p 5);
* ``edge``: an edge case (other lmax, normalisations, 8 Bessel functions, apply_cutoff False,
  the Soft distance transform; MACE-MPA-0's Agnesi transform is a ``model`` setting);
* ``cpu``: small enough for the CPU tests (all of them are: one thread per edge).

Every distinct spec is rendered and compiled with nvcc in CI, and its source pinned by hash.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, List, Optional

from mace_accel.ops.catalog import select_tagged, unique_by
from mace_accel.ops.edge_features.spec import (DistanceTransform, RadialSpec, SHSpec,
                                                make_radial_spec)


@dataclasses.dataclass(frozen=True)
class EdgeProblem:
    """The edge features of one model: its spherical harmonics and its radial embedding."""

    name: str
    lmax: int
    r_max: float
    num_basis: int
    p: int
    tags: FrozenSet[str]
    normalization: str = "component"
    normalize: bool = True
    apply_cutoff: bool = True
    transform: Optional[str] = None  # "Agnesi" or "Soft", with mace's default constants

    def sh_spec(self) -> SHSpec:
        return SHSpec(self.lmax, self.normalization, self.normalize)

    def radial_spec(self) -> RadialSpec:
        spec = make_radial_spec(self.r_max, self.num_basis, self.p, self.apply_cutoff)
        if self.transform is None:
            return spec
        params = (0.9183, 4.5791, 1.0805) if self.transform == "Agnesi" else (4.0,)
        # hydrogen and copper's covalent radii (ase.data), as a two-element model reads them
        return dataclasses.replace(spec, transform=DistanceTransform(self.transform, params,
                                                                     (0.31, 1.32)))


def _p(name: str, lmax: int, r_max: float, num_basis: int, p: int, *tags: str,
       **kw) -> EdgeProblem:
    return EdgeProblem(name, lmax, r_max, num_basis, p, frozenset(tags), **kw)


_PROBLEMS = (
    _p("mp", 3, 6.0, 10, 5, "model", "cpu", "bench"),
    _p("off", 3, 5.0, 10, 5, "model", "cpu"),
    _p("lmax0", 0, 5.0, 8, 6, "edge", "cpu"),
    _p("lmax1", 1, 5.0, 8, 6, "edge", "cpu"),
    _p("lmax2-small", 2, 4.0, 8, 6, "edge", "cpu"),       # the bundled model / small_test_model
    _p("lmax4", 4, 5.0, 8, 5, "edge", "cpu"),
    _p("no-cutoff", 3, 5.0, 8, 5, "edge", "cpu", apply_cutoff=False),
    _p("agnesi", 3, 6.0, 10, 5, "model", "cpu", transform="Agnesi"),  # MACE-MPA-0's embedding
    _p("soft", 3, 5.0, 8, 5, "edge", "cpu", apply_cutoff=False, transform="Soft"),
    _p("integral", 2, 4.5, 8, 6, "edge", "cpu", normalization="integral"),
    _p("norm-unnormalized", 3, 4.5, 8, 6, "edge", "cpu", normalization="norm",
       normalize=False),
)

CATALOG: Dict[str, EdgeProblem] = {p.name: p for p in _PROBLEMS}


def select(*tags: str) -> List[EdgeProblem]:
    """The problems carrying every tag in ``tags`` (all of them when none is given)."""
    return select_tagged(_PROBLEMS, tags)


def unique_sh(problems: List[EdgeProblem]) -> List[EdgeProblem]:
    """``problems`` without repeated spherical-harmonics specs (first of each kept)."""
    return unique_by(problems, EdgeProblem.sh_spec)


def unique_radial(problems: List[EdgeProblem]) -> List[EdgeProblem]:
    """``problems`` without repeated radial specs (first of each kept)."""
    return unique_by(problems, EdgeProblem.radial_spec)
