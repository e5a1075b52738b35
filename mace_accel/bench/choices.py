"""The names the ``bench`` options choose from.

Torch-free on purpose: the CLI builds its parser from these without importing torch (or the
modules that need it), so ``mace-accel --help`` does not pay for the benchmark's imports.
"""

from __future__ import annotations

BACKENDS = ("e3nn", "cueq", "oeq", "mace-accel")
DTYPES = ("float32", "float64")
SYSTEM_KINDS = ("auto", "fcc", "molecular")
