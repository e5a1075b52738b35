"""Catalog of real convolution problems (MACE foundation models and edge cases).

Each entry is ``(irreps_in1, irreps_in2, irreps_target)`` as MACE's interaction blocks build
their ``conv_tp`` (outputs filtered by the target irreps). Used by the kernel compile test in
CI, the GPU tests and the kernel benchmark.
"""

from __future__ import annotations

from typing import Dict, Tuple

SH3 = "1x0e+1x1o+1x2e+1x3o"
SH2 = "1x0e+1x1o+1x2e"


def _target(mul: int, lmax: int = 3) -> str:
    return "+".join(f"{mul}x{l}{'e' if l % 2 == 0 else 'o'}" for l in range(lmax + 1))


CATALOG: Dict[str, Tuple[str, str, str]] = {
    # MACE-MP-0 (max_ell 3); layer 1 sees the scalar node embedding, layer 2 the hidden irreps
    "mp-small-l1": ("128x0e", SH3, _target(128)),
    "mp-small-l2": ("128x0e", SH3, _target(128)),
    "mp-medium-l1": ("128x0e", SH3, _target(128)),
    "mp-medium-l2": ("128x0e+128x1o", SH3, _target(128)),
    "mp-large-l1": ("128x0e", SH3, _target(128)),
    "mp-large-l2": ("128x0e+128x1o+128x2e", SH3, _target(128)),
    "off-medium-l2": ("128x0e+128x1o", SH3, _target(128)),
    "off-large-l2": ("192x0e+192x1o+192x2e", SH3, _target(192)),
    "ch64-l2": ("64x0e+64x1o", SH3, _target(64)),
    "ch32-l2": ("32x0e+32x1o+32x2e", SH3, _target(32)),
    "odd-mul": ("17x0e+5x1o+3x2e", SH3, _target(1)),
    "l3-feats": ("16x0e+16x1o+16x2e+16x3o", SH3, _target(16)),
    "mixed-parity": ("8x0e+8x0o+8x1o+8x1e", SH2, "1x0e+1x0o+1x1o+1x1e+1x2e+1x2o"),
}

# duplicates by irreps (mp-small-l1 == mp-medium-l1 == ...) compile once
UNIQUE = {name: problem for name, problem in CATALOG.items()
          if list(CATALOG.values()).index(problem) == list(CATALOG).index(name)}
