"""Small helpers shared by the CPU tests: torch's default dtype for a block, a model's round trip
through ``torch.save``, the relative error of array results."""

from __future__ import annotations

import contextlib
import io

import torch

from mace_accel.tolerances import rel_norm_error


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Torch's default dtype set to ``dtype`` for the block (mace and e3nn build their constants
    in it, as mace trains), the previous one restored after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def save_and_load(obj):
    """``obj`` through ``torch.save`` and ``torch.load`` in memory, as a model file takes it."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def rel_error(a, b) -> float:
    """:func:`~mace_accel.tolerances.rel_norm_error` of arrays or tensors (ASE's results are
    numpy arrays)."""
    return rel_norm_error(torch.as_tensor(a, dtype=torch.float64),
                          torch.as_tensor(b, dtype=torch.float64))
