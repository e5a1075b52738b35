"""The walk of a lookup: the edges sorted by table and by length, to steps of a fraction of
``r_max``.

The order only sets the lookups' speed (their results do not depend on it), so the sort takes
15-bit integer keys: two radix passes (less than half the time of sorting the float64 lengths
themselves, and half of 32-bit keys' four). Without tables the 15 bits are the length's, steps of
0.2 mÅ for a 6 Å cutoff (a table's finest cell, 8192 over the cutoff, spans four); with ``t``
tables the slot takes the high ``ceil(log2 t)`` bits and the length the rest (15 pair tables: 11
bits, steps of 2.9 mÅ, four finest cells, whose coefficient rows lie together in memory). More
than 128 tables take 32-bit keys, the length 15 bits of them."""

from __future__ import annotations

from typing import Optional

import torch

KEY_BITS = 15  # an int16 key stays non-negative
ORDER_KEY_MAX = (1 << KEY_BITS) - 1
MAX_SHORT_KEY_TABLES = 1 << 7  # the slot's bits leave at least 8 of the length's


def slot_bits(tables: int) -> int:
    """The bits of a key that hold the table slot of ``tables`` tables."""
    return max(0, (int(tables) - 1).bit_length())


def length_steps(tables: int = 1) -> int:
    """The number of steps of ``r_max`` the keys of ``tables`` tables tell apart."""
    if tables > MAX_SHORT_KEY_TABLES:
        return ORDER_KEY_MAX
    return (1 << (KEY_BITS - slot_bits(tables))) - 1


def length_order(lengths: torch.Tensor, r_max: float, slots: Optional[torch.Tensor] = None,
                 tables: Optional[int] = None) -> torch.Tensor:
    """``[E]`` int64: a permutation putting ``lengths [E]`` in increasing order to steps of
    ``r_max / length_steps(tables)`` (lengths past ``r_max`` last, within a step any order);
    with ``slots [E]`` (each edge's table, ``0 <= slots < tables``: both or neither), by table
    first."""
    if (slots is None) != (tables is None):
        raise ValueError("length_order takes the edges' table slots and the number of tables "
                         "together")
    tables = 1 if tables is None else int(tables)
    steps = length_steps(tables)
    keys = (lengths.detach() * (steps / float(r_max))).clamp_(0, steps)
    if slots is None:
        return torch.argsort(keys.to(torch.int16))
    if tables > MAX_SHORT_KEY_TABLES:
        return torch.argsort(keys.to(torch.int32) + slots * (ORDER_KEY_MAX + 1))
    shift = KEY_BITS - slot_bits(tables)
    return torch.argsort(keys.to(torch.int16) + (slots.to(torch.int16) << shift))
