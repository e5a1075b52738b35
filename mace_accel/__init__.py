"""mace-accel: fused CUDA kernels and model surgery for MACE interatomic potentials.

Public API (imported lazily: ``import mace_accel`` does no work, imports no torch and sets no
global state)::

    report = mace_accel.accelerate(model, backend="cuda")   # in-place surgery, verified
    mace_accel.revert(model)                                  # undo it exactly
    calc = mace_accel.MACEAccelCalculator(model="my.model")   # ASE calculator (device="auto")
    calc = mace_accel.mace_mp("medium")                       # a foundation model behind it
    results = mace_accel.evaluate(frames, "my.model")         # many structures, batched calls
"""

from __future__ import annotations

import importlib
from typing import Any

_API = {
    "accelerate": "mace_accel.surgery",
    "revert": "mace_accel.surgery",
    "is_accelerated": "mace_accel.surgery",
    "PatchReport": "mace_accel.surgery",
    "AccelOptions": "mace_accel.options",
    "MACEAccelCalculator": "mace_accel.calculator",
    "mace_mp": "mace_accel.calculator",
    "mace_off": "mace_accel.calculator",
    "AcceleratedMaceModel": "mace_accel.torchsim",
    "BatchEvaluator": "mace_accel.batched",
    "evaluate": "mace_accel.batched",
    "load_model": "mace_accel.models.checkpoint",
    "default_model_path": "mace_accel.models.checkpoint",
}

__all__ = sorted(_API) + ["__version__"]


# what __version__ reads where the package was never installed (a bare source tree on sys.path):
# a valid PEP 440 version that sorts before every release
UNKNOWN_VERSION = "0+unknown"


def _version() -> str:
    """The installed distribution's version: pyproject.toml is the one place it is written, and
    installing (also ``pip install -e .``) records it in the package metadata."""
    from importlib import metadata

    try:
        return metadata.version("mace-accel")
    except metadata.PackageNotFoundError:
        return UNKNOWN_VERSION


def __getattr__(name: str) -> Any:
    if name == "__version__":  # read on first use: importing mace_accel reads no metadata
        globals()[name] = _version()
        return globals()[name]
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'mace_accel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
