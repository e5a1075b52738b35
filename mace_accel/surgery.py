"""``accelerate(model)`` / ``revert(model)``: the one entry to model surgery.

Surgery itself lives in :mod:`mace_accel.patches`; this module only walks the patch kinds
through their interface (``applies_to``, ``describe``, ``apply``, ``revert``, ``is_applied``),
resolves the backend, and verifies the result against the unpatched model
(:func:`verify_or_revert`, used by every path that patches a model).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from mace_accel.errors import BackendUnavailableError, UnsupportedModelError, VerificationError
from mace_accel import coverage, state
from mace_accel.models import energy_head
from mace_accel.models.batch import model_dtype
from mace_accel.ops.runtime import cuda_unavailable_reason
from mace_accel.options import MACE_BACKEND, AccelOptions, make_options
from mace_accel.patches import PatchRecord, find_blocks, link_across_blocks
from mace_accel.tolerances import energy_error, model_tolerance, rel_norm_error

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PatchReport:
    """What :func:`accelerate` did to a model.

    Attributes:
        backend: the backend now active in the patched blocks.
        requested_backend: what the caller asked for (differs only after a warned fallback).
        records: one entry per module found, with each part fused or left (and why).
        options: the :class:`~mace_accel.options.AccelOptions` used (backend resolved).
        verification: ``{quantity: relative error}`` of patched vs unpatched, if verified.
        tolerance: the model-level tolerance the verification used.
        notes: what applies across blocks (the radial MLPs' overlap).
        mace_built: the modules that run as mace built them, and why
            (:func:`mace_accel.coverage.mace_built`).
    """

    backend: str
    requested_backend: str
    records: List[PatchRecord]
    options: AccelOptions = dataclasses.field(default_factory=AccelOptions)
    verification: Dict[str, float] = dataclasses.field(default_factory=dict)
    tolerance: Optional[float] = None
    notes: List[str] = dataclasses.field(default_factory=list)
    mace_built: List[Any] = dataclasses.field(default_factory=list)

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
            "options": self.options.to_dict(),
            "blocks": [r.to_dict() for r in self.records],
            "verification": self.verification,
            "tolerance": self.tolerance,
            "notes": list(self.notes),
            "mace_built": [m.to_dict() for m in self.mace_built],
        }

    def __str__(self) -> str:
        if self.backend == MACE_BACKEND:
            return "\n".join([f"mace-accel: backend {self.backend!r}, nothing patched"]
                             + [f"  {note}" for note in self.notes])
        lines = [f"mace-accel: backend {self.backend!r} (deterministic="
                 f"{self.options.deterministic}), {len(self.patched)} of {len(self.records)} "
                 f"block groups patched, {len(self.mace_built)} module(s) run as mace built "
                 "them (listed last)"]
        for r in self.records:
            if r.skipped_reason is not None:
                lines.append(f"  {r.path or '(model)':<16} {r.block:<46} left: {r.skipped_reason}")
                continue
            lines.append(f"  {r.path or '(model)':<16} {r.block}")
            for p in r.parts:
                lines.append(f"    {p.part:<22} {'fused' if p.fused else 'left'}: {p.detail}")
        lines.extend(f"  {note}" for note in self.notes)
        if self.mace_built:
            lines.append("  runs as mace built it:")
            lines.extend(f"    {m.path or '(model)':<28} {m.block}: {m.why}"
                         for m in self.mace_built)
        if self.verification:
            errs = ", ".join(f"{k} {v:.1e}" for k, v in self.verification.items())
            lines.append(f"  verified against the unpatched model: {errs} (tolerance "
                         f"{self.tolerance:.0e})")
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


def model_device(model: torch.nn.Module) -> torch.device:
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


def start_compiles(model: torch.nn.Module) -> None:
    """Start compiling, on background threads, the CUDA kernels the fused modules of ``model``
    launch in a forces call, in its dtype and on its device: the first call (the check against
    the plain model, or the user's) then finds them compiled or compiling, instead of compiling
    them one after another as it reaches them; the longest first
    (:func:`~mace_accel.ops.runtime.compiles_longest_first`). A module whose head start fails
    is left to compile (and report) when it is called."""
    from mace_accel.ops.runtime import compiles_longest_first
    from mace_accel.patches.adopt import FusedModule

    dtype, device = model_dtype(model), model_device(model)
    with compiles_longest_first():
        for module in model.modules():
            if isinstance(module, FusedModule):
                try:
                    module.start_compiles(dtype, device)
                except Exception as exc:  # the call compiles what it launches, raises there
                    log.debug("mace-accel: no head start for %s's kernels (%s)",
                              module.describe(), exc)


def resolve_backend(options: AccelOptions, device: torch.device,
                    stacklevel: int = 3) -> AccelOptions:
    """``options`` with the backend that will run for a model on ``device``.

    ``auto`` becomes ``cuda`` on a GPU and ``reference`` elsewhere; ``cuda`` that cannot run
    raises :class:`BackendUnavailableError` (``fallback="error"``) or warns and becomes
    ``reference`` (``fallback="warn"``).
    """
    options = options.for_device(device)
    if options.backend != "cuda":
        return options
    reason = cuda_unavailable_reason(device)
    if reason is None:
        return options
    if options.fallback == "error":
        raise BackendUnavailableError(
            f"the CUDA backend cannot run: {reason}. Use backend='reference' (plain torch) or "
            "fallback='warn' to fall back with a warning")
    warnings.warn(f"mace-accel: CUDA backend unavailable ({reason}); using the reference (plain "
                  "torch) backend instead", RuntimeWarning, stacklevel=stacklevel)
    return options.replace(backend="reference")


def accelerate(model: torch.nn.Module, backend: Optional[str] = None,
               verify: Optional[bool] = None, *, options: Optional[AccelOptions] = None,
               fallback: Optional[str] = None, deterministic: Optional[bool] = None,
               check_indices: Optional[bool] = None,
               parts: Optional[Tuple[str, ...]] = None) -> PatchReport:
    """Patch every fusable part of a loaded MACE model in place.

    Args:
        model: a loaded MACE model (``MACE``, ``ScaleShiftMACE``, any head count), on the device
            it will run on.
        backend: ``"cuda"`` (generated kernels), ``"reference"`` (plain torch, any device) or
            ``"auto"`` (cuda for a model on a GPU).
        verify: run a small random structure through the patched and the unpatched model and
            raise :class:`VerificationError` (leaving the model unpatched) if they disagree
            beyond the tolerance table.
        options: all options at once (:class:`~mace_accel.options.AccelOptions`); the keyword
            arguments given override its fields.
        fallback, deterministic, check_indices, parts: see
            :class:`~mace_accel.options.AccelOptions`.

    Returns:
        a :class:`PatchReport` listing every module found, each part fused or left, and why.

    Raises:
        ConfigError: an option has an invalid value.
        BackendUnavailableError: ``backend="cuda"`` cannot run here and ``fallback="error"``.
        VerificationError: the patched model disagrees with the unpatched one (then unpatched).
    """
    opts = make_options(options, backend=backend, verify=verify, fallback=fallback,
                        deterministic=deterministic, check_indices=check_indices, parts=parts)
    _check_model(model)
    requested = opts.backend
    opts = resolve_backend(opts, model_device(model))
    if opts.backend == MACE_BACKEND:
        return _leave_as_mace_built(model, requested, opts)
    records: List[PatchRecord] = []
    try:
        for path, module, patch in list(find_blocks(model)):
            records.append(patch.apply(path, module, opts))
    except BaseException:
        revert(model)  # leave nothing half-patched
        raise
    if not records:
        raise UnsupportedModelError(
            f"found no MACE interaction blocks in {type(model).__name__}; is this a MACE model?")
    state.bump_epoch(model)
    report = PatchReport(backend=opts.backend, requested_backend=requested, records=records,
                         options=opts)
    report.notes.extend(link_across_blocks(model, opts))
    report.notes.append(energy_head.describe(model))
    report.mace_built = coverage.mace_built(model)
    if opts.backend == "cuda":
        start_compiles(model)
    if opts.verify and report.patched:
        verify_or_revert(model, report)
    return report


MACE_NOTE = ("backend 'mace': the model runs as mace built it (nothing patched); on a CPU "
             "mace's own modules are faster than mace-accel's reference backend, which "
             "backend='reference' runs")


def _leave_as_mace_built(model: torch.nn.Module, requested: str,
                         opts: AccelOptions) -> PatchReport:
    """The report of ``backend="mace"``: an accelerated model is reverted, nothing patched."""
    restored = revert(model)
    report = PatchReport(backend=MACE_BACKEND, requested_backend=requested, records=[],
                         options=opts, notes=[MACE_NOTE] + (
                             [f"the model was accelerated: {restored} module(s) reverted"]
                             if restored else []))
    report.mace_built = coverage.mace_built(model)
    if opts.verify:  # nothing to compare; a broken checkpoint is still said so at once
        _check_finite(evaluate(model, *_random_batch(model), node_energy=True))
    return report


def verify_or_revert(model: torch.nn.Module, report: PatchReport) -> PatchReport:
    """Fill ``report.verification``; on disagreement (or an error) revert ``model`` and raise.

    The one check every path that patches a model goes through (``accelerate``, the
    calculator, ``convert``).

    Raises:
        VerificationError: patched and unpatched results differ beyond the tolerance table,
            or the unpatched model itself gives NaN/inf (then the model is the problem, and the
            message says so).
    """
    try:
        patched, plain = _evaluate_both(model)
    except Exception:
        revert(model)
        raise
    report.tolerance = model_tolerance(model_dtype(model))
    try:
        _check_finite(plain)
    except VerificationError:
        revert(model)
        raise
    report.verification = _errors(patched, plain)
    bad = {k: v for k, v in report.verification.items() if not v <= report.tolerance}
    if bad:
        revert(model)
        raise VerificationError(
            f"the accelerated model disagrees with the unpatched one: {bad} exceeds the "
            f"relative tolerance {report.tolerance:.0e}; the model was left unpatched.\n{report}")
    return report


def plan(model: torch.nn.Module, options: Optional[AccelOptions] = None) -> List[PatchRecord]:
    """What :func:`accelerate` would do to (or has done to) each module of ``model``; no changes.

    Args:
        options: the options to plan for (default: :class:`AccelOptions()` with the backend
            that runs where the model is).
    """
    opts = (options or AccelOptions()).for_device(model_device(model))
    if opts.backend == MACE_BACKEND:  # nothing would be: say what a fused backend would do
        opts = opts.replace(backend="reference")
    return [patch.describe(path, module, opts) for path, module, patch in find_blocks(model)]


def revert(model: torch.nn.Module) -> int:
    """Undo :func:`accelerate` in place; returns the number of modules restored."""
    n = 0
    for _, module, patch in list(find_blocks(model)):
        if patch.is_applied(module):
            patch.revert(module)
            n += 1
    if n:
        state.bump_epoch(model)
    return n


def is_accelerated(model: torch.nn.Module) -> bool:
    return any(patch.is_applied(m) for _, m, patch in find_blocks(model))


@contextlib.contextmanager
def unpatched(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Temporarily restore the original modules (for side-by-side comparison)."""
    saved = [(module, patch, patch.revert(module))
             for _, module, patch in list(find_blocks(model)) if patch.is_applied(module)]
    try:
        yield model
    finally:
        for module, patch, reverted in saved:
            patch.reattach(module, reverted)


def evaluate(model: torch.nn.Module, batch: Dict[str, torch.Tensor],
             compute_stress: bool, node_energy: bool = False) -> Dict[str, torch.Tensor]:
    """Energy, forces (and stress; with ``node_energy`` the per-atom energies too) of one batch
    by the model's own forward, detached."""
    return _kept(model(dict(batch), training=False, compute_force=True,
                       compute_stress=compute_stress), compute_stress, node_energy)


def _kept(out: Dict[str, Any], compute_stress: bool,
          node_energy: bool = False) -> Dict[str, torch.Tensor]:
    keep = ("energy", "forces") + (("stress",) if compute_stress else ()) \
        + (("node_energy",) if node_energy else ())
    return {k: out[k].detach() for k in keep if out.get(k) is not None}


def _random_batch(model: torch.nn.Module, seed: int = 0) -> Tuple[Dict[str, torch.Tensor], bool]:
    """``(batch, with stress)``: a small random structure of the model's elements."""
    from mace_accel.models.batch import atoms_to_batch, model_info, random_structure

    info = model_info(model)
    atoms = random_structure(info.atomic_numbers, n_atoms=8, r_max=info.r_max, seed=seed)
    batch = atoms_to_batch(atoms, info, device=model_device(model))
    return batch, type(model).__name__ in ("MACE", "ScaleShiftMACE")


def _check_finite(plain: Dict[str, torch.Tensor]) -> None:
    """Raise :class:`VerificationError` where the plain model's own results are not finite."""
    bad = [k for k, v in plain.items() if not torch.isfinite(v).all()]
    if bad:
        raise VerificationError(
            f"the model itself (without mace-accel) gives non-finite {', '.join(bad)} on a "
            "small random structure of its elements; the checkpoint is broken (NaN/inf "
            "weights?) and mace-accel left it unpatched")


def _evaluate_both(model: torch.nn.Module,
                   seed: int = 0) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """Patched and unpatched energy/forces/stress on a small random structure."""
    batch, stress = _random_batch(model, seed)
    # the accelerated model as the calculator, graphs and runs evaluate it (its lean energy
    # head, the stress from the edges) against the unpatched model's own forward
    from mace_accel.models.outputs import evaluate as evaluate_accelerated

    # the plain model first: it runs while the kernels the patched call needs are compiling
    # (surgery.start_compiles), instead of after that call waited for them
    with unpatched(model):
        plain = evaluate(model, batch, stress, node_energy=True)
    patched = _kept(evaluate_accelerated(model, dict(batch), stress), stress, True)
    return patched, plain


def _errors(patched: Dict[str, torch.Tensor], plain: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Relative error of each result (the energy against its per-atom terms' scale,
    :func:`~mace_accel.tolerances.energy_error`)."""
    errors = {k: rel_norm_error(patched[k], plain[k]) for k in plain if k != "node_energy"}
    if "node_energy" in plain:
        errors["energy"] = energy_error(patched["energy"], plain["energy"], plain["node_energy"])
    return errors


def describe_model(model: Any) -> Dict[str, Any]:
    """The model's summary and, per module, what surgery fuses (or would), changing nothing.

    Returns:
        ``{"model", "elements", "atomic_numbers", "r_max", "heads", "dtype", "parameters",
        "accelerated", "blocks"}``; ``blocks`` holds each :class:`PatchRecord` as a dict.
    """
    from mace_accel.models.batch import model_info
    from mace_accel.options import dtype_name

    info = model_info(model)
    records = plan(model)
    return {
        "model": type(model).__name__, "elements": info.symbols,
        "atomic_numbers": list(info.atomic_numbers), "r_max": info.r_max,
        "heads": list(info.heads), "dtype": dtype_name(info.dtype),
        "parameters": sum(p.numel() for p in model.parameters()),
        "accelerated": is_accelerated(model), "blocks": [r.to_dict() for r in records],
        "mace_built": [m.to_dict() for m in coverage.mace_built(model)],
        "runs_here": runs_here(),
    }


def runs_here() -> str:
    """What a calculator or run with ``backend="auto"`` evaluates on this machine."""
    from mace_accel.options import resolve_device

    backend = AccelOptions(backend="auto").for_device(resolve_device("auto")).backend
    if backend == MACE_BACKEND:
        return ("mace's own modules (no GPU here: backend 'auto' runs the model as mace built "
                "it; backend='reference' runs mace-accel's plain-torch ops, slower on a CPU)")
    return "mace-accel's CUDA kernels (backend 'auto' on this GPU)"
