"""``MACEAccelCalculator``: an ASE calculator running an accelerated MACE model.

Same results and conventions as mace's ``MACECalculator`` (energy, free energy, forces, per-atom
energies, ASE Voigt stress in eV/Å^3 with ASE's sign), with the interaction blocks fused by
:func:`mace_accel.accelerate`: the generated CUDA kernels on a GPU, the plain-torch reference
backend on CPU. Every structure is validated (:mod:`mace_accel.models.validation`)
before it is batched.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch
from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes
from ase.stress import full_3x3_to_voigt_6_stress

from mace_accel.errors import ConfigError
from mace_accel.models.prepared import prepare_model
from mace_accel.models.resident import ResidentBatch, skin_is_exact
from mace_accel.models.validation import validate_atoms, validate_geometry
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
        compute_stress: compute the stress of every periodic structure; if False, only when
            stress is asked for.
        backend: ``"auto"`` (``"cuda"`` on a GPU, ``"reference"`` on CPU), ``"cuda"`` or
            ``"reference"``.
        verify: check the accelerated model against the unpatched one on a random structure.
        fallback: when the CUDA backend cannot run: ``"warn"`` (warn and use the reference
            backend) or ``"error"``.
        min_distance: smallest interatomic distance accepted in Å (None disables the check).
        deterministic: CUDA backend: no float atomics, bit-identical repeats (the default).
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
        backend: the backend that runs (``"cuda"`` or ``"reference"``).
        report: the :class:`~mace_accel.surgery.PatchReport` of the surgery.
        options: the options in effect (backend resolved).
        model, info, device, dtype, head: what is evaluated, and how.
    """

    implemented_properties = ["energy", "free_energy", "forces", "stress", "energies"]

    def __init__(self, model: Union[str, Path, torch.nn.Module, None] = None,
                 device: Union[str, torch.device] = "auto", default_dtype: str = "float32",
                 head: Optional[str] = None, compute_stress: bool = True, backend: str = "auto",
                 verify: bool = True, fallback: str = "warn",
                 min_distance: Optional[float] = 0.5, deterministic: bool = True,
                 graphs: Optional[bool] = None, skin: float = 0.3,
                 options: Optional[AccelOptions] = None, **kwargs) -> None:
        Calculator.__init__(self, **kwargs)
        requested = make_options(options, backend=backend, verify=verify, fallback=fallback,
                                 deterministic=deterministic)
        prepared = prepare_model(model, device, default_dtype, head, requested)
        self.model, self.info, self.head = prepared.model, prepared.info, prepared.head
        self.device, self.dtype = prepared.device, prepared.dtype
        self.report: PatchReport = prepared.report
        self.options = self.report.options
        self.backend = self.report.backend
        self.compute_stress = bool(compute_stress)
        self.min_distance = min_distance
        self._resident = ResidentBatch(self.info, self.head, self.info.dtype, self.device,
                                       skin=_check_skin(skin),
                                       exact_skin=skin_is_exact(self.model))
        self.graphs = _resolve_graphs(graphs, self.device)
        self._graphed = None
        if self.graphs:
            from mace_accel.capture import GraphedCall

            self._graphed = GraphedCall(self.model, self.info.r_max)
        log.info("mace-accel: whole-call CUDA graphs %s; neighbour list skin %.2f Å",
                 "on" if self.graphs else "off", self._resident.skin)

    # -- ASE interface ----------------------------------------------------------------------------
    def calculate(self, atoms=None, properties: Sequence[str] = ("energy",),
                  system_changes=all_changes) -> None:
        """Energy, free energy, forces, per-atom energies and (periodic cells) stress.

        Results are float64 numpy: ``energy`` and ``free_energy`` (eV), ``forces [N, 3]`` (eV/Å),
        ``energies [N]`` (eV, per-atom energies including the atomic reference energies),
        ``stress [6]`` (Voigt xx, yy, zz, yz, xz, xy; eV/Å^3; ASE's sign: positive = tensile).
        """
        Calculator.calculate(self, atoms, properties, system_changes)
        atoms = self.atoms
        new_topology = (self._resident.topology(atoms) != self._resident._topology
                        or bool(_TOPOLOGY_CHANGES & set(system_changes)))
        if new_topology:  # everything, on the host, once per structure
            validate_atoms(atoms, self.info, min_distance=self.min_distance)
        else:             # per step: O(N) on the host, distances from the edges on the device
            validate_geometry(atoms)
        stress_ok = has_stress(atoms)
        if "stress" in properties and not stress_ok:
            raise PropertyNotImplementedError(
                "stress needs a periodic structure with a 3D cell of non-zero volume (pbc="
                f"{atoms.pbc.tolist()}, volume={abs(np.linalg.det(atoms.cell.array)):.3g} Å^3)")
        want_stress = stress_ok and (self.compute_stress or "stress" in properties)

        batch = self._resident.batch(atoms)
        if not new_topology and self.min_distance:
            if self._resident.shortest_distance(batch) < self.min_distance:
                validate_atoms(atoms, self.info, min_distance=self.min_distance)  # says who
        if self._graphed is not None:
            out = self._graphed(batch, compute_stress=want_stress)
        else:
            out = self.model(batch, training=False, compute_force=True,
                             compute_stress=want_stress)
        self.results = _results(out, len(atoms), want_stress)


def _results(out, n_atoms: int, with_stress: bool) -> dict:
    """ASE results from the model's outputs, with one copy from the device."""
    parts = [out["energy"].detach().reshape(-1)[:1], out["node_energy"].detach().reshape(-1),
             out["forces"].detach().reshape(-1)]
    if with_stress:
        parts.append(out["stress"].detach().reshape(-1)[:9])
    flat = torch.cat([p.to(torch.float64) for p in parts]).cpu().numpy()
    energy = float(flat[0])
    results = {"energy": energy, "free_energy": energy,
               "energies": flat[1:1 + n_atoms].copy(),
               "forces": flat[1 + n_atoms:1 + 4 * n_atoms].reshape(n_atoms, 3).copy()}
    if with_stress:
        results["stress"] = full_3x3_to_voigt_6_stress(flat[1 + 4 * n_atoms:].reshape(3, 3))
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
