"""Build a radial table (:class:`RadialTable`) from a function of the edge length, and evaluate
it in plain torch (the CPU path and the oracle of the GPU tests).

The grid has ``cells`` cells of width ``h = r_max / cells`` over ``[0, r_max]``. At the nodes
``r_g = g h`` the function's values and derivatives (forward mode through autograd, float64)
give per cell the Hermite interpolant in ``s = r / h - g``, a polynomial ``sum_k c_k s^k``
matching the values and slopes at both ends (cubic, :data:`CUBIC`) or values, slopes and
second derivatives (quintic, :data:`QUINTIC`): continuous with its first (second) derivative
across the nodes. The cubic's error falls as ``h^4`` (its slope's as ``h^3``), the quintic's as
``h^6``. The grid is doubled from the spec's first cell count until the errors between the
nodes (a quarter, half and three quarters into every cell, against the function itself, the
coefficients rounded to the table's dtype) are within the spec's tolerances of the largest
weight and the largest slope (what forces see), or its cell limit is passed.

Float32 tables are cubic (1e-7 / 5e-7: the 3xTF32 MLP kernels are ~1e-6 off float64), float64
tables quintic (1e-13 / 2e-12: the model-level float64 tolerance is 1e-10), :data:`SPECS`.

The first cell, ``r < h`` (0.006 Å for a 6 Å cutoff; validation rejects atoms closer than
0.5 Å), is left out of the check: the embeddings' ``sin(k r) / r`` is 0 / 0 at ``r = 0``, so the
first node is taken at ``r = NODE0 h``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Tuple

import torch

Tensor = torch.Tensor
NODE0 = 1e-3  # the first node's radius, in cells (see the module docstring)
CHECK_POINTS = (0.25, 0.5, 0.75)  # where in each cell the error is checked
CUBIC, QUINTIC = 3, 5


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """How a table of one dtype is built: the polynomial ``degree`` (3 or 5), the largest
    errors allowed between the nodes relative to the largest weight (``tolerance``) and the
    largest slope (``slope_tolerance``), the cells to start from and the most allowed."""

    degree: int
    tolerance: float
    slope_tolerance: float
    first_cells: int = 512
    max_cells: int = 8192


SPECS: Dict[torch.dtype, TableSpec] = {
    torch.float32: TableSpec(CUBIC, 1e-7, 5e-7),
    torch.float64: TableSpec(QUINTIC, 1e-13, 2e-12),
}
TOLERANCE = SPECS[torch.float32].tolerance  # float32's, the default of build_table


class TableError(ValueError):
    """The function cannot be tabulated within the tolerances and the cell limit."""


@dataclasses.dataclass(frozen=True)
class RadialTable:
    """``coeffs [cells, degree + 1, n]`` (float64): per cell the polynomial's coefficients in
    ``s``; ``r_max``; ``max_error``, ``max_slope_error``: the errors of the values and the
    slopes found between the nodes, relative to the largest weight and the largest slope."""

    coeffs: Tensor
    r_max: float
    max_error: float
    max_slope_error: float

    @property
    def cells(self) -> int:
        return int(self.coeffs.shape[0])

    @property
    def degree(self) -> int:
        return int(self.coeffs.shape[1]) - 1

    @property
    def n_out(self) -> int:
        return int(self.coeffs.shape[2])

    @property
    def inv_h(self) -> float:
        """Cells per unit of length."""
        return self.cells / self.r_max

    def describe(self, dtype: torch.dtype = torch.float32) -> str:
        kind = {CUBIC: "cubic", QUINTIC: "quintic"}.get(self.degree, f"degree-{self.degree}")
        size = self.coeffs.numel() * torch.finfo(dtype).bits / 8 / 2 ** 20
        return (f"{kind} Hermite table of {self.cells} cells over [0, {self.r_max:g}] "
                f"({size:.1f} MB {str(dtype).replace('torch.', '')}), {self.max_error:.1e} of "
                f"the largest weight and {self.max_slope_error:.1e} of the largest slope off "
                "the float64 MLP between the nodes")


def _forward_derivative(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``r -> d fn(r) / d r`` (row ``i`` of ``fn`` depending on ``r[i]`` alone), itself
    differentiable: the gradient of a vector-Jacobian product in its cotangent."""
    def derivative(r: Tensor) -> Tensor:
        out = fn(r)
        u = torch.zeros_like(out, requires_grad=True)
        (vjp,) = torch.autograd.grad(out, r, u, create_graph=True)
        (jvp,) = torch.autograd.grad(vjp, u, torch.ones_like(vjp), create_graph=True)
        return jvp

    return derivative


def derivatives(f: Callable[[Tensor], Tensor], r: Tensor, order: int) -> List[Tensor]:
    """``[f(r), f'(r), ..., f^(order)(r)]``, each ``[N, n]``, for ``r [N]`` of a ``f`` that
    maps each ``r[i]`` to row ``i`` alone (torch ops, differentiable ``order + 1`` times)."""
    r = r.detach().clone().requires_grad_(True)
    out, fn = [], f
    with torch.enable_grad():
        for _ in range(order + 1):
            out.append(fn(r))
            fn = _forward_derivative(fn)
    return [t.detach() for t in out]


