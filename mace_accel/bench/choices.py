"""The names the ``bench`` options choose from.

Torch-free on purpose: the CLI builds its parser from these without importing torch (or the
modules that need it), so ``mace-accel --help`` does not pay for the benchmark's imports.
"""

from __future__ import annotations

from mace_accel.options import DTYPE_NAMES

BACKENDS = ("e3nn", "cueq", "oeq", "mace-accel")
DTYPES = DTYPE_NAMES
SYSTEM_KINDS = ("auto", "fcc", "molecular")
# what ``mace_mp()`` gives today (MACE-MPA-0 medium's architecture): the default model
DEFAULT_MODEL = "mpa0-medium"
