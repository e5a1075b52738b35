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

Float32 tables are cubic, float64 tables quintic (:data:`SPECS`), to the tolerances of
:data:`mace_accel.tolerances.TABLE_TOL` (which says why they are what they are).

The first cell, ``r < h`` (0.006 Å for a 6 Å cutoff; validation rejects atoms closer than
0.5 Å), is left out of the check: the embeddings' ``sin(k r) / r`` is 0 / 0 at ``r = 0``, so the
first node is taken at ``r = NODE0 h``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import torch

from mace_accel.tolerances import TABLE_TOL

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
    dtype: TableSpec(degree, TABLE_TOL[dtype]["value"], TABLE_TOL[dtype]["slope"])
    for dtype, degree in ((torch.float32, CUBIC), (torch.float64, QUINTIC))
}


class TableError(ValueError):
    """The function cannot be tabulated within the tolerances and the cell limit."""


@dataclasses.dataclass(frozen=True)
class RadialTable:
    """``coeffs [tables * cells, degree + 1, n]`` (float64 as built; a model keeps them in
    its dtype): per cell the polynomial's
    coefficients in ``s``, ``tables`` tables of the same grid laid end to end (one per pair of
    species where the weights depend on the pair); ``r_max``; ``max_error``,
    ``max_slope_error``: the errors of the values and the slopes found between the nodes,
    relative to the largest weight and the largest slope (of all the tables)."""

    coeffs: Tensor
    r_max: float
    max_error: float
    max_slope_error: float
    tables: int = 1

    @property
    def cells(self) -> int:
        """Cells of one table."""
        return int(self.coeffs.shape[0]) // self.tables

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
        """One line for reports: kind, cells, size in ``dtype``, the errors found."""
        kind = {CUBIC: "cubic", QUINTIC: "quintic"}.get(self.degree, f"degree-{self.degree}")
        size = self.coeffs.numel() * torch.finfo(dtype).bits / 8 / 2 ** 20
        count = "a " if self.tables == 1 else f"{self.tables} (one per pair of elements) "
        return (f"{count}{kind} Hermite table{'s' if self.tables > 1 else ''} of {self.cells} "
                f"cells over [0, {self.r_max:g}] ({size:.1f} MB "
                f"{str(dtype).replace('torch.', '')}), {self.max_error:.1e} of "
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


def hermite_coefficients(values: Tensor, slopes_h: Tensor,
                         curvatures_h2: Tensor = None) -> Tensor:
    """``[..., cells, 4, n]`` (cubic) from the node values ``[..., cells + 1, n]`` and slopes
    times ``h``, or ``[..., cells, 6, n]`` (quintic) with the second derivatives times ``h^2``
    too."""
    p0, p1 = values[..., :-1, :], values[..., 1:, :]
    d0, d1 = slopes_h[..., :-1, :], slopes_h[..., 1:, :]
    dp = p1 - p0
    if curvatures_h2 is None:
        return torch.stack([p0, d0, 3 * dp - 2 * d0 - d1, -2 * dp + d0 + d1], dim=-2)
    a0, a1 = curvatures_h2[..., :-1, :], curvatures_h2[..., 1:, :]
    return torch.stack([p0, d0, a0 / 2,
                        10 * dp - 6 * d0 - 4 * d1 - (3 * a0 - a1) / 2,
                        -15 * dp + 8 * d0 + 7 * d1 + (3 * a0 - 2 * a1) / 2,
                        6 * dp - 3 * d0 - 3 * d1 - (a0 - a1) / 2], dim=-2)


def evaluate(coeffs: Tensor, inv_h: float, r: Tensor, slots: Optional[Tensor] = None,
             tables: int = 1) -> Tensor:
    """``[E, n]``: the table at ``r [E]`` (differentiable in ``r`` and ``coeffs``, any dtype;
    ``r`` from the last node on stays on the last cell's end, its slope 0, as the kernels
    do); with ``tables`` tables laid end to end, edge ``e`` reads table ``slots[e]``."""
    cells = coeffs.shape[0] // tables
    t = r * inv_h
    g = t.detach().clamp(0, cells).floor().clamp(0, cells - 1).long()
    u = t - g.to(t.dtype)
    s = torch.where(u < 1, u, torch.ones_like(u)).unsqueeze(1)
    if slots is not None:
        g = g + slots.long() * cells
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


# rows of one batched evaluation while building (pairs are taken a chunk at a time)
BUILD_ROWS = 1 << 16

PairwiseFunction = Callable[[Tensor, Tensor], Tensor]


def _errors(coeffs: Tensor, f: PairwiseFunction, first: int, r_max: float,
            dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """``[2, n]``-free maxima: the largest absolute errors of the values and slopes between the
    nodes (cells 1..) of the tables ``coeffs [k, cells, NC, n]`` (functions ``first ..
    first + k - 1`` of ``f``), the coefficients rounded to ``dtype``."""
    k, cells = int(coeffs.shape[0]), int(coeffs.shape[1])
    zero = coeffs.new_zeros(())
    if cells < 2:
        return zero, zero
    h = r_max / cells
    g = torch.arange(1, cells, dtype=torch.float64, device=coeffs.device)
    r = torch.cat([(g + u) * h for u in CHECK_POINTS])
    rows = r.repeat(k)
    local = torch.arange(k, device=coeffs.device).repeat_interleave(r.numel())
    exact = derivatives(lambda x: f(x, local + first), rows, 1)
    stored = coeffs.to(dtype).double().reshape(k * cells, *coeffs.shape[2:])
    spline = derivatives(lambda x: evaluate(stored, cells / r_max, x, local, k), rows, 1)
    return (spline[0] - exact[0]).abs().max(), (spline[1] - exact[1]).abs().max()


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
    return build_tables(lambda r, slot: f(r), 1, r_max, like, spec, dtype)


def build_tables(f: PairwiseFunction, count: int, r_max: float, like: Tensor,
                 spec: TableSpec = SPECS[torch.float32],
                 dtype: torch.dtype = torch.float32) -> RadialTable:
    """``count`` tables on one grid: ``f(r [N], which [N] int64) -> [N, n]`` gives, row by row,
    function ``which`` at ``r`` (each row depending on its own ``r`` alone; evaluated for many
    functions at once, a chunk of :data:`BUILD_ROWS` rows at a time). The fewest cells for
    which every function is within the tolerances, relative to the largest weight and slope
    over all of them; laid end to end (``coeffs [count * cells, degree + 1, n]``, table ``i``
    from row ``i * cells``).

    Raises:
        TableError: as :func:`build_table`, for the worst of the functions.
    """
    if not r_max > 0:
        raise TableError(f"r_max must be positive, got {r_max}")
    if count < 1:
        raise TableError("no function to tabulate")
    order = (spec.degree - 1) // 2
    cells, err, slope_err = spec.first_cells, float("inf"), float("inf")
    while cells <= spec.max_cells:
        h = r_max / cells
        nodes = _nodes(cells, r_max, like)
        chunk = max(1, BUILD_ROWS // (cells + 1))
        coeffs, scales = [], torch.zeros(2, dtype=torch.float64, device=like.device)
        for first in range(0, count, chunk):
            k = min(chunk, count - first)
            which = torch.arange(first, first + k, device=like.device).repeat_interleave(
                cells + 1)
            node = [v.reshape(k, cells + 1, -1) for v in
                    derivatives(lambda r: f(r, which), nodes.repeat(k), order)]
            c = hermite_coefficients(node[0], node[1] * h,
                                     None if order < 2 else node[2] * h * h)
            coeffs.append(c)
            scales = torch.maximum(scales, torch.stack([v[:, 1:].abs().max() for v in node[:2]]))
        coeffs = torch.cat(coeffs)
        if not bool(torch.isfinite(coeffs).all()):
            raise TableError("the radial MLP is not finite at every node of the table")
        worst = torch.zeros(2, dtype=torch.float64, device=like.device)
        for first in range(0, count, max(1, BUILD_ROWS // (3 * cells))):
            k = min(max(1, BUILD_ROWS // (3 * cells)), count - first)
            worst = torch.maximum(worst, torch.stack(
                _errors(coeffs[first:first + k], f, first, r_max, dtype)))
        ratio = (worst / torch.where(scales > 0, scales, torch.ones_like(scales))).tolist()
        err, slope_err = ratio
        if err <= spec.tolerance and slope_err <= spec.slope_tolerance:
            return RadialTable(coeffs.reshape(count * cells, *coeffs.shape[2:]), float(r_max),
                               err, slope_err, count)
        cells *= 2
    raise TableError(f"a table of {cells // 2} cells is {err:.1e} of the radial MLP's largest "
                     f"weight and {slope_err:.1e} of its largest slope off it (at most "
                     f"{spec.tolerance:.0e} and {spec.slope_tolerance:.0e} allowed)")