def values_and_slopes(f: Callable[[Tensor], Tensor], r: Tensor) -> Tuple[Tensor, Tensor]:
    """``(f(r), f'(r))`` (:func:`derivatives` of order 1)."""
    values, slopes = derivatives(f, r, 1)
    return values, slopes


def hermite_coefficients(values: Tensor, slopes_h: Tensor,
                         curvatures_h2: Tensor = None) -> Tensor:
    """``[cells, 4, n]`` (cubic) from the node values ``[cells + 1, n]`` and slopes times ``h``,
    or ``[cells, 6, n]`` (quintic) with the second derivatives times ``h^2`` too."""
    p0, p1, d0, d1 = values[:-1], values[1:], slopes_h[:-1], slopes_h[1:]
    dp = p1 - p0
    if curvatures_h2 is None:
        return torch.stack([p0, d0, 3 * dp - 2 * d0 - d1, -2 * dp + d0 + d1], dim=1)
    a0, a1 = curvatures_h2[:-1], curvatures_h2[1:]
    return torch.stack([p0, d0, a0 / 2,
                        10 * dp - 6 * d0 - 4 * d1 - (3 * a0 - a1) / 2,
                        -15 * dp + 8 * d0 + 7 * d1 + (3 * a0 - 2 * a1) / 2,
                        6 * dp - 3 * d0 - 3 * d1 - (a0 - a1) / 2], dim=1)


def evaluate(coeffs: Tensor, inv_h: float, r: Tensor) -> Tensor:
    """``[E, n]``: the table at ``r [E]`` (differentiable in ``r`` and ``coeffs``, any dtype;
    ``r`` from the last node on stays on the last cell's end, its slope 0, as the kernels
    do)."""
    cells = coeffs.shape[0]
    t = r * inv_h
    g = t.detach().clamp(0, cells).floor().clamp(0, cells - 1).long()
    u = t - g.to(t.dtype)
    s = torch.where(u < 1, u, torch.ones_like(u)).unsqueeze(1)
    c = coeffs[g].to(r.dtype)
    out = c[:, -1]
    for k in range(c.shape[1] - 2, -1, -1):
        out = c[:, k] + s * out
    return out


def _nodes(cells: int, r_max: float, like: Tensor) -> Tensor:
    h = r_max / cells
    r = torch.arange(cells + 1, dtype=torch.float64, device=like.device) * h
    r[0] = NODE0 * h
    return r


def _errors(coeffs: Tensor, f: Callable[[Tensor], Tensor], r_max: float, scale: float,
            slope_scale: float, dtype: torch.dtype) -> Tuple[float, float]:
    """The largest errors of the values and slopes between the nodes (cells 1..), relative to
    ``scale`` and ``slope_scale``, with the coefficients rounded to ``dtype``."""
    cells = coeffs.shape[0]
    if cells < 2:
        return 0.0, 0.0
    h = r_max / cells
    g = torch.arange(1, cells, dtype=torch.float64, device=coeffs.device)
    r = torch.cat([(g + u) * h for u in CHECK_POINTS])
    exact = derivatives(f, r, 1)
    stored = coeffs.to(dtype).double()
    spline = derivatives(lambda x: evaluate(stored, cells / r_max, x), r, 1)
    errors = [float((a - b).abs().max()) / s if s else 0.0
              for a, b, s in zip(spline, exact, (scale, slope_scale))]
    return errors[0], errors[1]


def build_table(f: Callable[[Tensor], Tensor], r_max: float, like: Tensor,
                spec: TableSpec = SPECS[torch.float32],
                dtype: torch.dtype = torch.float32) -> RadialTable:
    """The table of ``f`` (``r [N]`` float64 -> ``[N, n]``, differentiable ``spec.degree``
    times over) over ``[0, r_max]`` on ``like``'s device, with the fewest cells (doubling from
    ``spec.first_cells``) whose errors between the nodes, coefficients rounded to ``dtype``,
    are within the spec's tolerances.

    Raises:
        TableError: not within ``spec.max_cells`` cells (the message gives the errors reached),
            or a non-finite coefficient.
    """
    if not r_max > 0:
        raise TableError(f"r_max must be positive, got {r_max}")
    order = (spec.degree - 1) // 2
    cells, err, slope_err = spec.first_cells, float("inf"), float("inf")
    while cells <= spec.max_cells:
        h = r_max / cells
        node = derivatives(f, _nodes(cells, r_max, like), order)
        coeffs = hermite_coefficients(node[0], node[1] * h,
                                      None if order < 2 else node[2] * h * h)
        if not bool(torch.isfinite(coeffs).all()):
            raise TableError("the radial MLP is not finite at every node of the table")
        scales = [float(v[1:].abs().max()) if v.numel() else 0.0 for v in node[:2]]
        err, slope_err = _errors(coeffs, f, r_max, *scales, dtype)
        if err <= spec.tolerance and slope_err <= spec.slope_tolerance:
            return RadialTable(coeffs, float(r_max), err, slope_err)
        cells *= 2
    raise TableError(f"a table of {cells // 2} cells is {err:.1e} of the radial MLP's largest "
                     f"weight and {slope_err:.1e} of its largest slope off it (at most "
                     f"{spec.tolerance:.0e} and {spec.slope_tolerance:.0e} allowed)")
