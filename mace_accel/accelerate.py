"""``accelerate(model)`` / ``revert(model)``: the one entry to model surgery."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import warnings
from typing import Any, Dict, Iterator, List, Optional

import torch

from .errors import (BackendUnavailableError, MaceAccelError, UnsupportedModelError,
                     VerificationError)
from .patches import PatchRecord, find_blocks
from .tolerances import model_tolerance, rel_norm_error

BACKENDS = ("cuda", "reference")
FALLBACKS = ("error", "warn")


@dataclasses.dataclass
class PatchReport:
    """What :func:`accelerate` did to a model.

    Attributes:
        backend: the backend now active in the patched blocks.
        requested_backend: what the caller asked for (differs only after a warned fallback).
        records: one entry per block found, patched or left (with the reason).
        verification: ``{quantity: relative error}`` of patched vs unpatched, if verified.
        tolerance: the model-level tolerance the verification used.
    """

    backend: str
    requested_backend: str
    records: List[PatchRecord]
    verification: Dict[str, float] = dataclasses.field(default_factory=dict)
    tolerance: Optional[float] = None

    @property
    def patched(self) -> List[PatchRecord]:
        return [r for r in self.records if r.patched]

    @property
    def skipped(self) -> List[PatchRecord]:
        return [r for r in self.records if not r.patched]

    def to_dict(self) -> dict:
        return {
            "backend": self.backend,
            "requested_backend": self.requested_backend,
            "blocks": [{"path": r.path, "block": r.block, "patch": r.patch,
                        "patched": r.patched, "skipped": r.skipped,
                        "tensor_product": r.spec.describe() if r.spec else None}
                       for r in self.records],
            "verification": self.verification,
            "tolerance": self.tolerance,
        }

    def __str__(self) -> str:
        lines = [f"mace-accel: backend {self.backend!r}, {len(self.patched)} of "
                 f"{len(self.records)} blocks patched"]
        for r in self.records:
            what = f"patched ({r.spec.describe()})" if r.patched and r.spec else f"left: {r.skipped}"
            lines.append(f"  {r.path:<16} {r.block:<46} {what}")
        if self.verification:
            errs = ", ".join(f"{k} {v:.1e}" for k, v in self.verification.items())
            lines.append(f"  verified against the unpatched model: {errs} (tolerance {self.tolerance:.0e})")
        return "\n".join(lines)


def _check_model(model: torch.nn.Module) -> None:
    if isinstance(model, torch.jit.ScriptModule):
        raise UnsupportedModelError(
            "got a TorchScript (compiled) model; mace-accel patches the Python model. Load the "
            "original .model file with torch.load instead of the compiled one")
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModelError(f"expected a MACE torch.nn.Module, got {type(model).__name__}")
    if not hasattr(model, "interactions"):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a MACE model (it has no 'interactions'); "
            "pass a model loaded from a MACE checkpoint")


def _model_device(model: torch.nn.Module) -> torch.device:
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


def cuda_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the CUDA backend cannot run for a model on ``device``, or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch (torch.cuda.is_available() is False)"
    if device.type != "cuda":
        return f"the model is on {device}; move it to the GPU first (model.to('cuda'))"
    from .runtime import cupy_unavailable_reason

    return cupy_unavailable_reason()


def accelerate(model: torch.nn.Module, backend: str = "cuda", verify: bool = True, *,
               fallback: str = "error", deterministic: bool = True,
               check_indices: bool = False) -> PatchReport:
    """Patch every fusable interaction block of a loaded MACE model in place.

    Args:
        model: a loaded MACE model (``MACE``, ``ScaleShiftMACE``, any head count), on the device
            it will run on.
        backend: ``"cuda"`` (generated kernels) or ``"reference"`` (plain torch, any device).
        verify: run a small random structure through the patched and the unpatched model and
            raise :class:`VerificationError` (leaving the model unpatched) if they disagree
            beyond the tolerance table.
        fallback: what to do when ``backend="cuda"`` cannot run: ``"error"`` raises
            :class:`BackendUnavailableError`; ``"warn"`` warns and uses ``"reference"``.
        deterministic: CUDA backend: no float atomics, bit-identical repeats.
        check_indices: check edge_index ranges before every launch (synchronises; for debugging).

    Returns:
        a :class:`PatchReport` listing every block found, what was replaced and what was left.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    _check_model(model)
    requested = backend
    if backend == "cuda":
        reason = cuda_unavailable_reason(_model_device(model))
        if reason is not None:
            if fallback == "error":
                raise BackendUnavailableError(
                    f"the CUDA backend cannot run: {reason}. Use backend='reference' (plain "
                    "torch) or fallback='warn' to fall back with a warning")
            warnings.warn(f"mace-accel: CUDA backend unavailable ({reason}); using the "
                          "reference (plain torch) backend instead", RuntimeWarning, stacklevel=2)
            backend = "reference"

    records: List[PatchRecord] = []
    for path, module, patch in list(find_blocks(model)):
        reason = patch.skip_reason(module)
        if reason is not None:
            records.append(PatchRecord(path=path, block=type(module).__name__, patch=patch.name,
                                       skipped=reason))
            continue
        records.append(patch.apply(path, module, backend, deterministic=deterministic,
                                   check_indices=check_indices))
    if not records:
        raise UnsupportedModelError(
            f"found no MACE interaction blocks in {type(model).__name__}; is this a MACE model?")
    report = PatchReport(backend=backend, requested_backend=requested, records=records)
    if verify and report.patched:
        try:
            report.verification = verify_against_unpatched(model)
        except Exception:
            revert(model)
            raise
        report.tolerance = model_tolerance(_model_dtype(model))
        bad = {k: v for k, v in report.verification.items() if not v <= report.tolerance}
        if bad:
            revert(model)
            raise VerificationError(
                f"the accelerated model disagrees with the unpatched one: {bad} exceeds the "
                f"relative tolerance {report.tolerance:.0e}; the model was left unpatched.\n"
                f"{report}")
    return report


