"""``MACEAccelCalculator``: an ASE calculator running an accelerated MACE model.

Same results and conventions as mace's ``MACECalculator`` (energy, free energy, forces, per-atom
energies, ASE Voigt stress in eV/Å^3 with ASE's sign), with the interaction blocks fused by
:func:`mace_accel.accelerate`: the generated CUDA kernels on a GPU, the plain-torch reference
backend on CPU. Every structure is validated (:mod:`mace_accel.validation`) before it is batched.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch
from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes
from ase.stress import full_3x3_to_voigt_6_stress

from .accelerate import (PatchReport, accelerate, cuda_unavailable_reason, is_accelerated,
                         verify_against_unpatched)
from .batch import atoms_to_batch, model_info
from .checkpoint import load_model, resolve_device, resolve_dtype
from .errors import (BackendUnavailableError, ConfigError, UnsupportedModelError,
                     VerificationError)
from .patches import PatchRecord, find_blocks
from .tolerances import model_tolerance
from .validation import validate_atoms, validate_head

log = logging.getLogger(__name__)

BACKENDS = ("auto", "cuda", "reference")
FALLBACKS = ("warn", "error")
# relative volume below which a cell is too flat to define a stress
_SINGULAR_CELL = 1e-8


class MACEAccelCalculator(Calculator):
    """ASE calculator for a MACE model with fused interaction blocks.

    Args:
        model: path to a MACE ``.model`` file or a loaded MACE module (modified in place: upgraded,
            cast, moved, accelerated); default: the small Cu/Ni model bundled with mace-accel.
        device: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
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
        **kwargs: passed to ``ase.calculators.calculator.Calculator``.

    Attributes:
        backend: the backend that runs (``"cuda"`` or ``"reference"``).
        report: the :class:`~mace_accel.accelerate.PatchReport` of the surgery.
        model, info, device, dtype, head: what is evaluated, and how.
    """

    implemented_properties = ["energy", "free_energy", "forces", "stress", "energies"]

    def __init__(self, model: Union[str, Path, torch.nn.Module, None] = None,
                 device: Union[str, torch.device] = "cuda", default_dtype: str = "float32",
                 head: Optional[str] = None, compute_stress: bool = True, backend: str = "auto",
                 verify: bool = True, fallback: str = "warn",
                 min_distance: Optional[float] = 0.5, **kwargs) -> None:
        Calculator.__init__(self, **kwargs)
        if backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if fallback not in FALLBACKS:
            raise ConfigError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
        self.dtype = resolve_dtype(default_dtype)
        self.device = resolve_device(device)
        if model is None:
            from .models import default_model_path

            model = default_model_path()
        self.model = load_model(model, device=self.device, dtype=self.dtype)
        if not hasattr(self.model, "atomic_energies_fn"):
            raise UnsupportedModelError(
                f"{type(self.model).__name__} does not predict energies (no atomic_energies_fn); "
                "MACEAccelCalculator needs an energy model (MACE, ScaleShiftMACE, ...)")
        for p in self.model.parameters():  # forces/stress need gradients of inputs only
            p.requires_grad_(False)
        self.info = model_info(self.model)
        self.head = validate_head(head, self.info)
        self.compute_stress = bool(compute_stress)
        self.min_distance = min_distance

        requested = backend if backend != "auto" else (
            "cuda" if self.device.type == "cuda" else "reference")
        if is_accelerated(self.model):
            self.report = self._adopt_accelerated(requested, verify, fallback)
        else:
            self.report = accelerate(self.model, backend=requested, verify=verify,
                                     fallback=fallback)
        self.backend = self.report.backend
        if self.backend != "cuda":
            log.warning("mace-accel: running the %r backend (plain torch) on %s; the fused CUDA "
                        "kernels need device='cuda' on a machine with an NVIDIA GPU",
                        self.backend, self.device)
        else:
            log.info("mace-accel: running the 'cuda' backend on %s", self.device)

    # -- setup ----------------------------------------------------------------------------------
    def _adopt_accelerated(self, requested: str, verify: bool, fallback: str) -> PatchReport:
        """Keep the fused modules of a model saved accelerated; make sure they can run here."""
        fused = [(path, module, patch) for path, module, patch in find_blocks(self.model)
                 if patch.is_applied(module)]
        stored = sorted({module.conv_tp.backend for _, module, _ in fused})
        if "cuda" in stored:
            reason = cuda_unavailable_reason(self.device)
            if reason is not None:
                if fallback == "error":
                    raise BackendUnavailableError(
                        f"the model was saved accelerated with the CUDA backend, which cannot run "
                        f"here: {reason}. Use fallback='warn' to run its reference backend")
                warnings.warn(f"mace-accel: the model was saved with the CUDA backend, which "
                              f"cannot run here ({reason}); using the reference backend",
                              RuntimeWarning, stacklevel=3)
                for _, module, _ in fused:
                    module.conv_tp.backend = "reference"
        active = sorted({module.conv_tp.backend for _, module, _ in fused})
        if active != [requested]:
            log.warning("mace-accel: the model was saved accelerated with backend %s; keeping it "
                        "(requested %r). To change it, mace_accel.revert(model) and load again",
                        "/".join(active), requested)
        records = [PatchRecord(path=path, block=type(module).__name__, patch=patch.name,
                               spec=module.conv_tp.spec, backend=module.conv_tp.backend)
                   for path, module, patch in fused]
        report = PatchReport(backend="/".join(active), requested_backend=requested,
                             records=records)
        if verify:
            report.verification = verify_against_unpatched(self.model)
            report.tolerance = model_tolerance(self.info.dtype)
            bad = {k: v for k, v in report.verification.items() if not v <= report.tolerance}
            if bad:
                raise VerificationError(
                    f"the accelerated checkpoint disagrees with its unpatched modules: {bad} "
                    f"exceeds the relative tolerance {report.tolerance:.0e}.\n{report}")
        return report

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
        validate_atoms(atoms, self.info, min_distance=self.min_distance)
        stress_ok = has_stress(atoms)
        if "stress" in properties and not stress_ok:
            raise PropertyNotImplementedError(
                "stress needs a periodic structure with a 3D cell of non-zero volume (pbc="
                f"{atoms.pbc.tolist()}, volume={abs(np.linalg.det(atoms.cell.array)):.3g} Å^3)")
        want_stress = stress_ok and (self.compute_stress or "stress" in properties)

        batch = atoms_to_batch(atoms, self.info, head=self.head, dtype=self.info.dtype,
                               device=self.device)
        out = self.model(batch, training=False, compute_force=True, compute_stress=want_stress)
        energy = float(out["energy"].detach().reshape(-1)[0].item())
        self.results = {
            "energy": energy,
            "free_energy": energy,
            "forces": _numpy(out["forces"]),
            "energies": _numpy(out["node_energy"]).reshape(-1),
        }
        if want_stress:
            self.results["stress"] = full_3x3_to_voigt_6_stress(_numpy(out["stress"])[0])


def has_stress(atoms) -> bool:
    """True if ``atoms`` is periodic (in some direction) with a 3D cell of non-zero volume."""
    if not np.any(atoms.pbc):
        return False
    cell = np.asarray(atoms.cell.array, dtype=np.float64)
    lengths = np.linalg.norm(cell, axis=1)
    if np.any(lengths == 0.0):
        return False
    return abs(np.linalg.det(cell)) / float(np.prod(lengths)) > _SINGULAR_CELL


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(device="cpu", dtype=torch.float64).numpy()
