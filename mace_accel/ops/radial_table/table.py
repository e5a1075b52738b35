"""Build a radial table (:class:`RadialTable`) from a function of the edge length, and evaluate
it in plain torch (the CPU path and the oracle of the GPU tests).

The grid has ``cells`` cells of width ``h = r_max / cells`` over ``[0, r_max]``. At the nodes
``r_g = g h`` the function's values ``f_g`` and slopes ``f'_g`` (forward-mode through autograd,
float64) give per cell the cubic Hermite interpolant in ``s = r / h - g``:
``c0 + c1 s + c2 s^2 + c3 s^3`` with ``c0 = f_g``, ``c1 = h f'_g``,
``c2 = 3 (f_{g+1} - f_g) - 2 h f'_g - h f'_{g+1}``, ``c3 = 2 (f_g - f_{g+1}) + h f'_g + h f'_{g+1}``
(continuous with its first derivative across the nodes). Its error falls as ``h^4``; the grid is
doubled from :data:`FIRST_CELLS` until the error between the nodes (a quarter, half and three
quarters into every cell, against the function itself, coefficients rounded to float32 as
stored) is at most :data:`TOLERANCE` of the largest weight and the error of its slope (what
forces see) at most :data:`SLOPE_TOLERANCE` of the largest slope, or :data:`MAX_CELLS` is
passed.

The first cell, ``r < h`` (0.006 Å for a 6 Å cutoff; validation rejects atoms closer than
0.5 Å), is left out of the check: the embeddings' ``sin(k r) / r`` is 0 / 0 at ``r = 0``, so the
first node is taken at ``r = NODE0 h``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Tuple

import torch

Tensor = torch.Tensor
FIRST_CELLS = 512
MAX_CELLS = 8192
# the largest error allowed between the nodes, relative to the largest weight; the float32
# 3xTF32 MLP kernels are 1e-6 off float64, the tolerance table allows 1e-5 per pass
TOLERANCE = 1e-7
# the same for the slopes d w / d r, whose error falls as h^3 only (the 3xTF32 backward kernels
# are 1.0-1.5e-6 off float64)
SLOPE_TOLERANCE = 5e-7
NODE0 = 1e-3  # the first node's radius, in cells (see the module docstring)
CHECK_POINTS = (0.25, 0.5, 0.75)  # where in each cell the error is checked


class TableError(ValueError):
    """The function cannot be tabulated to :data:`TOLERANCE` within :data:`MAX_CELLS`."""


@dataclasses.dataclass(frozen=True)
class RadialTable:
    """``coeffs [cells, 4, n]`` (float64): per cell the cubic's coefficients in ``s``;
    ``r_max``; ``max_error``, ``max_slope_error``: the errors of the values and the slopes
    found between the nodes, relative to the largest weight and the largest slope."""

    coeffs: Tensor
    r_max: float
    max_error: float
    max_slope_error: float

    @property
    def cells(self) -> int:
        return int(self.coeffs.shape[0])

    @property
    def n_out(self) -> int:
        return int(self.coeffs.shape[2])

    @property
    def inv_h(self) -> float:
        """Cells per unit of length."""
        return self.cells / self.r_max

    def describe(self) -> str:
        return (f"cubic Hermite table of {self.cells} cells over [0, {self.r_max:g}] "
                f"({self.cells * 4 * self.n_out * 4 / 2 ** 20:.1f} MB float32), "
                f"{self.max_error:.1e} of the largest weight and {self.max_slope_error:.1e} of "
                "the largest slope off the float64 MLP between the nodes")


def values_and_slopes(f: Callable[[Tensor], Tensor], r: Tensor):
    """``(f(r) [N, n], df/dr [N, n])`` for ``r [N]`` of a ``f`` that maps each ``r[i]`` to row
    ``i`` alone; the slopes by forward mode (the gradient of a vector-Jacobian product in its
    cotangent), so ``f`` must be twice differentiable (torch ops)."""
    r = r.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        out = f(r)
        u = torch.zeros_like(out, requires_grad=True)
        (vjp,) = torch.autograd.grad(out, r, u, create_graph=True)
        (slopes,) = torch.autograd.grad(vjp, u, torch.ones_like(vjp))
    return out.detach(), slopes.detach()


def hermite_coefficients(values: Tensor, slopes_h: Tensor) -> Tensor:
    """``[cells, 4, n]`` from the node values ``[cells + 1, n]`` and slopes times ``h``."""
    f0, f1, d0, d1 = values[:-1], values[1:], slopes_h[:-1], slopes_h[1:]
    return torch.stack([f0, d0, 3 * (f1 - f0) - 2 * d0 - d1, 2 * (f0 - f1) + d0 + d1], dim=1)


def evaluate(coeffs: Tensor, inv_h: float, r: Tensor) -> Tensor:
    """``[E, n]``: the table at ``r [E]`` (differentiable in ``r`` and ``coeffs``, any dtype;
    ``r`` past the last node stays on the last cell's end, as the kernel does)."""
    cells = coeffs.shape[0]
    t = r * inv_h
    g = t.detach().floor().clamp(0, cells - 1).long()
    s = (t - g.to(t.dtype)).clamp(max=1.0).unsqueeze(1)
    c = coeffs[g].to(r.dtype)
    return c[:, 0] + s * (c[:, 1] + s * (c[:, 2] + s * c[:, 3]))


def _nodes(cells: int, r_max: float, like: Tensor) -> Tensor:
    h = r_max / cells
    r = torch.arange(cells + 1, dtype=torch.float64, device=like.device) * h
    r[0] = NODE0 * h
    return r


def _errors(coeffs: Tensor, f: Callable[[Tensor], Tensor], r_max: float, scale: float,
            slope_scale: float) -> Tuple[float, float]:
    """The largest errors of the values and slopes between the nodes (cells 1..), relative to
    ``scale`` and ``slope_scale``, with the coefficients rounded to float32."""
    cells = coeffs.shape[0]
    if cells < 2:
        return 0.0, 0.0
    h = r_max / cells
    g = torch.arange(1, cells, dtype=torch.float64, device=coeffs.device)
    r = torch.cat([(g + u) * h for u in CHECK_POINTS])
    exact, exact_slopes = values_and_slopes(f, r)
    spline, spline_slopes = values_and_slopes(
        lambda x: evaluate(coeffs.float().double(), cells / r_max, x), r)
    err = float((spline - exact).abs().max()) / scale if scale else 0.0
    slope_err = (float((spline_slopes - exact_slopes).abs().max()) / slope_scale
                 if slope_scale else 0.0)
    return err, slope_err


def build_table(f: Callable[[Tensor], Tensor], r_max: float, like: Tensor,
                tolerance: float = TOLERANCE, slope_tolerance: float = SLOPE_TOLERANCE,
                first_cells: int = FIRST_CELLS, max_cells: int = MAX_CELLS) -> RadialTable:
    """The table of ``f`` (``r [N]`` float64 -> ``[N, n]``, twice differentiable) over
    ``[0, r_max]`` on ``like``'s device, with the fewest cells (doubling from ``first_cells``)
    that keep the errors between the nodes within ``tolerance`` of the largest weight and
    ``slope_tolerance`` of the largest slope.

    Raises:
        TableError: not within ``max_cells`` cells (the message gives the error reached).
    """
    if not r_max > 0:
        raise TableError(f"r_max must be positive, got {r_max}")
    cells, err, slope_err = first_cells, float("inf"), float("inf")
    while cells <= max_cells:
        values, slopes = values_and_slopes(f, _nodes(cells, r_max, like))
        coeffs = hermite_coefficients(values, slopes * (r_max / cells))
        scales = [float(v[1:].abs().max()) if v.numel() else 0.0 for v in (values, slopes)]
        err, slope_err = _errors(coeffs, f, r_max, *scales)
        if err <= tolerance and slope_err <= slope_tolerance:
            return RadialTable(coeffs, float(r_max), err, slope_err)
        cells *= 2
    raise TableError(f"a table of {cells // 2} cells is {err:.1e} of the radial MLP's largest "
                     f"weight and {slope_err:.1e} of its largest slope off it (at most "
                     f"{tolerance:.0e} and {slope_tolerance:.0e} allowed)")
