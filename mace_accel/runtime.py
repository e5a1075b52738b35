"""Run-time side of the CUDA backend: lazy cupy import, NVRTC compile cache, kernel launch."""

from __future__ import annotations

import functools
from typing import Optional


@functools.lru_cache(maxsize=None)
def cupy_unavailable_reason() -> Optional[str]:
    """Why cupy (our NVRTC front end) cannot be used, or None. Imports cupy lazily."""
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA library mismatch raised at import
        return (f"cupy could not be imported ({type(exc).__name__}: {exc}); install the extra "
                "matching your CUDA: pip install 'mace-accel[cuda12]' or 'mace-accel[cuda13]'")
    return None
