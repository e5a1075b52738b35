"""The walk of a lookup: the edges sorted by length, to steps of ``r_max / ORDER_KEY_MAX``.

The order only sets the lookups' speed (their results do not depend on it), so the sort takes
15-bit integer keys of the length: two radix passes (less than half the time of sorting the
float64 lengths themselves), steps of 0.2 mÅ for a 6 Å cutoff (a table's finest cell, 8192 over the
cutoff, spans four)."""

from __future__ import annotations

from typing import Optional

import torch

ORDER_KEY_MAX = 32767


def length_order(lengths: torch.Tensor, r_max: float,
                 slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[E]`` int64: a permutation putting ``lengths [E]`` in increasing order to steps of
    ``r_max / ORDER_KEY_MAX`` (lengths past ``r_max`` last, within a step any order); with
    ``slots [E]`` (each edge's table), by table first (32-bit keys)."""
    keys = (lengths.detach() * (ORDER_KEY_MAX / float(r_max))).clamp_(0, ORDER_KEY_MAX)
    if slots is None:
        return torch.argsort(keys.to(torch.int16))
    return torch.argsort(keys.to(torch.int32) + slots * (ORDER_KEY_MAX + 1))
