"""What changed in an ``ase.Atoms`` since the last calculation, as ASE decides it, faster.

ASE's ``Calculator.check_state`` runs ``compare_atoms``, which tests every property with
``np.allclose(a, b, rtol=0, atol=tol)``. An MD step asks three times (the step's two
``get_forces`` and the integrator's refresh), twice about an unchanged structure; at a few hundred
atoms the ``allclose`` temporaries cost more host time than the model's whole CUDA graph launch.

:func:`changed_properties` gives the same answer as ``ase.calculators.calculator.compare_atoms``
(same properties, same order, same tolerance) but tests each property for exact equality first,
which is a single cheap comparison, and only falls back to ASE's tolerance test when it fails.
"""

from __future__ import annotations

from typing import Iterable, List, Optional

import numpy as np
from ase.calculators.calculator import all_changes, equal


def _same(a, b, tol: float) -> bool:
    """ASE's ``equal(a, b, atol=tol)``, with an exact-equality shortcut (exactly equal arrays
    are within any tolerance; NaNs are never equal, so they take ASE's own test)."""
    if np.shape(a) == np.shape(b) and np.array_equal(a, b):
        return True
    return equal(a, b, atol=tol)


def changed_properties(before, after, tol: float = 1e-15,
                       excluded: Optional[Iterable[str]] = None) -> List[str]:
    """The system changes between ``before`` (the atoms of the last calculation, or None) and
    ``after``, exactly as ASE's ``compare_atoms(before, after, tol, excluded)`` lists them."""
    if before is None:
        return all_changes[:]
    to_check = set(all_changes)
    if excluded:
        to_check -= set(excluded)
    changes: List[str] = []
    for prop in ("cell", "pbc"):
        if prop in to_check:
            to_check.remove(prop)
            a, b = getattr(before, prop), getattr(after, prop)
            if prop == "cell":
                a, b = a.array, b.array
            if not _same(a, b, tol):
                changes.append(prop)
    arrays1, arrays2 = set(before.arrays), set(after.arrays)
    changes += to_check & (arrays1 ^ arrays2)
    for prop in to_check & arrays1 & arrays2:
        if not _same(before.arrays[prop], after.arrays[prop], tol):
            changes.append(prop)
    return changes
