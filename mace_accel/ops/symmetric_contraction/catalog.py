"""The catalog of symmetric-contraction problems: MACE foundation models' product blocks and
edge cases, tagged like :mod:`mace_accel.ops.conv_tp.catalog`.

Each entry is ``(irreps_in, irreps_out, correlation, num_elements)`` as
``EquivariantProductBasisBlock`` builds its ``SymmetricContraction`` (input: the interaction's
target irreps, one multiplicity; output: the hidden irreps, or their scalars in the last layer).
Tags: ``model`` (a released architecture; ``bench`` for the benchmark), ``edge`` (correlation
1/2, L=3 outputs, odd channels, one element), ``cpu`` (small enough for the CPU tests),
``nvcc`` (compiled by CI's nvcc test, spill-free). Not tagged ``nvcc``: the problems with
L=2 outputs (MP-large, OFF-large) and MACE-MH-1's (512 threads a block leave 128 registers a
thread), whose float64 kernels still spill registers (up to 8 KB per thread); they compile with
NVRTC and are checked on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import FrozenSet, List, Tuple

from mace_accel.ops.catalog import irreps, select_tagged
from mace_accel.ops.symmetric_contraction.spec import SCSpec


@dataclasses.dataclass(frozen=True)
class SCProblem:
    name: str
    irreps_in: str
    irreps_out: str
    correlation: int
    num_elements: int
    tags: FrozenSet[str]

    @property
    def args(self) -> Tuple[str, str, int, int]:
        return (self.irreps_in, self.irreps_out, self.correlation, self.num_elements)


def _p(name, irreps_in, irreps_out, correlation, num_elements, *tags) -> SCProblem:
    return SCProblem(name, irreps_in, irreps_out, correlation, num_elements, frozenset(tags))


_PROBLEMS = (
    # MACE-MP-0: 89 elements, correlation 3, interaction irreps 128x(0e+1o+2e+3o)
    _p("mp-medium-p1", irreps(128, 3), "128x0e+128x1o", 3, 89, "model", "bench", "nvcc"),
    _p("mp-medium-p2", irreps(128, 3), "128x0e", 3, 89, "model", "nvcc"),
    _p("mp-large-p1", irreps(128, 3), "128x0e+128x1o+128x2e", 3, 89, "model"),
    # MACE-MH-1: 512 channels, one weight set (the agnostic product)
    _p("mh1-p1", irreps(512, 3), "512x0e+512x1o", 3, 1, "model"),
    _p("mh1-p2", irreps(512, 3), "512x0e", 3, 1, "model"),
    # MACE-OFF23 large: 10 elements, 192 channels
    _p("off-large-p1", irreps(192, 3), "192x0e+192x1o+192x2e", 3, 10, "model"),
    # edge cases
    _p("l3-hidden-corr2", irreps(16, 3), irreps(16, 3), 2, 3, "edge", "nvcc"),
    _p("corr1-agnostic", irreps(32, 2), "32x0e+32x1o", 1, 1, "edge", "nvcc"),
    _p("odd-channels", irreps(17, 3), "17x0e+17x1o", 3, 5, "edge", "nvcc"),
    _p("lmax1-corr3", irreps(24, 1), "24x0e+24x1o", 3, 2, "edge", "nvcc"),
    # small problems for the CPU tests (compiled and pinned like the rest)
    _p("small-l2-corr3", irreps(4, 2), "4x0e+4x1o", 3, 3, "cpu", "nvcc"),
    _p("small-l3-corr2", irreps(3, 3), "3x0e+3x1o+3x2e+3x3o", 2, 4, "cpu", "nvcc"),
    _p("small-corr1", irreps(5, 1), "5x0e+5x1o", 1, 2, "cpu", "nvcc"),
    _p("small-scalar-out", irreps(6, 3), "6x0e", 3, 89, "cpu", "nvcc"),
)

CATALOG = {p.name: p for p in _PROBLEMS}


def select(*tags: str) -> List[SCProblem]:
    """The problems carrying every tag in ``tags`` (all of them when none is given)."""
    return select_tagged(_PROBLEMS, tags)


@functools.lru_cache(maxsize=None)
def build(name: str, dtype_name: str = "float64"):
    """``(mace SymmetricContraction, SCSpec)`` of a catalog problem, built in ``dtype_name``
    (torch's default dtype is restored afterwards) with random (normal) weights."""
    import torch

    from mace_accel.ops.symmetric_contraction.spec import make_mace_contraction, spec_from_mace

    problem = CATALOG[name]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype_name))
    try:
        module = make_mace_contraction(*problem.args)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator().manual_seed(len(name))
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return module, spec_from_mace(module)


def catalog_specs(*tags: str) -> List[Tuple[str, SCSpec]]:
    """``(name, spec)`` of every problem carrying all ``tags`` (specs of a float64 build)."""
    return [(p.name, build(p.name)[1]) for p in select(*tags)]
