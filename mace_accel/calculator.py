"""``MACEAccelCalculator``: an ASE calculator running an accelerated MACE model.

Same results and conventions as mace's ``MACECalculator`` (energy, free energy, forces, per-atom
energies, ASE Voigt stress in eV/Å^3 with ASE's sign), with the interaction blocks fused by
:func:`mace_accel.accelerate`: the generated CUDA kernels on a GPU, the plain-torch reference
backend on CPU. Every structure is validated (:mod:`mace_accel.models.validation`)
before it is batched.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes
from ase.stress import full_3x3_to_voigt_6_stress

from mace_accel.capture import GRAPH_MAX_EDGES, CaptureError, PinnedResults, pack, unpack
from mace_accel.errors import ConfigError, InputError
from mace_accel.models.atoms_state import changed_properties
from mace_accel.models.batch import model_info
from mace_accel.models.outputs import evaluate as evaluate_model
from mace_accel.prepared import prepare_model
from mace_accel.models.resident import ResidentBatch, skin_is_exact
from mace_accel.models.validation import (validate_atoms, validate_geometry, validate_head,
                                          validate_positions)
from mace_accel.options import AccelOptions, make_options
from mace_accel.surgery import PatchReport

log = logging.getLogger(__name__)

# relative volume below which a cell is too flat to define a stress
_SINGULAR_CELL = 1e-8
# changes that need a new batch template (and the full validation); positions and cell do not
_TOPOLOGY_CHANGES = frozenset({"numbers", "pbc", "initial_charges", "initial_magmoms"})


class MACEAccelCalculator(Calculator):
    """ASE calculator for a MACE model with fused interaction blocks.

    Args:
        model: path to a MACE ``.model`` file or a loaded MACE module (modified in place: upgraded,
            cast, moved, accelerated); default: the small Cu/Ni model bundled with mace-accel.
        device: ``"auto"`` (a GPU if torch sees one, else the CPU), ``"cuda"``, ``"cuda:N"`` or
            ``"cpu"``.
        default_dtype: ``"float32"`` (MD) or ``"float64"`` (optimisation, finite differences);
            the model is cast to it; torch's global default dtype is never changed.
        head: head of a multi-head model (default: the only head, or the one named "default").
        compute_stress: compute the stress of every periodic structure in every call; if False
            (the default), only when stress is asked for (``get_stress``, NPT integrators,
            cell filters), so MD and relaxations of positions do not pay for it.
        backend: ``"auto"`` (``"cuda"`` on a GPU, ``"mace"`` on a CPU: the model as mace built
            it, faster there than the reference backend), ``"cuda"``, ``"reference"`` or
            ``"mace"``.
        verify: check the accelerated model against the unpatched one on a random structure.
        fallback: when the CUDA backend cannot run: ``"warn"`` (warn and use the reference
            backend) or ``"error"``.
        min_distance: smallest interatomic distance accepted in Å (None disables the check).
        deterministic: CUDA backend: no float atomics in mace-accel's kernels, bit-identical
            forces and stress on repeats (the default; see
            :class:`~mace_accel.options.AccelOptions`).
        graphs: replay each energy+forces call as one CUDA graph per shape bucket
            (:mod:`mace_accel.capture`); None (default) = on for a GPU, off on the CPU; True on a
            CPU is an error.
        skin: Verlet skin of the neighbour list in Å: the list (built on the model's device
            with vesin) is rebuilt only when an atom has moved more than ``skin / 2``; 0 rebuilds
            it every call.
        options: all acceleration options at once (:class:`~mace_accel.options.AccelOptions`);
            the keyword arguments above override its fields.
        **kwargs: passed to ``ase.calculators.calculator.Calculator``.

    Attributes:
        backend: the backend that runs (``"cuda"``, ``"reference"`` or ``"mace"``).
        report: the :class:`~mace_accel.surgery.PatchReport` of the surgery.
        options: the options in effect (backend resolved).
        model, info, device, dtype, head: what is evaluated, and how.
        timings: :class:`CallTimings` of the calls so far (checks, neighbour list, model).
    """

    implemented_properties = ["energy", "free_energy", "forces", "stress", "energies"]

    def __init__(self, model: Union[str, Path, torch.nn.Module, None] = None,
                 device: Union[str, torch.device] = "auto", default_dtype: str = "float32",
                 head: Optional[str] = None, compute_stress: bool = False, backend: str = "auto",
                 verify: bool = True, fallback: str = "warn",
                 min_distance: Optional[float] = 0.5, deterministic: bool = True,
                 graphs: Optional[bool] = None, skin: float = 0.3,
                 options: Optional[AccelOptions] = None, **kwargs) -> None:
        Calculator.__init__(self, **kwargs)
        requested = make_options(options, backend=backend, verify=verify, fallback=fallback,
                                 deterministic=deterministic)
        prepared = prepare_model(model, device, default_dtype, head, requested)
        self.model, self.info, self._head = prepared.model, prepared.info, prepared.head
        self.device, self.dtype = prepared.device, prepared.dtype
        self.report: PatchReport = prepared.report
        self.options = self.report.options
        self.backend = self.report.backend
        self.compute_stress = bool(compute_stress)
        self.min_distance = min_distance
        self.timings = CallTimings()
        self._skin = _check_skin(skin)
        self.graphs = _resolve_graphs(graphs, self.device)
        self._graphed = None
        self._results = PinnedResults()  # where the packed results land
        if self.graphs:
            from mace_accel.capture import GraphedCall

            self._graphed = GraphedCall(self.model, self.info.r_max)
        self._new_structure_state()
        log.info("mace-accel: whole-call CUDA graphs %s; neighbour list skin %.2f Å",
                 "on" if self.graphs else "off", self._resident.skin)

    def _new_structure_state(self) -> None:
        """The per-structure state for the model as it is now: the resident batch (in the
        model's dtype, for the head), the validated cell, the parameter the model is followed
        by (:meth:`_follow_model`)."""
        self._resident = ResidentBatch(self.info, self._head, self.info.dtype, self.device,
                                       skin=self._skin, exact_skin=skin_is_exact(self.model),
                                       skin_edges_up_to=GRAPH_MAX_EDGES)
        self._cell_key: Optional[Tuple[bytes, bytes]] = None  # cell and pbc last validated
        self._stress_ok = False
        self._followed = next(self.model.parameters(), None)

    # -- following the model ----------------------------------------------------------------------
    @property
    def head(self) -> str:
        """The head evaluated; set it to evaluate another of the model's heads."""
        return self._head

    @head.setter
    def head(self, head: str) -> None:
        chosen = validate_head(head, self.info)
        if chosen != self._head:
            self._head = chosen
            self._reset_model_state()

    def reset(self) -> None:
        """Clear the results (ASE's ``reset``) and everything derived from the model: its
        captured CUDA graphs and the structure's batch; the model's dtype, device and heads are
        read again. Call it after changing ``calc.model`` (weights in place are followed
        without it; new modules, heads or parameter objects need it)."""
        Calculator.reset(self)
        if "_resident" in self.__dict__:  # ASE's __init__ resets before ours has run
            self._reset_model_state()

    def _reset_model_state(self) -> None:
        self._check_device()
        self.info = model_info(self.model)
        self.dtype = self.info.dtype
        self._head = validate_head(self._head if self._head in self.info.heads else None,
                                   self.info)
        if self._graphed is not None:
            self._graphed.drop("the calculator was reset")
        self._new_structure_state()

    def _follow_model(self) -> None:
        """Before a call: a model cast to another dtype since the last call is followed (new
        batch, new graphs); one moved to another device is refused (:meth:`_check_device`)."""
        p = self._followed
        if p is not None and (p.dtype != self.dtype or p.device != self.device):
            self._reset_model_state()

    def _check_device(self) -> None:
        p = next(self.model.parameters(), None)
        if p is not None and p.device != self.device:
            raise InputError(
                f"the calculator's model is on {p.device} now but the calculator runs on "
                f"{self.device}; move the model back (calc.model.to('{self.device}')) or make a "
                "new MACEAccelCalculator(model=calc.model, device=...)")

    # -- ASE interface ----------------------------------------------------------------------------
    def check_state(self, atoms, tol: float = 1e-15) -> list:
        """ASE's system changes since the last calculation (same answer as ASE's
        ``compare_atoms``, without its ``allclose`` on properties that are exactly equal)."""
        return changed_properties(self.atoms, atoms, tol, getattr(self, "ignored_changes", ()))

    def calculate(self, atoms=None, properties: Sequence[str] = ("energy",),
                  system_changes=all_changes) -> None:
        """Energy, free energy, forces, per-atom energies and (periodic cells) stress.

        Results are float64 numpy: ``energy`` and ``free_energy`` (eV), ``forces [N, 3]`` (eV/Å),
        ``energies [N]`` (eV, per-atom energies including the atomic reference energies),
        ``stress [6]`` (Voigt xx, yy, zz, yz, xz, xy; eV/Å^3; ASE's sign: positive = tensile).
        """
        t_start = time.perf_counter()
        self._follow_model()
        Calculator.calculate(self, atoms, properties, system_changes)
        atoms = self.atoms
        new_topology = (self._resident.topology(atoms) != self._resident._topology
                        or bool(_TOPOLOGY_CHANGES & set(system_changes)))
        stress_ok = self._validate(atoms, new_topology)
        if "stress" in properties and not stress_ok:
            raise PropertyNotImplementedError(
                "stress needs a periodic structure with a 3D cell of non-zero volume (pbc="
                f"{atoms.pbc.tolist()}, volume={abs(np.linalg.det(atoms.cell.array)):.3g} Å^3)")
        want_stress = stress_ok and (self.compute_stress or "stress" in properties)

        t_checked = time.perf_counter()
        batch = self._resident.batch(atoms)
        t_listed = time.perf_counter()
        results, shortest = self._call(batch, len(atoms), want_stress)
        if not new_topology and self.min_distance and shortest < self.min_distance:
            validate_atoms(atoms, self.info, min_distance=self.min_distance)  # says who
        self.results = results
        self.timings.add(t_start, t_checked, t_listed, time.perf_counter())

    def _validate(self, atoms, new_topology: bool) -> bool:
        """Check ``atoms`` (everything for a new topology, else finite positions and, when it
        changed, the cell: distances come from the edges on the device); whether it has a
        stress."""
        cell_key = (atoms.cell.array.tobytes(), np.asarray(atoms.pbc).tobytes())
        if new_topology:  # everything, on the host, once per structure
            validate_atoms(atoms, self.info, min_distance=self.min_distance)
        elif cell_key == self._cell_key:
            validate_positions(atoms)
        else:
            validate_geometry(atoms)
        if cell_key != self._cell_key:
            self._cell_key, self._stress_ok = cell_key, has_stress(atoms)
        return self._stress_ok

    def _call(self, batch: Dict[str, torch.Tensor], n_atoms: int, want_stress: bool
              ) -> Tuple[dict, float]:
        """One model call (a graph replay, or eager), its results copied to the host at once
        with the shortest interatomic distance.

        Returns:
            ``(ASE results, shortest distance in Å)``.
        """
        if self._graphed is not None and batch["edge_index"].shape[1] <= GRAPH_MAX_EDGES:
            try:
                out = self._graphed(batch, compute_stress=want_stress)
            except CaptureError as exc:
                warnings.warn(f"mace-accel: this model's call cannot be captured in a CUDA "
                              f"graph ({exc}); the calculator runs it without graphs (slower "
                              "for small systems)", RuntimeWarning, stacklevel=4)
                self._graphed = None
                self.graphs = False
                torch.cuda.synchronize(self.device)
            else:
                packed, shortest = unpack(self._results.fetch(out["packed"]), n_atoms,
                                          out["n_pad"], want_stress)
                return _ase_results(packed, want_stress), shortest
        out = evaluate_model(self.model, batch, want_stress)
        packed = pack(batch, out, want_stress).cpu().numpy()
        results, shortest = unpack(packed, n_atoms, n_atoms, want_stress)
        return _ase_results(results, want_stress), shortest


@dataclasses.dataclass
class CallTimings:
    """Where the calculator's calls spent their time (host clock; each call ends with the one
    copy of its results from the device, so the model part includes the GPU's work).

    Attributes:
        calls: number of calls.
        checks_s: input checks and ASE bookkeeping.
        neighbours_s: the batch update: positions to the device, neighbour list (reuse check
            or rebuild).
        model_s: the model call (graph replay or eager) and the results' copy to the host.
    """

    calls: int = 0
    checks_s: float = 0.0
    neighbours_s: float = 0.0
    model_s: float = 0.0

    def add(self, start: float, checked: float, listed: float, done: float) -> None:
        self.calls += 1
        self.checks_s += checked - start
        self.neighbours_s += listed - checked
        self.model_s += done - listed

    def per_call_ms(self) -> Dict[str, float]:
        """Mean milliseconds per call of each part (empty before the first call)."""
        if not self.calls:
            return {}
        return {name: 1e3 * getattr(self, f"{name}_s") / self.calls
                for name in ("checks", "neighbours", "model")}


def _ase_results(out: dict, with_stress: bool) -> dict:
    """ASE's result names and conventions from host arrays of the model's outputs."""
    energy = float(out["energy"])
    results = {"energy": energy, "free_energy": energy,
               "energies": np.array(out["node_energy"], dtype=np.float64),
               "forces": np.array(out["forces"], dtype=np.float64)}
    if with_stress:
        results["stress"] = full_3x3_to_voigt_6_stress(np.asarray(out["stress"]).reshape(3, 3))
    return results


def _resolve_graphs(graphs: Optional[bool], device: torch.device) -> bool:
    if graphs is None:
        return torch.device(device).type == "cuda"
    if not isinstance(graphs, bool):
        raise ConfigError(f"graphs must be True, False or None (auto), got {graphs!r}")
    if graphs and torch.device(device).type != "cuda":
        raise ConfigError(f"graphs=True needs a CUDA device, the calculator runs on {device}; "
                          "use graphs=None (auto) or False")
    return graphs


def _check_skin(skin: float) -> float:
    if isinstance(skin, bool) or not isinstance(skin, (int, float)) or not np.isfinite(skin) \
            or skin < 0:
        raise ConfigError(f"skin must be a finite number of Å >= 0, got {skin!r}")
    return float(skin)


def has_stress(atoms) -> bool:
    """True if ``atoms`` is periodic (in some direction) with a 3D cell of non-zero volume."""
    if not np.any(atoms.pbc):
        return False
    cell = np.asarray(atoms.cell.array, dtype=np.float64)
    lengths = np.linalg.norm(cell, axis=1)
    if np.any(lengths == 0.0):
        return False
    return abs(np.linalg.det(cell)) / float(np.prod(lengths)) > _SINGULAR_CELL


def mace_mp(model: Union[str, Path, None] = "medium", device: str = "auto",
            default_dtype: str = "float32", **kwargs) -> MACEAccelCalculator:
    """A :class:`MACEAccelCalculator` with a MACE-MP foundation model (89 elements).

    Args:
        model: a MACE-MP name of mace's table (``"small"``, ``"medium"``, ``"large"``,
            ``"medium-mpa-0"``, ...), an ``https://`` URL, or a local path; None means mace's own
            default. Names, URLs and the download cache are mace's own.
        device, default_dtype, **kwargs: as :class:`MACEAccelCalculator`.
    """
    from mace_accel.models.foundations import mace_mp_file

    return MACEAccelCalculator(model=mace_mp_file(model), device=device,
                               default_dtype=default_dtype, **kwargs)


def mace_off(model: Union[str, Path, None] = "medium", device: str = "auto",
             default_dtype: str = "float64", **kwargs) -> MACEAccelCalculator:
    """A :class:`MACEAccelCalculator` with a MACE-OFF23 organic force field (ASL licence).

    Args:
        model: ``"small"``, ``"medium"``, ``"large"`` (mace's table), an ``https://`` URL, or a
            local path.
        default_dtype: ``"float64"`` by default, as mace's ``mace_off``.
        device, **kwargs: as :class:`MACEAccelCalculator`.
    """
    from mace_accel.models.foundations import mace_off_file

    return MACEAccelCalculator(model=mace_off_file(model), device=device,
                               default_dtype=default_dtype, **kwargs)
