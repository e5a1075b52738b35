"""Process-wide table of the problems the custom ops solve, keyed by a short string.

``torch.library`` ops take tensors and plain values only, so a fused module registers its frozen
spec here and passes the key; the op looks the spec up (and caches its compiled kernels per
dtype, device and options). Specs are immutable and keyed by their content hash, so registering
the same spec twice (another model, an unpickled copy) finds the same entry.
"""

from __future__ import annotations

import threading

import torch
from typing import Any, Callable, Dict, Tuple

from mace_accel.errors import KernelError

_SPECS: Dict[str, Any] = {}
_CACHE: Dict[Tuple, Any] = {}
_LOCK = threading.Lock()


def register(family: str, spec: Any) -> str:
    """Register ``spec`` (a frozen dataclass with ``key()``) under ``family``; returns its key."""
    key = f"{family}:{spec.key()}"
    if key not in _SPECS:
        with _LOCK:
            _SPECS.setdefault(key, spec)
    return key


def lookup(key: str) -> Any:
    """The spec registered under ``key``."""
    try:
        return _SPECS[key]
    except KeyError:
        raise KernelError(f"no fused problem is registered under {key!r}; the op must be called "
                          "through its mace-accel module (which registers its spec)") from None


def cached(cache_key: Tuple, build: Callable[[], Any]) -> Any:
    """``build()`` once per ``cache_key`` (compiled kernels per spec, dtype, device, options)."""
    value = _CACHE.get(cache_key)
    if value is None:
        with _LOCK:
            value = _CACHE.get(cache_key)
            if value is None:
                value = _CACHE[cache_key] = build()
    return value


def device_constant(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device``, made once per ``(values, dtype, device)``
    (``values`` hashable: a float or a tuple). The plain-torch formulas also run inside
    training steps captured as CUDA graphs (their double backward), and a capture cannot copy
    from the host. Read-only: the tensor is shared."""
    return cached(("constant", values, dtype, torch.device(device)),
                  lambda: torch.tensor(values, dtype=dtype, device=device))


def kernels_for(key: str, t: Any, factory: Callable[[Any, Any, Any], Any]) -> Any:
    """``factory(spec, dtype, device)`` of the spec under ``key`` for ``t``'s dtype and device,
    built once (a family's compiled kernels)."""
    return cached((key, t.dtype, t.device), lambda: factory(lookup(key), t.dtype, t.device))
