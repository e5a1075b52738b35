"""mace-accel: fused CUDA tensor-product kernels and model surgery for MACE potentials.

Public API (imported lazily; importing this package does no work and sets no global state)::

    report = mace_accel.accelerate(model, backend="cuda")   # in-place surgery, verified
    mace_accel.revert(model)                                  # undo it exactly
    calc = mace_accel.MACEAccelCalculator(model="my.model", device="cuda")
    calc = mace_accel.mace_mp("medium", device="cuda")
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"

# In a source checkout run with the repo root on sys.path (``python -m pytest``), ``kernels/``
# and ``patches/`` sit beside this folder rather than inside it (wheels and editable installs map
# them with package-dir). Let this package's own search path see them there; nothing global.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if (os.path.isfile(os.path.join(_ROOT, "pyproject.toml"))
        and os.path.isfile(os.path.join(_ROOT, "patches", "interaction_blocks.py"))
        and _ROOT not in __path__):
    __path__.append(_ROOT)

# ``accelerate`` is both a submodule and its main function: import the function now, so a later
# ``import mace_accel.accelerate`` cannot shadow it with the module (torch is imported; no state).
from .accelerate import PatchReport, accelerate, is_accelerated, revert  # noqa: E402

_API = {
    "MACEAccelCalculator": "mace_accel.calculator",
    "mace_mp": "mace_accel.foundations",
    "mace_off": "mace_accel.foundations",
    "load_model": "mace_accel.checkpoint",
    "default_model_path": "mace_accel.models",
}

__all__ = sorted(_API) + ["PatchReport", "__version__", "accelerate", "is_accelerated",
                          "revert"]


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'mace_accel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
