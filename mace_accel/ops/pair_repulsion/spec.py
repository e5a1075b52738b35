"""The frozen description of a model's ZBL pair repulsion (mace's ``ZBLBasis``).

Per edge from element ``u`` to ``v`` (atomic numbers ``Z_u``, ``Z_v``, covalent radii ``R``)::

    a    = a_prefactor * 0.529 / (Z_u^a_exp + Z_v^a_exp)
    phi  = sum_k c_k exp(-b_k r / a),  b = (3.2, 0.9423, 0.4028, 0.2016)
    V    = 14.3996 Z_u Z_v / r * phi
    e(r) = 0.5 V envelope_p(r / (R_u + R_v)) * (r < R_u + R_v)

and an atom's repulsion is the sum of ``e`` over the edges it receives. The constants are the
module's buffers (float64 values), per element of the model (in ``atomic_numbers`` order).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Optional, Tuple

EXPONENTS = (3.2, 0.9423, 0.4028, 0.2016)  # mace's b_k, written in its forward
BOHR = 0.529
COULOMB = 14.3996


@dataclasses.dataclass(frozen=True)
class ZBLSpec:
    """mace's ZBL pair repulsion for a model's elements.

    Attributes:
        c: the four screening weights (the module's ``c`` buffer).
        a_exp, a_prefactor: the screening length's constants.
        p: the envelope's exponent.
        numbers: each element's atomic number ``Z`` (the model's ``atomic_numbers``).
        radii: each element's covalent radius (the module's ``covalent_radii`` at ``Z``).
    """

    c: Tuple[float, float, float, float]
    a_exp: float
    a_prefactor: float
    p: int
    numbers: Tuple[int, ...]
    radii: Tuple[float, ...]

    def key(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    def envelope_coefficients(self) -> Tuple[float, float, float]:
        p = self.p
        return ((p + 1.0) * (p + 2.0) / 2.0, p * (p + 2.0), p * (p + 1.0) / 2.0)

    def describe(self) -> str:
        return f"ZBL(p={self.p}, {len(self.numbers)} elements)"


def _scalar(module: Any, name: str) -> Optional[float]:
    value = getattr(module, name, None)
    if value is None or not hasattr(value, "numel") or value.numel() != 1:
        return None
    return float(value.detach().to("cpu").double().item())


def zbl_spec_from_module(module: Any, numbers: Optional[Tuple[int, ...]]
                         ) -> Tuple[Optional[ZBLSpec], Optional[str]]:
    """``(spec, None)`` for mace's ``ZBLBasis`` with constant parameters and the model's
    elements ``numbers``, else ``(None, reason)``."""
    cls = type(module)
    if cls.__name__ != "ZBLBasis" or not cls.__module__.startswith("mace."):
        return None, f"{cls.__module__}.{cls.__name__} is not mace's ZBLBasis"
    if any(getattr(getattr(module, n, None), "requires_grad", False)
           for n in ("a_exp", "a_prefactor")):
        return None, "a trainable ZBL (a_exp / a_prefactor require grad)"
    c, radii = getattr(module, "c", None), getattr(module, "covalent_radii", None)
    a_exp, a_prefactor, p = (_scalar(module, n) for n in ("a_exp", "a_prefactor", "p"))
    if c is None or c.numel() != 4 or radii is None or None in (a_exp, a_prefactor, p) \
            or numbers is None:
        return None, "a ZBLBasis without its constants, or a model without atomic_numbers"
    table = radii.detach().to("cpu").double()
    if any(not 0 <= int(z) < table.numel() for z in numbers):
        return None, "an element beyond the ZBL's covalent radii"
    return ZBLSpec(tuple(float(v) for v in c.detach().to("cpu").double().tolist()), a_exp,
                   a_prefactor, int(p), tuple(int(z) for z in numbers),
                   tuple(float(table[int(z)]) for z in numbers)), None
