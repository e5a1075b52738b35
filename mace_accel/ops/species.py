"""The elements of a call's atoms and edges, and the pairs of elements radial tables cover.

mace reads an atom's element off its one-hot ``node_attrs`` (``argmax``, an index into the
model's ``atomic_numbers``); where an edge's radial weights depend on its two elements (a
distance transform scaled by their covalent radii, the non-linear blocks' element embeddings),
one radial table is kept per pair of elements, and each edge names its table by a slot
(:class:`PairSet`). Padding atoms of a CUDA graph have all-zero attributes: mace's ``argmax``
gives them element 0, and their edges, longer than the cutoff, read table 0 (exactly zero
there).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch

Tensor = torch.Tensor
ORDERED, UNORDERED = "ordered", "unordered"


def node_elements(node_attrs: Tensor) -> Tensor:
    """``[N]`` int64: each atom's element index (mace's ``argmax`` of ``node_attrs [N, n]``)."""
    return node_attrs.detach().argmax(dim=1)


def elements_present(node_attrs: Tensor) -> Tuple[int, ...]:
    """The element indices with an atom in ``node_attrs [N, n]`` (waits for the device)."""
    present = node_attrs.detach().ne(0).any(dim=0)
    return tuple(int(i) for i in torch.nonzero(present).flatten().tolist())


@dataclasses.dataclass(frozen=True)
class PairSet:
    """The pairs of a set of elements that have a table each.

    Attributes:
        kind: ``"ordered"`` (sender, receiver) pairs, or ``"unordered"`` (the weights are
            symmetric in the two elements: one table for both orders).
        elements: the model's element indices covered, ascending.
        n_elements: the model's number of elements.
    """

    kind: str
    elements: Tuple[int, ...]
    n_elements: int

    def __post_init__(self) -> None:
        if self.kind not in (ORDERED, UNORDERED):
            raise ValueError(f"pair kind must be {ORDERED!r} or {UNORDERED!r}, got {self.kind!r}")

    def pairs(self) -> List[Tuple[int, int]]:
        """``(a, b)`` of each table, in slot order."""
        els = self.elements
        if self.kind == ORDERED:
            return [(a, b) for a in els for b in els]
        return [(a, b) for i, a in enumerate(els) for b in els[i:]]

    @property
    def count(self) -> int:
        """The number of tables."""
        s = len(self.elements)
        return s * s if self.kind == ORDERED else s * (s + 1) // 2

    def slot_map(self) -> List[int]:
        """``[n_elements * n_elements]``: the slot of the pair ``(a, b)`` at ``a * n + b``
        (0 for elements not covered: padding atoms only, see the module docstring)."""
        n = self.n_elements
        out = [0] * (n * n)
        for slot, (a, b) in enumerate(self.pairs()):
            out[a * n + b] = slot
            if self.kind == UNORDERED:
                out[b * n + a] = slot
        return out

    def describe(self, symbols: Optional[List[str]] = None) -> str:
        names = [symbols[i] if symbols else str(i) for i in self.elements]
        return f"{self.count} {self.kind} pairs of {'/'.join(names)}"


def edge_slots(elements: Tensor, edge_index: Tensor, slot_map: Tensor,
               n_elements: int) -> Tensor:
    """``[E]`` int32: each edge's table, ``slot_map [n * n]`` (int32, on the device) at its
    (sender, receiver) elements, from the atoms' ``elements [N]``."""
    pair = elements[edge_index[0]] * n_elements + elements[edge_index[1]]
    return slot_map[pair]
