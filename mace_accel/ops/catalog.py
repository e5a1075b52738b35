"""What the op families' catalogs (``ops/<family>/catalog.py``) share: problems picked by their
tags, repeats dropped, and MACE's irreps of one multiplicity up to an ``lmax``."""

from __future__ import annotations

from typing import Callable, FrozenSet, Hashable, Iterable, List, Protocol, TypeVar


class Tagged(Protocol):
    tags: FrozenSet[str]


P = TypeVar("P", bound=Tagged)


def select_tagged(problems: Iterable[P], tags: Iterable[str]) -> List[P]:
    """The ``problems`` carrying every tag in ``tags`` (all of them when none is given)."""
    wanted = set(tags)
    return [p for p in problems if wanted <= p.tags]


def unique_by(problems: Iterable[P], key: Callable[[P], Hashable]) -> List[P]:
    """``problems`` without repeats of ``key`` (the first of each kept, in order)."""
    seen, out = set(), []
    for p in problems:
        k = key(p)
        if k not in seen:
            seen.add(k)
            out.append(p)
    return out


def irreps(mul: int, lmax: int) -> str:
    """``mul`` channels of every ``l`` up to ``lmax``, parity ``(-1)^l``: ``128x0e+128x1o+...``
    (a MACE model's hidden or interaction irreps)."""
    return "+".join(f"{mul}x{ell}{'e' if ell % 2 == 0 else 'o'}" for ell in range(lmax + 1))
