"""The ZBL kernel's source (``kernels/pair_repulsion/forward.cu.j2``) for one spec and dtype."""

from __future__ import annotations

import math
from typing import Iterator, Tuple

from mace_accel.ops.limits import DeviceLimits
from mace_accel.ops.pair_repulsion.spec import BOHR, EXPONENTS, ZBLSpec
from mace_accel.ops.templates import literal, render

THREADS = 128
# the spec CI compiles: mace's defaults (p = 5 as the foundation models use it)
CATALOG_SPEC = ZBLSpec((0.1818, 0.5099, 0.2802, 0.02817), 0.300, 0.4543, 5, (1, 29), (0.31, 1.32))


def kernel_name(spec: ZBLSpec, dtype: str) -> str:
    return f"mace_zbl_{dtype}_p{spec.p}_{spec.key()}"


def _rounded(value: float, dtype: str) -> float:
    """``value`` rounded to ``dtype``."""
    import numpy as np

    return float(np.float32(value)) if dtype == "float32" else float(value)


def screening_prefactor(spec: ZBLSpec, dtype: str) -> float:
    """``a_prefactor * 0.529`` as mace computes it in the model's dtype (a float32 product of
    float32 operands is exact in float64, then rounded once)."""
    return _rounded(_rounded(spec.a_prefactor, dtype) * _rounded(BOHR, dtype), dtype)


def render_kernel(spec: ZBLSpec, dtype: str) -> str:
    """The forward kernel of ``spec`` in ``dtype`` (``"float32"`` or ``"float64"``)."""
    c1, c2, c3 = spec.envelope_coefficients()
    p = spec.p
    prefactor = screening_prefactor(spec, dtype)
    return render("pair_repulsion/forward.cu.j2", name=kernel_name(spec, dtype), dtype=dtype,
                  real="double" if dtype == "float64" else "float", threads=THREADS, p=p,
                  inv_a_prefactor=literal(1.0 / prefactor),
                  factorials=[math.factorial(n) for n in range(13)],
                  minus_b=[literal(-b) for b in EXPONENTS],
                  c=[literal(v) for v in spec.c],
                  cb=[literal(-v * b) for v, b in zip(spec.c, EXPONENTS)],
                  c1=literal(c1), c2=literal(c2), c3=literal(c3), p_c1=literal(p * c1),
                  p1_c2=literal((p + 1) * c2), p2_c3=literal((p + 2) * c3))


def catalog_sources(limits: DeviceLimits) -> Iterator[Tuple[str, str]]:
    """``(name, source)`` of the catalog spec in both dtypes (the CI compile and the pins)."""
    del limits  # the kernel takes any GPU alike
    for dtype in ("float32", "float64"):
        yield f"pair_repulsion/{kernel_name(CATALOG_SPEC, dtype)}", render_kernel(CATALOG_SPEC,
                                                                                  dtype)
