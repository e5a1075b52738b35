"""mace-accel: fused CUDA tensor-product kernels and model surgery for MACE potentials.

Public API (imported lazily; importing this package does no work and sets no global state)::

    report = mace_accel.accelerate(model, backend="cuda")   # in-place surgery, verified
    mace_accel.revert(model)                                  # undo it exactly
    calc = mace_accel.MACEAccelCalculator(model="my.model", device="cuda")
    calc = mace_accel.mace_mp("medium", device="cuda")
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_API = {
    "accelerate": "mace_accel.accelerate",
    "revert": "mace_accel.accelerate",
    "is_accelerated": "mace_accel.accelerate",
    "PatchReport": "mace_accel.accelerate",
    "MACEAccelCalculator": "mace_accel.calculator",
    "mace_mp": "mace_accel.foundations",
    "mace_off": "mace_accel.foundations",
    "load_model": "mace_accel.checkpoint",
    "default_model_path": "mace_accel.models",
}

__all__ = sorted(_API) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'mace_accel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
