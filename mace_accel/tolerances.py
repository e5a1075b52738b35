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
# radial tables (mace_accel.ops.radial.table.table.SPECS): the largest error allowed between the
# grid's nodes relative to the largest weight ("value") and to the largest slope ("slope", what
# forces see). float32: well under the ~1e-6 by which the float32 MLP a table replaces differs
# from float64. float64: the values three orders under MODEL_TOL; the slopes are bounded
# by rounding, not by the grid: the MLP's float64 values carry ~1e-15 of their size, which an
# interpolant's slope between two nodes amplifies by about 1 / h (an Agnesi-transformed model,
# MACE-MPA-0's architecture: 0.6-1.4e-11 from 2,048 to 8,192 cells, growing with the cells).
TABLE_TOL = {
    torch.float32: {"value": 1e-7, "slope": 5e-7},
    torch.float64: {"value": 1e-13, "slope": 2e-11},
}


def rel_norm_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in float64 (0 when both are zero)."""
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else diff


def energy_error(got: torch.Tensor, want: torch.Tensor, node_energy: torch.Tensor) -> float:
    """``|got - want|`` of total energies relative to the larger of ``|want|`` and the summed
    magnitudes of the per-atom energies ``node_energy [N]`` that make them up.

    A total that nearly cancels (a few eV from per-atom terms of hundreds) cannot be summed in
    float32 closer than those terms' rounding: mace's own float32 ``scatter_sum`` differs from an
    exact sum by ~1e-5 of the total at ~100 atoms. Measured against the terms' scale, the
    model-level tolerance means the same for every structure.
    """
    a, b = got.detach().double(), want.detach().double()
    scale = max(b.norm().item(), node_energy.detach().double().abs().sum().item())
    diff = (a - b).norm().item()
    return diff / scale if scale > 0 else diff


def rel_linf_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|`` in float64, OpenEquivariance's fp32 measure."""
    a, b = a.detach().double(), b.detach().double()
    denom = b.abs().max().item() if b.numel() else 0.0
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    return diff / denom if denom > 0 else diff


def model_tolerance(dtype: torch.dtype) -> float:
    return MODEL_TOL[dtype]
