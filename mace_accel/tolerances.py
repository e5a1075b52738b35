"""The tolerance table (shared/ARCHITECTURE.md) as code: one source for tests and verify=True."""

from __future__ import annotations

import torch

# per kernel pass, against reference.py or e3nn on the same inputs
PASS_TOL = {
    torch.float64: {"forward": 1e-12, "backward": 1e-11, "double_backward": 1e-10},
    torch.float32: {"forward": 1e-5, "backward": 3e-4, "double_backward": 5e-4},
}
# model level: energy, forces, stress vs the unpatched e3nn model
MODEL_TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
EQUIVARIANCE_TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def rel_norm_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in float64 (0 when both are zero)."""
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else diff


def rel_linf_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|`` in float64, OpenEquivariance's fp32 measure."""
    a, b = a.detach().double(), b.detach().double()
    denom = b.abs().max().item() if b.numel() else 0.0
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    return diff / denom if denom > 0 else diff


def model_tolerance(dtype: torch.dtype) -> float:
    return MODEL_TOL[dtype]
