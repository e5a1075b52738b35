"""The one catalog of convolution problems: MACE foundation models' layers and edge cases, tagged.

Each entry is ``(irreps_in1, irreps_in2, irreps_target)`` as MACE's interaction blocks build
their ``conv_tp`` (outputs filtered by the target irreps). Tags say what an entry is for:

* ``model``: a layer of a released architecture (MACE-MP-0, MACE-OFF23); ``bench`` marks the
  ones the kernel benchmark uses;
* ``edge``: an edge case (odd multiplicities, mixed parity, L=3 node features, ...);
* ``cpu``: small enough for the reference backend in the CPU tests (dozens of channels at most).

Every distinct problem is rendered and compiled with nvcc in CI, and its rendered source pinned
by hash (``tests/test_codegen_pinned.py``).

Used by the CPU tests, the nvcc compile test, the GPU tests and the benchmarks.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, List, Tuple

from mace_accel.ops.catalog import irreps, select_tagged, unique_by

SH3 = "1x0e+1x1o+1x2e+1x3o"
SH2 = "1x0e+1x1o+1x2e"


@dataclasses.dataclass(frozen=True)
class ConvProblem:
    """One conv tensor product: node-feature, edge-attribute and target irreps, and its tags."""

    name: str
    irreps_in1: str
    irreps_in2: str
    irreps_target: str
    tags: FrozenSet[str]

    @property
    def irreps(self) -> Tuple[str, str, str]:
        return (self.irreps_in1, self.irreps_in2, self.irreps_target)


def _p(name: str, in1: str, in2: str, target: str, *tags: str) -> ConvProblem:
    return ConvProblem(name, in1, in2, target, frozenset(tags))


_PROBLEMS = (
    # MACE-MP-0 (max_ell 3); layer 1 sees the scalar node embedding, layer 2 the hidden irreps
    _p("mp-small-l1", "128x0e", SH3, irreps(128, 3), "model"),
    _p("mp-small-l2", "128x0e", SH3, irreps(128, 3), "model"),
    _p("mp-medium-l1", "128x0e", SH3, irreps(128, 3), "model"),
    _p("mp-medium-l2", "128x0e+128x1o", SH3, irreps(128, 3), "model", "bench"),
    _p("mp-large-l1", "128x0e", SH3, irreps(128, 3), "model"),
    _p("mp-large-l2", "128x0e+128x1o+128x2e", SH3, irreps(128, 3), "model"),
    _p("off-medium-l2", "128x0e+128x1o", SH3, irreps(128, 3), "model"),
    _p("off-large-l2", "192x0e+192x1o+192x2e", SH3, irreps(192, 3), "model"),
    _p("ch64-l2", "64x0e+64x1o", SH3, irreps(64, 3), "edge"),
    _p("ch32-l2", "32x0e+32x1o+32x2e", SH3, irreps(32, 3), "edge"),
    _p("odd-mul", "17x0e+5x1o+3x2e", SH3, irreps(1, 3), "edge"),
    _p("l3-feats", "16x0e+16x1o+16x2e+16x3o", SH3, irreps(16, 3), "edge"),
    _p("mixed-parity", "8x0e+8x0o+8x1o+8x1e", SH2, "1x0e+1x0o+1x1o+1x1e+1x2e+1x2o", "edge"),
    # small problems for the CPU reference tests (and compiled in CI like the rest)
    _p("small-mace-l2", "7x0e+3x1o+2x2e", SH2, "7x0e+7x1o+7x2e", "cpu"),
    _p("small-mixed-parity-l3", "3x0e+2x1e+2x1o", SH3, "3x0e+3x0o+3x1o+3x1e+3x3o", "cpu"),
    _p("small-odd-mul-l3-edges", "17x0e+5x1o+3x2e", SH3, "17x0e+17x1o+17x2e+17x3o", "cpu"),
    _p("small-mixed-parity", "4x0e+3x0o+2x1e+2x1o", SH2, "4x0e+4x0o+4x1o+4x1e+4x2e+4x2o", "cpu"),
    _p("small-l3-node-feats", "3x0e+2x1o+2x3o", SH3, "3x0e+3x1o+3x2e+3x3o+3x3e", "cpu"),
    _p("small-scalar-first-layer", "8x0e", SH2, "8x0e+8x1o+8x2e", "cpu"),
    _p("tiny-gradcheck", "2x0e+1x1o", "1x0e+1x1o", "2x0e+2x1o", "cpu"),
)

CATALOG: Dict[str, ConvProblem] = {p.name: p for p in _PROBLEMS}


def select(*tags: str) -> List[ConvProblem]:
    """The problems carrying every tag in ``tags`` (all of them when none is given)."""
    return select_tagged(_PROBLEMS, tags)


def unique(problems: List[ConvProblem]) -> List[ConvProblem]:
    """``problems`` without repeated irreps (mp-small-l1 == mp-medium-l1 == ... compile once)."""
    return unique_by(problems, lambda p: p.irreps)