def plan(model: torch.nn.Module) -> List[Dict[str, Any]]:
    """What :func:`accelerate` would do to each interaction block of ``model``, changing nothing.

    Returns:
        one dict per block found, in model order: ``{"path", "block", "irreps_in1",
        "irreps_in2", "irreps_out", "paths", "weight_numel", "status", "reason", "backend"}``.
        ``status`` is ``"accelerated"`` (with the active ``backend``), ``"would be patched"`` or
        ``"left"`` (with ``reason``); the tensor-product fields are None where the block's
        ``conv_tp`` is not an e3nn tensor product (e.g. cuEquivariance).
    """
    from .patches.conv_tp import FusedConvTP
    from .spec import spec_from_e3nn

    blocks: List[Dict[str, Any]] = []
    for path, module, patch in find_blocks(model):
        tp = module.conv_tp
        applied = patch.is_applied(module)
        spec = tp.spec if isinstance(tp, FusedConvTP) else None
        if spec is None:
            try:
                spec = spec_from_e3nn(tp)
            except MaceAccelError:
                spec = None  # not an e3nn TP (e.g. cuEquivariance); skip_reason says so
        reason = None if applied else patch.skip_reason(module)
        status = ("accelerated" if applied else "would be patched" if reason is None else "left")
        blocks.append({
            "path": path, "block": type(module).__name__,
            "irreps_in1": spec.irreps_str("in1") if spec else None,
            "irreps_in2": spec.irreps_str("in2") if spec else None,
            "irreps_out": spec.irreps_str("out") if spec else None,
            "paths": len(spec.paths) if spec else None,
            "weight_numel": spec.weight_numel if spec else None,
            "status": status, "reason": reason,
            "backend": tp.backend if applied else None,
        })
    return blocks


def revert(model: torch.nn.Module) -> int:
    """Undo :func:`accelerate` in place; returns the number of blocks restored."""
    n = 0
    for _, module, patch in list(find_blocks(model)):
        if patch.is_applied(module):
            patch.revert(module)
            n += 1
    return n


def is_accelerated(model: torch.nn.Module) -> bool:
    return any(patch.is_applied(m) for _, m, patch in find_blocks(model))


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


@contextlib.contextmanager
def unpatched(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Temporarily restore the original e3nn modules (for side-by-side comparison)."""
    saved = [(module, patch, patch.revert(module))
             for _, module, patch in list(find_blocks(model)) if patch.is_applied(module)]
    try:
        yield model
    finally:
        for module, patch, state in saved:
            patch.reattach(module, state)


def evaluate(model: torch.nn.Module, batch: Dict[str, torch.Tensor],
             compute_stress: bool) -> Dict[str, torch.Tensor]:
    """Energy, forces (and stress) of one batch, detached."""
    out = model(dict(batch), training=False, compute_force=True, compute_stress=compute_stress)
    keep = ("energy", "forces", "stress") if compute_stress else ("energy", "forces")
    return {k: out[k].detach() for k in keep if out.get(k) is not None}


def verify_against_unpatched(model: torch.nn.Module, seed: int = 0) -> Dict[str, float]:
    """Relative errors of patched vs unpatched energy/forces/stress on a random structure."""
    from .batch import atoms_to_batch, model_info, random_structure

    info = model_info(model)
    atoms = random_structure(info.atomic_numbers, n_atoms=8, r_max=info.r_max, seed=seed)
    batch = atoms_to_batch(atoms, info, device=_model_device(model))
    stress = type(model).__name__ in ("MACE", "ScaleShiftMACE")
    patched = evaluate(model, batch, stress)
    with unpatched(model):
        plain = evaluate(model, batch, stress)
    return {k: rel_norm_error(patched[k], plain[k]) for k in plain}
