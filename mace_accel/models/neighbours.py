"""Neighbour lists for MACE from vesin (a maintained library), on the CPU or a CUDA device.

:func:`neighbour_list` gives mace's edge convention: ``edge_index[0]`` is the sender ``i``,
``edge_index[1]`` the receiver ``j``, and the edge vector is
``positions[j] - positions[i] + unit_shifts @ cell``. It holds the same set of
``(sender, receiver, unit_shift)`` triples as mace's ``get_neighborhood`` (matscipy): self-pairs
with a zero shift are dropped, an atom's own periodic images are kept. vesin takes torch
tensors on the CPU or a CUDA device and returns the pairs on the same device, so a GPU run
never copies positions to the host.

:class:`VerletNeighbourList` adds a skin: the list is built at ``cutoff + skin`` and reused while
no atom has moved more than ``skin / 2`` since it was built (and the cell, periodicity, atom
count, dtype and device are unchanged). Every pair closer than ``cutoff`` now is then in the
list; :func:`within_cutoff` drops the others where they would matter.

vesin is imported inside the functions: importing this module does no work.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Optional, Sequence, Tuple

import numpy as np
import torch

from mace_accel.errors import InputError

Tensor = torch.Tensor
Pbc = Tuple[bool, bool, bool]

_AXES = "abc"
# Gram determinant of the periodic cell vectors over the product of their squared lengths
# (sin^2 of the angle for two vectors, the squared normalised volume for three): below this
# the periodic vectors are linearly dependent and there is no lattice to sum images over.
_SINGULAR_GRAM = 1e-12


# ---------------------------------------------------------------------------------------------
# input checks
# ---------------------------------------------------------------------------------------------


def _check_pbc(pbc: Sequence[Any]) -> Pbc:
    """``pbc`` as a tuple of three Python bools.

    Args:
        pbc: three booleans (Python, numpy or a torch tensor of 3 booleans).

    Raises:
        InputError: not three booleans.
    """
    if isinstance(pbc, torch.Tensor):
        pbc = pbc.tolist()
    try:
        values = list(pbc)
    except TypeError:
        raise InputError(f"pbc must be three booleans (one per cell vector), got {pbc!r}") \
            from None
    if len(values) != 3 or any(v not in (True, False) for v in values):
        raise InputError(f"pbc must be three booleans (one per cell vector), got {pbc!r}")
    return tuple(bool(v) for v in values)  # type: ignore[return-value]


def _check_cutoff(cutoff: float, name: str = "cutoff") -> float:
    """``cutoff`` as a finite, positive float (vesin's lower limit is 1e-6 Å)."""
    try:
        value = float(cutoff)
    except (TypeError, ValueError):
        raise InputError(f"the {name} must be a number in Å, got {cutoff!r}") from None
    if not math.isfinite(value) or value <= 1e-6:
        raise InputError(f"the {name} must be a finite number > 1e-6 Å, got {cutoff!r}")
    return value


def _check_positions_shape(positions: Tensor) -> None:
    """Type, shape ``[N, 3]`` and floating dtype of ``positions`` (no device sync)."""
    if not isinstance(positions, torch.Tensor):
        raise InputError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    if positions.dim() != 2 or positions.shape[1] != 3:
        raise InputError(
            f"positions must have shape [n_atoms, 3], got {list(positions.shape)}")
    if not positions.is_floating_point():
        raise InputError(f"positions must be a floating-point tensor, got {positions.dtype}")


def _check_positions_finite(positions: Tensor) -> None:
    """Raise if any coordinate is NaN or infinite (one number from the device)."""
    if positions.numel() and not bool(torch.isfinite(positions).all()):
        bad = torch.nonzero(~torch.isfinite(positions).all(dim=1))[:5, 0].tolist()
        raise InputError(f"positions contain NaN or infinite values (atoms {bad}"
                         f"{', ...' if len(bad) == 5 else ''}); check the structure or the "
                         "integrator that produced it")


def _check_cell(cell: Tensor, pbc: Pbc) -> Tensor:
    """Validate ``cell`` and return it as a detached float64 ``[3, 3]`` CPU tensor.

    Only the periodic cell vectors must be finite and linearly independent: a molecule may
    have a zero cell and a slab a zero (or any) third vector, since vesin replaces the
    non-periodic vectors by an orthonormal complement of the periodic ones.

    Raises:
        InputError: not a 3x3 real matrix; a periodic vector not finite, of zero length or
            linearly dependent on the other periodic ones.
    """
    if not isinstance(cell, torch.Tensor):
        try:
            cell = torch.as_tensor(cell)
        except (TypeError, ValueError, RuntimeError):
            raise InputError(f"the cell must be a 3x3 matrix, got {type(cell).__name__}") \
                from None
    if tuple(cell.shape) != (3, 3):
        raise InputError(f"the cell must be a 3x3 matrix (rows = cell vectors), got shape "
                         f"{list(cell.shape)}")
    if cell.is_complex() or cell.dtype == torch.bool:
        raise InputError(f"the cell must be a real matrix, got {cell.dtype}")
    cell64 = cell.detach().to(device="cpu", dtype=torch.float64)
    periodic = [axis for axis in range(3) if pbc[axis]]
    if not periodic:
        return cell64
    vectors = cell64[periodic]
    if not bool(torch.isfinite(vectors).all()):
        raise InputError(f"the periodic cell vectors contain NaN or infinite values: "
                         f"{cell64.tolist()}")
    squared = (vectors * vectors).sum(dim=1)
    gram = float(torch.linalg.det(vectors @ vectors.T))
    scale = float(torch.prod(squared))
    if scale == 0.0 or gram / scale < _SINGULAR_GRAM:
        names = ", ".join(_AXES[a] for a in periodic)
        raise InputError(
            f"the periodic cell is singular: the cell vectors of the periodic directions "
            f"({names}; pbc={list(pbc)}) have zero length or are linearly dependent, cell="
            f"{cell64.tolist()}; give {len(periodic)} independent cell vectors or set pbc "
            "False along the missing ones")
    return cell64


# ---------------------------------------------------------------------------------------------
# the list
# ---------------------------------------------------------------------------------------------


def _vesin_calculator(cutoff: float):
    """A vesin ``NeighborList`` (full list: both ``i -> j`` and ``j -> i``) at ``cutoff``."""
    from vesin import NeighborList

    return NeighborList(cutoff=cutoff, full_list=True)


_PER_THREAD = threading.local()


def _thread_calculator(cutoff: float):
    """This thread's vesin ``NeighborList`` at ``cutoff``, kept between calls: vesin keeps its
    buffers (on a GPU, device memory) in the object, so one per call would allocate them anew."""
    cache = getattr(_PER_THREAD, "calculators", None)
    if cache is None:
        cache = _PER_THREAD.calculators = {}
    if cutoff not in cache:
        if len(cache) >= 8:  # a handful of cutoffs in practice; never grow without bound
            cache.clear()
        cache[cutoff] = _vesin_calculator(cutoff)
    return cache[cutoff]


def _empty(positions: Tensor) -> Tuple[Tensor, Tensor]:
    """No edges: ``([2, 0] int64, [0, 3] positions' dtype)`` on positions' device."""
    return (torch.zeros((2, 0), dtype=torch.int64, device=positions.device),
            torch.zeros((0, 3), dtype=positions.dtype, device=positions.device))


def _compute(calculator, positions: Tensor, cell64: Tensor, pbc: Pbc) -> Tuple[Tensor, Tensor]:
    """Run vesin on validated input and convert to mace's convention.

    Args:
        calculator: a vesin ``NeighborList`` (its cutoff is used).
        positions: ``[N, 3]`` floating, finite, any device; N > 0.
        cell64: ``[3, 3]`` float64 (validated; any device).
        pbc: three bools.

    Returns:
        ``(edge_index [2, E] int64, unit_shifts [E, 3] positions' dtype)`` on positions'
        device, without self-pairs of zero shift.
    """
    device = positions.device
    points = positions.detach().to(torch.float64).contiguous()  # vesin: no autograd, float64
    if any(pbc):
        box = cell64.to(device=device).contiguous()  # vesin: box on the points' device
    else:
        box = torch.zeros((3, 3), dtype=torch.float64, device=device)  # ignored by vesin
    # vesin launches on the current CUDA device: on another one its kernels would read this
    # device's memory (an illegal access), so make positions' device the current one
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        pairs, shifts = calculator.compute(points, box, list(pbc), quantities="PS", copy=True)
    pairs = torch.as_tensor(pairs, device=device).to(torch.int64)  # vesin: uint64
    shifts = torch.as_tensor(shifts, device=device)  # vesin: int32
    # vesin leaves out i == j with a zero shift; mace drops them too: filter, do not assume
    keep = (pairs[:, 0] != pairs[:, 1]) | (shifts != 0).any(dim=1)
    return pairs[keep].T.contiguous(), shifts[keep].to(positions.dtype)


def neighbour_list(positions: Tensor, cell: Tensor, pbc: Pbc,
                   cutoff: float) -> Tuple[Tensor, Tensor]:
    """All pairs closer than ``cutoff``, periodic images included, in mace's convention.

    Equal, as a set of ``(sender, receiver, unit_shift)`` triples, to what
    ``mace.data.neighborhood.get_neighborhood(positions, cutoff, pbc, cell)`` gives; the order
    of the edges is vesin's (unspecified) order, not matscipy's.

    Args:
        positions: ``[N, 3]`` Cartesian positions in Å, any floating dtype, on the CPU or a
            CUDA device; may require grad (it is detached; the list is computed in float64).
        cell: ``[3, 3]``, rows are the cell vectors a, b, c in Å (any device, any real dtype).
            Only the periodic rows are used: a molecule may pass zeros.
        pbc: periodicity along a, b, c.
        cutoff: in Å; pairs with distance ``< cutoff`` are kept.

    Returns:
        ``(edge_index, unit_shifts)`` on positions' device: ``edge_index`` ``[2, E]`` int64
        (row 0 sender ``i``, row 1 receiver ``j``) and ``unit_shifts`` ``[E, 3]`` whole numbers
        in positions' dtype, such that the edge vector is
        ``positions[j] - positions[i] + unit_shifts @ cell``. Each pair appears in both
        directions.

    Raises:
        InputError: positions not ``[N, 3]`` floating or not finite; cell not 3x3; pbc not
            three booleans; cutoff not positive; the periodic cell vectors singular.
    """
    _check_positions_shape(positions)
    pbc = _check_pbc(pbc)
    cutoff = _check_cutoff(cutoff)
    cell64 = _check_cell(cell, pbc)
    _check_positions_finite(positions)
    if positions.shape[0] == 0:
        return _empty(positions)  # vesin refuses an empty system
    return _compute(_thread_calculator(cutoff), positions, cell64, pbc)


def within_cutoff(positions: Tensor, cell: Tensor, edge_index: Tensor, unit_shifts: Tensor,
                  cutoff: float) -> Tuple[Tensor, Tensor]:
    """The edges of a (Verlet) list that are shorter than ``cutoff`` now.

    Args:
        positions: ``[N, 3]`` current positions.
        cell: ``[3, 3]`` the cell the list was built with.
        edge_index: ``[2, E]`` int64, as from :func:`neighbour_list`.
        unit_shifts: ``[E, 3]``, as from :func:`neighbour_list`.
        cutoff: in Å.

    Returns:
        ``(edge_index [2, E'], unit_shifts [E', 3])``, the edges with
        ``|positions[j] - positions[i] + unit_shifts @ cell| < cutoff``, in their order.
    """
    pos = positions.detach().to(torch.float64)
    cell64 = cell.detach().to(device=pos.device, dtype=torch.float64)
    vectors = pos[edge_index[1]] - pos[edge_index[0]] + unit_shifts.to(torch.float64) @ cell64
    keep = (vectors * vectors).sum(dim=1) < float(cutoff) ** 2
    return edge_index[:, keep], unit_shifts[keep]


class VerletNeighbourList:
    """A neighbour list with a skin, rebuilt only when it may have become wrong.

    The list holds every pair closer than ``cutoff + skin`` when it is built. It is reused
    while no atom has moved more than ``skin / 2`` since then, so it still holds every pair
    closer than ``cutoff`` (two atoms close in by at most ``skin`` together), plus some pairs
    between ``cutoff`` and ``cutoff + skin``. It is rebuilt when the cell (compared exactly),
    periodicity or atom count changes, when positions come in another dtype or on another
    device, and on every call with ``skin == 0``. Whether to reuse it is decided on the host (an
    O(N) numpy pass) from float64 copies of the positions and cell: the caller's where it has
    them there (the calculator: what it copies to the device; no wait for the device), else
    copies of the tensors given.

    The extra pairs contribute exactly zero to a standard MACE model: the polynomial cutoff
    envelope, ``envelope(r) * (r < r_max)``, and its derivative are exactly zero there, it
    multiplies the radial features, and the radial MLP (e3nn ``FullyConnectedNet``) has no
    biases, so every weight, message, density and force through those edges is zero. This
    holds for the ``RealAgnostic``, ``RealAgnosticResidual``, ``RealAgnosticDensity`` and
    ``RealAgnosticDensityResidual`` interactions, and for any interaction of a model built
    with ``apply_cutoff=False`` (the envelope then multiplies the final weights). It does NOT
    hold for ``RealAgnosticAttResidual`` / ``RealAgnosticResidualNonLinear`` with
    ``apply_cutoff=True`` (node features and biases enter the radial MLP), nor for the ZBL
    pair repulsion where a covalent-radius sum exceeds ``r_max``: for those, pass the edges
    through :func:`within_cutoff` first.

    Args:
        cutoff: the model's cutoff ``r_max`` in Å.
        skin: extra distance in Å (>= 0); 0 rebuilds on every call.

    Attributes:
        cutoff: as given.
        skin: as given.
        n_builds: how many times the list was built.
    """

    def __init__(self, cutoff: float, skin: float = 0.5) -> None:
        self.cutoff = _check_cutoff(cutoff)
        skin = float(skin)
        if not math.isfinite(skin) or skin < 0:
            raise InputError(f"the Verlet skin must be a finite number >= 0 Å, got {skin}")
        self.skin = skin
        self.n_builds = 0
        self._calculator = None  # vesin NeighborList at cutoff + skin, made on first build
        # positions [N, 3] and cell [3, 3] at the last build, float64 on the host (own copies)
        self._built_for: Optional[Tuple[np.ndarray, np.ndarray]] = None
        self._layout: Optional[Tuple] = None  # _layout() at the last build
        self._edges: Optional[Tuple[Tensor, Tensor]] = None

    def reset(self) -> None:
        """Forget the list: the next :meth:`update` rebuilds."""
        self._built_for = self._layout = self._edges = None

    def update(self, positions: Tensor, cell: Tensor, pbc: Pbc,
               host: Optional[Tuple[np.ndarray, np.ndarray]] = None
               ) -> Tuple[Tensor, Tensor, bool]:
        """The list for the current geometry, rebuilt only if needed.

        Args:
            positions: ``[N, 3]`` floating, CPU or CUDA.
            cell: ``[3, 3]`` rows are the cell vectors.
            pbc: periodicity along a, b, c.
            host: ``(positions [N, 3], cell [3, 3])`` as float64 numpy arrays holding the same
                values as ``positions`` and ``cell``, where the caller has them on the host: the
                reuse check then reads nothing from the device. Default: copies of
                ``positions`` and ``cell`` (on a GPU, a wait for the device).

        Returns:
            ``(edge_index [2, E] int64, unit_shifts [E, 3], rebuilt)`` on positions' device,
            as :func:`neighbour_list` at ``cutoff + skin``. A reused list returns
            the very same tensor objects as the call that built it (callers may cache what
            they derive from them; they must not modify them in place).

        Raises:
            InputError: as :func:`neighbour_list`.
        """
        _check_positions_shape(positions)
        pbc = _check_pbc(pbc)
        if self._edges is not None and self.skin > 0.0 \
                and self._layout == _layout(positions, pbc):
            if self._within_skin(*(host if host is not None else _on_host(positions, cell))):
                edge_index, unit_shifts = self._edges
                return edge_index, unit_shifts, False
        return (*self._build(positions, cell, pbc, host), True)

    def _build(self, positions: Tensor, cell: Tensor, pbc: Pbc,
               host: Optional[Tuple[np.ndarray, np.ndarray]]) -> Tuple[Tensor, Tensor]:
        """Build at ``cutoff + skin`` and remember the geometry it was built for."""
        self.reset()
        cell64 = _check_cell(cell, pbc)
        _check_positions_finite(positions)
        if positions.shape[0] == 0:
            edges = _empty(positions)
        else:
            if self._calculator is None:
                self._calculator = _vesin_calculator(self.cutoff + self.skin)
            edges = _compute(self._calculator, positions, cell64, pbc)
        built_for = host if host is not None else _on_host(positions, cell64)
        self._built_for = tuple(np.array(a, dtype=np.float64) for a in built_for)  # copies
        self._layout = _layout(positions, pbc)
        self._edges = edges
        self.n_builds += 1
        return edges

    def _within_skin(self, positions: np.ndarray, cell: np.ndarray) -> bool:
        """True if the cell is the one the list was built for (compared exactly) and no atom
        has moved more than ``skin / 2`` since (NaN counts as moved)."""
        built_positions, built_cell = self._built_for
        if not np.array_equal(cell, built_cell):
            return False
        delta = positions - built_positions
        return bool(np.einsum("ij,ij->i", delta, delta).max(initial=0.0) <= (0.5 * self.skin) ** 2)


def _layout(positions: Tensor, pbc: Pbc) -> Tuple:
    """What a reuse needs unchanged besides the geometry: the periodicity, and the atom count,
    dtype and device of the positions (the list's tensors are in their dtype, on their
    device)."""
    return pbc, positions.shape, positions.dtype, positions.device


def _on_host(positions: Tensor, cell: Tensor) -> Tuple[np.ndarray, np.ndarray]:
    """``(positions, cell)`` as float64 numpy arrays on the host."""
    return (positions.detach().to("cpu", torch.float64).numpy(),
            torch.as_tensor(cell).detach().to("cpu", torch.float64).numpy())
