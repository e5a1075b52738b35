"""YAML-driven runs: single points, geometry optimisation and molecular dynamics with ASE.

``run(config)`` checks everything first (the run file, the structure's frames against the model,
the model itself, the output folder), then takes the output folder for itself
(:class:`~mace_accel.runs.outputs.RunFolder`: a lock, and a folder that is new, empty, or
cleared of an earlier run's files with ``overwrite``) and writes into it:

=====================  ===================================================================
``run.log``            what was run, the patch report, optimizer / MD progress (flushed)
``config.yaml``        the validated run, paths resolved
``results.extxyz``     singlepoint: every frame with its results (``.partial`` while running)
``trajectory.extxyz``  geomopt / md: frames every ``traj_every`` steps (flushed as it goes)
``stats.dat``          md: step, time, energies, temperature (and volume, pressure for npt)
``final.extxyz``       geomopt / md: the last structure with its results
=====================  ===================================================================

A run that fails a check writes nothing. Frames carry energy / forces / stress through ASE's
``SinglePointCalculator``, so ``ase.io.read`` hands them back. Files written as the run goes get
each record (log line, stats row, frame) whole or not at all (:mod:`mace_accel.runs.writers`), so
a run that is interrupted, diverges or fills the disk keeps what it did, readable; its error says
what was kept. Files written whole (``config.yaml``, ``final.extxyz``) are written atomically with
the umask's file mode (:func:`mace_accel.files.atomic_write`).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, TextIO

import numpy as np

from mace_accel.errors import (
    BackendUnavailableError,
    ConfigError,
    InputError,
    Interrupted,
    OutputWriteError,
    SimulationError,
)
from mace_accel.files import NO_ROOM_ERRNOS, atomic_write_text, os_error_reason
from mace_accel.runs.config import RunConfig, load_run_config
from mace_accel.runs.outputs import RunFolder
from mace_accel.runs.phrasing import run_file_terms
from mace_accel.runs.progress import progress_bar, ticker
from mace_accel.runs.writers import (  # noqa: F401  (STATS_COLUMNS: the stats.dat layout)
    NPT_STATS_COLUMNS,
    STATS_COLUMNS,
    RunFiles,
    RunLog,
    StatsWriter,
    render_frame,
)


@dataclasses.dataclass
class RunResult:
    """What a run did.

    Attributes:
        task: ``singlepoint | geomopt | md``.
        outputs: the output directory.
        files: ``{role: path}`` of the files written (log, config, results / trajectory, ...).
        backend: the mace-accel backend the calculator ran with.
        summary: task-specific numbers (frames, steps, converged, final max force, ...).
        warnings: what the user must know although the run finished (an optimisation that did
            not converge); :func:`run` also issues each as a ``RuntimeWarning``.
    """

    task: str
    outputs: Path
    files: Dict[str, Path]
    backend: Optional[str]
    summary: Dict[str, Any]
    warnings: List[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """The run reached its goal (False: a geometry optimisation that did not converge)."""
        return not self.warnings

    def __str__(self) -> str:
        lines = [f"{self.task} finished (backend {self.backend!r}); outputs in {self.outputs}"]
        lines += [f"  {k}: {_fmt(v)}" for k, v in self.summary.items()]
        lines += [f"  {role}: {path.name}" for role, path in self.files.items()]
        return "\n".join(lines)


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


@dataclasses.dataclass
class Structures:
    """The frames of a run's structure file that the run uses.

    Attributes:
        path: the structure file.
        frames: the ``ase.Atoms`` used (every frame for singlepoint, one for geomopt / md).
        indices: the index of each of them in the file (for messages).
        total: how many frames the file holds.
    """

    path: Path
    frames: List[Any]
    indices: List[int]
    total: int

    def where(self, i: int) -> str:
        """``"frame 2 of 'path'"`` for the i-th frame used."""
        return f"frame {self.indices[i]} of {str(self.path)!r}"


# ---------------------------------------------------------------------------------------------
# entry points


def run(config: RunConfig | str | Path, overrides: Optional[Mapping[str, Any]] = None, *,
        overrides_base: Optional[Path | str] = None, overwrite: bool = False,
        progress_stream: Optional[TextIO] = None, warn: bool = True) -> RunResult:
    """Run a YAML run file (or a :class:`RunConfig`) to the end.

    Args:
        config: a run file path or an already validated :class:`RunConfig`.
        overrides: dotted keys set before validation (``{"md.steps": 5, "device": "cpu"}``);
            only with a path.
        overrides_base: directory relative paths in ``overrides`` are taken from (default: the
            run file's directory, like the paths in the file).
        overwrite: if the output folder holds an earlier run's files, delete them first
            (default: refuse the folder). Files a run does not write are never deleted.
        progress_stream: where progress goes (default stderr: a bar on a terminal, a line
            every 10 s elsewhere; also the lines while the model is loaded and verified).
        warn: issue each of ``result.warnings`` as a ``RuntimeWarning`` (the command line
            prints them itself, whatever the warning filters).

    Returns:
        a :class:`RunResult`; the files are in ``result.outputs``.

    Raises:
        ConfigError, InputError, CheckpointError, OutputError, BackendUnavailableError,
        VerificationError: a check failed; nothing was written.
        SimulationError: the MD run diverged or the optimiser broke the structure part-way;
            the message names the step and the files kept.
        OutputWriteError: an output could not be written part-way (a full disk); every file
            ends with its last whole record, and the message says what was kept.
        Interrupted: Ctrl-C while the run was writing (its ``note`` says where the files are).
    """
    cfg = _as_config(config, overrides, overrides_base)
    cfg = resolve_auto_device(cfg)
    check_device(cfg.device)
    structures = read_structures(cfg)
    check_task_inputs(cfg, structures)
    folder = RunFolder(cfg.outputs, overwrite=overwrite)
    folder.check()  # before loading the model: a refused folder fails fast
    with ticker(f"loading, accelerating and verifying the model ({cfg.model_path.name}, "
                f"{cfg.dtype}, {cfg.device})", progress_stream, enabled=cfg.progress):
        calc = make_calculator(cfg, compute_stress=_needs_stress(cfg, structures.frames))
    validate_structures(structures, calc.info, cfg)
    result = _claim_and_write(folder, cfg, structures, calc, progress_stream)
    for text in result.warnings if warn else ():
        warnings.warn(text, RuntimeWarning, stacklevel=2)
    return result


def _claim_and_write(folder: RunFolder, cfg: RunConfig, structures: Structures, calc,
                     progress_stream: Optional[TextIO]) -> RunResult:
    """Claim ``folder`` (everything is checked: from here on the run writes) and write the run
    into it; Ctrl-C says where the files written so far are."""
    with folder:
        try:
            return _run_in(folder.path, cfg, structures, calc, progress_stream)
        except KeyboardInterrupt:
            raise Interrupted(f"the files written so far are in {folder.path} (see run.log)") \
                from None


def _run_in(out: Path, cfg: RunConfig, structures: Structures, calc,
            progress_stream: Optional[TextIO]) -> RunResult:
    """Write the run into the claimed folder ``out``; a failure part-way says what was kept."""
    files = {"log": out / "run.log", "config": out / "config.yaml"}
    try:
        atomic_write_text(files["config"], _yaml_dump(cfg.to_dict()))
    except OSError as exc:
        raise _write_failure(exc, out, "nothing was kept") from None
    try:
        log = RunLog(files["log"])
    except OSError as exc:
        raise _write_failure(exc, out, f"kept in {out}: config.yaml") from None
    outputs = RunFiles(out, log)
    outputs.written_whole(files["config"])
    with log:
        try:
            return _run_task(outputs, cfg, structures, calc, progress_stream, files)
        except OSError as exc:
            if not _in_folder(exc, out):
                raise
            raise _write_failure(exc, out, outputs.kept(), outputs.resume_hint()) from None
        except SimulationError as exc:
            raise SimulationError(f"{exc}; {outputs.kept()}; rerun with --overwrite to replace "
                                  "them") from None
        finally:
            outputs.close()


def _in_folder(exc: OSError, folder: Path) -> bool:
    """Whether ``exc`` was raised writing a file of the outputs ``folder``."""
    return exc.filename is not None and Path(exc.filename).absolute().parent == folder


def _write_failure(exc: OSError, folder: Path, kept: str,
                   resume: Optional[str] = None) -> OutputWriteError:
    """The one-line error of an output that could not be written part-way."""
    name = Path(exc.filename).name if exc.filename else "an output"
    elsewhere = "with `outputs:` in the run file (or --set outputs=DIR)"
    if exc.errno in NO_ROOM_ERRNOS:
        fix = f"free space on that disk and rerun with --overwrite, or choose a folder on " \
              f"another disk {elsewhere}"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        fix = f"fix the folder's permissions, or choose another folder {elsewhere}"
    else:
        fix = f"check that disk, or choose a folder on another one {elsewhere}"
    text = f"cannot write {name} in {folder}: {os_error_reason(exc)}; {kept}; {fix}"
    return OutputWriteError(text + (f"; {resume}" if resume else ""))


def _run_task(outputs: RunFiles, cfg: RunConfig, structures: Structures, calc,
              progress_stream: Optional[TextIO], files: Dict[str, Path]) -> RunResult:
    """Log the run's header, run its task, log how it ended."""
    frames, log, out = structures.frames, outputs.log, outputs.folder
    used = (f"{len(frames)} frame(s)" if len(frames) > 1 else
            f"frame {structures.indices[0]} of {structures.total}")
    log.write(f"mace-accel {_version()}: task {cfg.task}, structure {cfg.struct} "
              f"({used}), model {cfg.model_path}")
    log.write(f"device {cfg.device}, dtype {cfg.dtype}, backend {cfg.backend}, "
              f"deterministic {cfg.deterministic}, head {cfg.head or '(default)'}; "
              f"pid {os.getpid()}")
    backend = getattr(calc, "backend", None)
    report = getattr(calc, "report", None)
    log.write(f"active backend: {backend}")
    if report is not None:
        log.write(str(report))
    task = {"singlepoint": run_singlepoint, "geomopt": run_geomopt, "md": run_md}[cfg.task]
    try:
        summary, task_files = task(cfg, frames, calc, outputs, progress_stream)
    except KeyboardInterrupt:
        log.try_write("interrupted by the user; the files written so far are kept")
        raise
    except Exception as exc:
        log.try_write(f"stopped by an error ({type(exc).__name__}: {exc}); the files "
                      "written so far are kept")
        raise
    files.update(task_files)
    notes = _task_warnings(cfg, summary, out)
    for text in notes:
        log.write(f"warning: {text}")
    log.write("finished: " + ", ".join(f"{k}={_fmt(v)}" for k, v in summary.items()))
    return RunResult(cfg.task, out, files, backend, summary, notes)


def _task_warnings(cfg: RunConfig, summary: Mapping[str, Any], out: Path) -> List[str]:
    """What a finished run must tell its user: a geometry optimisation that did not converge."""
    if cfg.task != "geomopt" or summary.get("converged", True):
        return []
    opts = cfg.geomopt
    return [f"geomopt did not converge: the largest force is {summary['final_fmax']:.4g} eV/Å "
            f"after {summary['steps']} steps (geomopt.fmax is {opts.fmax:g}); "
            f"{out / 'final.extxyz'} holds the last structure. Allow more steps with "
            f"--set geomopt.steps=N (now {opts.steps}), or continue from it with "
            f"--set struct={out / 'final.extxyz'} --set outputs=NEW_DIR"]


def dry_run(config: RunConfig | str | Path, overrides: Optional[Mapping[str, Any]] = None,
            overrides_base: Optional[Path | str] = None, overwrite: bool = False) -> str:
    """Run every check :func:`run` runs before it writes, and describe the run; writes nothing.

    Checks the run file, reads the model (on the CPU, not accelerated) and the structure, checks
    every frame the run uses against the model (elements, NaN, overlapping atoms, cell), and
    checks the output folder. A GPU asked for but missing is noted, not an error (the dry run
    may be on another machine than the run).

    Raises:
        the same errors as :func:`run` before it writes.
    """
    from mace_accel.models.batch import model_info
    from mace_accel.models.checkpoint import load_model
    from mace_accel.models.validation import validate_head

    cfg = _as_config(config, overrides, overrides_base)
    structures = read_structures(cfg)
    check_task_inputs(cfg, structures)
    RunFolder(cfg.outputs, overwrite=overwrite).check()
    model = load_model(_model_file(cfg), device="cpu")
    info = model_info(model)
    with run_file_terms():
        validate_head(cfg.head, info)
    validate_structures(structures, info, cfg)
    frames = structures.frames
    formulas = sorted({a.get_chemical_formula() for a in frames})
    shown = ", ".join(formulas[:5]) + (", ..." if len(formulas) > 5 else "")
    lines = [f"# dry run: {cfg.task} on {len(frames)} frame(s) ({shown}) of "
             f"{len(frames[0])}{'+' if len({len(a) for a in frames}) > 1 else ''} atoms",
             f"# model: {cfg.model_path}{' (bundled)' if cfg.model is None else ''}: "
             f"{type(model).__name__}, elements {' '.join(info.symbols)}",
             f"# outputs would go to {cfg.outputs}",
             "# checked: run file, model, structure, outputs folder"]
    try:
        check_device(cfg.device)
    except BackendUnavailableError as exc:
        lines.append(f"# note: this run would fail here: {exc}")
    lines += [_yaml_dump(cfg.to_dict()).rstrip()]
    return "\n".join(lines)


def _as_config(config: RunConfig | str | Path, overrides: Optional[Mapping[str, Any]],
               overrides_base: Optional[Path | str]) -> RunConfig:
    if isinstance(config, RunConfig):
        if overrides:
            raise ConfigError("overrides apply to a run file; build the RunConfig with the "
                              "values you want instead")
        return config
    return load_run_config(config, overrides, overrides_base)


def resolve_auto_device(cfg: RunConfig) -> RunConfig:
    """``device: auto`` becomes ``cuda`` when torch sees a GPU, else ``cpu`` (said on stderr)."""
    if cfg.device != "auto":
        return cfg
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        runs = ("the model runs as mace built it (backend: auto; `backend: reference` runs "
                "mace-accel's plain-torch ops)" if cfg.backend == "auto"
                else f"backend {cfg.backend} runs")
        print(f"mace-accel: device auto -> cpu (no CUDA GPU visible): {runs}", file=sys.stderr)
    return dataclasses.replace(cfg, device=device)


def check_device(device: str,
                 fix: str = "set `device: cpu` in the run file (or pass --set device=cpu)") -> None:
    """Raise a clear error if ``device`` names a GPU torch cannot see.

    Args:
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        fix: how the user gets around it where they typed the device (default: the run-file
            fix); it replaces the Python-API advice of
            :func:`~mace_accel.checkpoint.resolve_device`'s message.
    """
    from mace_accel.models.checkpoint import resolve_device

    if device == "auto":  # always resolves to something that runs (resolve_auto_device)
        return
    try:
        resolve_device(device)
    except BackendUnavailableError as exc:
        what = str(exc).split(";")[0]  # the fact, without the Python-API advice
        raise BackendUnavailableError(f"{what}; {fix}") from None


def read_structures(cfg: RunConfig) -> Structures:
    """The frames of ``cfg.struct`` the run uses.

    singlepoint: every frame (or ``frame``); geomopt / md: frame ``frame``, or the only frame.

    Raises:
        InputError: the file cannot be read or holds no atoms.
        ConfigError: geomopt / md on a multi-frame file without ``frame``, or ``frame`` out of
            range.
    """
    import ase.io

    path = Path(cfg.struct)
    try:
        frames = ase.io.read(str(path), index=":")
    except Exception as exc:  # ase raises many types for unreadable files
        raise InputError(f"could not read structure file {str(path)!r} with ase.io.read "
                         f"({type(exc).__name__}: {' '.join(str(exc).split())}); give a "
                         "structure file ASE reads (extxyz, xyz, cif, POSCAR, ...: ASE guesses "
                         "the format from the name)") from None
    frames = frames if isinstance(frames, list) else [frames]
    n = len(frames)
    if n == 0:
        raise InputError(f"structure file {str(path)!r} holds no frames")
    if cfg.frame is not None:
        if not -n <= cfg.frame < n:
            raise ConfigError(f"frame: {cfg.frame} is out of range: {str(path)!r} holds {n} "
                              f"frame(s) (frame: 0..{n - 1}, or -1 for the last)")
        indices = [cfg.frame % n]
    elif cfg.task == "singlepoint":
        indices = list(range(n))
    elif n > 1:
        raise ConfigError(f"struct {str(path)!r} holds {n} frames and {cfg.task} runs from one; "
                          f"say which with `frame: N` in the run file (0..{n - 1}, or -1 for the "
                          "last; --set frame=-1 on the command line)")
    else:
        indices = [0]
    structures = Structures(path, [frames[i] for i in indices], indices, n)
    for i, atoms in enumerate(structures.frames):
        if len(atoms) == 0:
            raise InputError(f"{structures.where(i)} holds no atoms")
    return structures


def validate_structures(structures: Structures, info, cfg: RunConfig) -> None:
    """Check every frame the run uses against the model ``info`` (elements, NaN positions or
    cell, flat cells, overlapping atoms closer than ``min_distance``); errors name the frame."""
    from mace_accel.models.validation import validate_atoms

    for i, atoms in enumerate(structures.frames):
        try:
            with run_file_terms():
                validate_atoms(atoms, info, min_distance=cfg.min_distance or None)
        except InputError as exc:
            raise InputError(f"{structures.where(i)}: {exc}") from None


def check_task_inputs(cfg: RunConfig, structures: Structures) -> None:
    """What the task needs of its structure (a periodic cell for relax_cell and npt, a
    triangular cell for npt), checked before anything is written."""
    atoms = structures.frames[0]
    if cfg.task == "geomopt" and cfg.geomopt.relax_cell:
        if not _periodic(atoms):
            raise InputError(f"geomopt.relax_cell needs a structure with a 3D periodic cell "
                             f"({structures.where(0)} has pbc={atoms.pbc.tolist()}); set "
                             "relax_cell: false or give the structure a cell and pbc")
    if cfg.task == "md" and len(atoms) < 2:
        raise InputError(f"md needs at least 2 atoms ({structures.where(0)} has 1): the run "
                         "holds the centre of mass at rest, which leaves a single atom nothing to "
                         "move; repeat the cell (atoms.repeat((2, 2, 2)) in ASE) or run "
                         "`task: singlepoint` for its energy")
    if cfg.task == "md" and cfg.md.ensemble == "npt":
        _check_npt_cell(atoms, structures.where(0))


def _model_file(cfg: RunConfig) -> Path:
    path = cfg.model_path
    if not path.is_file():
        what = "the bundled default model" if cfg.model is None else "the model"
        kind = "a folder, not a model file" if path.is_dir() else "not found"
        raise ConfigError(f"{what} at {str(path)!r} is {kind}; set `model:` in the run file "
                          "(or pass --set model=PATH)")
    return path


def make_calculator(cfg: RunConfig, compute_stress: bool):
    """What evaluates the run's model (loads it, patches it, verifies it): a
    :class:`~mace_accel.batched.BatchEvaluator` for singlepoint (many frames per model call),
    the ASE calculator for geomopt and md. Errors say their fix in run-file terms."""
    with run_file_terms():
        common = dict(model=_model_file(cfg), device=cfg.device, default_dtype=cfg.dtype,
                      head=cfg.head, backend=cfg.backend, verify=cfg.verify,
                      fallback=cfg.fallback, deterministic=cfg.deterministic,
                      min_distance=cfg.min_distance or None, compute_stress=compute_stress)
        if cfg.task == "singlepoint":
            from mace_accel.batched import BatchEvaluator

            return BatchEvaluator(**common, max_edges=cfg.singlepoint.max_edges)
        from mace_accel.calculator import MACEAccelCalculator

        return MACEAccelCalculator(**common, graphs=cfg.graphs, skin=cfg.skin)


def _needs_stress(cfg: RunConfig, frames: List[Any]) -> bool:
    """Stress costs an extra derivative: compute it only where the task uses it."""
    if cfg.task == "singlepoint":
        return "stress" in cfg.singlepoint.properties and any(_has_stress(a) for a in frames)
    if cfg.task == "geomopt":
        return cfg.geomopt.relax_cell
    return cfg.md.ensemble == "npt"


def _has_stress(atoms) -> bool:
    """The calculator's own rule for when a structure has a stress."""
    from mace_accel.calculator import has_stress

    return has_stress(atoms)


def _periodic(atoms) -> bool:
    return bool(np.all(atoms.pbc)) and atoms.cell.rank == 3


# ---------------------------------------------------------------------------------------------
# output helpers


def snapshot(atoms):
    """A copy of ``atoms`` holding its calculator's results (every standard ASE property
    computed) in a ``SinglePointCalculator``."""
    from ase.calculators.calculator import all_properties
    from ase.calculators.singlepoint import SinglePointCalculator

    results = dict(atoms.calc.results) if atoms.calc is not None else {}
    results = {k: v for k, v in results.items() if k in all_properties}
    copy = atoms.copy()
    copy.calc = SinglePointCalculator(copy, **{k: np.array(v) if np.ndim(v) else v
                                               for k, v in results.items()})
    return copy


def _write_final(outputs: RunFiles, atoms) -> Path:
    """``final.extxyz``: the last structure with its results, written atomically."""
    path = outputs.folder / "final.extxyz"
    atomic_write_text(path, render_frame(snapshot(atoms)))
    outputs.written_whole(path)
    return path


def _yaml_dump(data: Mapping[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(dict(data), sort_keys=False)


def _version() -> str:
    from mace_accel import __version__

    return __version__


def _progress(cfg: RunConfig, total: int, desc: str, stream: Optional[TextIO],
              unit: str = "steps"):
    return progress_bar(total, desc=desc, stream=stream, enabled=None if cfg.progress else False,
                        unit=unit)


def _attach_trajectory(driver, atoms, every: int, outputs: RunFiles,
                       files: Dict[str, Path]) -> None:
    """Append ``atoms`` to ``trajectory.extxyz`` every ``every`` steps of ``driver`` (an ASE
    optimizer or MD integrator; 0: no trajectory), and list the file in ``files``."""
    if not every:
        return
    traj = outputs.frames("trajectory", "trajectory.extxyz")
    files["trajectory"] = traj.path
    driver.attach(lambda: traj.write(snapshot(atoms), step=driver.nsteps), interval=every)


def _max_force(atoms) -> float:
    forces = atoms.get_forces()
    return float(np.sqrt((forces**2).sum(axis=1)).max()) if len(forces) else 0.0


# ---------------------------------------------------------------------------------------------
# tasks: each returns (summary, {role: path})


def run_singlepoint(cfg: RunConfig, frames: List[Any], evaluator, outputs: RunFiles,
                    progress_stream: Optional[TextIO] = None):
    """Evaluate ``singlepoint.properties`` on every frame, many frames per model call
    (:class:`~mace_accel.batched.BatchEvaluator`); write ``results.extxyz`` in input order
    (``results.extxyz.partial`` while it grows, renamed when every frame is in)."""
    from ase.calculators.singlepoint import SinglePointCalculator

    log = outputs.log
    out = outputs.folder / "results.extxyz"
    partial = outputs.frames("results", out.name + ".partial")
    wanted = list(cfg.singlepoint.properties)
    skipped_stress = 0
    with _progress(cfg, len(frames), "singlepoint", progress_stream, "frames") as bar:
        results = evaluator.iter_results(frames, progress=bar.update)
        for i, (atoms, result) in enumerate(zip(frames, results)):
            props = [p for p in wanted if p != "stress" or "stress" in result]
            skipped_stress += len(props) < len(wanted)
            frame = atoms.copy()
            frame.calc = SinglePointCalculator(frame, **{p: result[p] for p in props})
            partial.write(frame, step=i)
            log.write(f"frame {i}: {len(atoms)} atoms, energy {result['energy']:.8f} eV")
    partial.close()
    os.replace(partial.path, out)
    outputs.open.pop("results")
    outputs.written_whole(out)
    ranks = getattr(evaluator, "n_ranks", 1)
    log.write(f"{len(frames)} frame(s) in {evaluator.n_calls} batched model call(s)"
              + (f" over {ranks} processes (torch.distributed; budget of rank 0: "
                 if ranks > 1 else "; ") + _budget_text(evaluator.budget)
              + (")" if ranks > 1 else ""))
    if skipped_stress:
        log.write(f"stress left out for {skipped_stress} frame(s) without a 3D periodic cell")
    return ({"frames": len(frames), "model_calls": evaluator.n_calls,
             "stress_skipped": skipped_stress}, {"results": out})


def _budget_text(budget) -> str:
    if budget.bytes_per_edge is None:
        return f"up to {budget.max_edges} edges per call ({budget.source})"
    return (f"up to {budget.max_edges} edges per call (measured: {budget.bytes_per_edge:.0f} "
            f"bytes per edge, {budget.free_bytes / 2**30:.1f} GiB free)")


def _make_optimizer(name: str):
    from ase import optimize

    return {"FIRE": optimize.FIRE, "BFGS": optimize.BFGS, "LBFGS": optimize.LBFGS}[name]


def run_geomopt(cfg: RunConfig, frames: List[Any], calc, outputs: RunFiles,
                progress_stream: Optional[TextIO] = None):
    """Relax one frame with an ASE optimizer (its structure checked by
    :func:`check_task_inputs`); trajectory as it goes, final frame atomically."""
    from ase.filters import FrechetCellFilter

    opts = cfg.geomopt
    log = outputs.log
    atoms = frames[0]
    atoms.calc = calc
    files: Dict[str, Path] = {}
    fmax0 = _max_force(atoms)
    log.write(f"geomopt: {opts.optimizer}, fmax {opts.fmax} eV/Å, at most {opts.steps} steps, "
              f"relax_cell {opts.relax_cell}; initial max force {fmax0:.6g} eV/Å")
    target = FrechetCellFilter(atoms) if opts.relax_cell else atoms
    opt = _make_optimizer(opts.optimizer)(target, logfile=log.stream())
    _attach_trajectory(opt, atoms, opts.traj_every, outputs, files)
    with _progress(cfg, opts.steps, "geomopt", progress_stream) as bar:
        opt.attach(lambda: bar.update() if opt.nsteps else None, interval=1)
        try:
            converged = bool(opt.run(fmax=opts.fmax, steps=opts.steps))
        except InputError as exc:  # the start was checked: the optimiser broke the structure
            raise SimulationError(
                f"geomopt stopped at step {opt.nsteps + 1}: {_fact(exc)}; the optimiser moved "
                "the atoms into an invalid structure (the model may have no minimum near the "
                f"start: try `geomopt.optimizer` BFGS or FIRE, or check the structure)") from None
    fmax1 = _max_force(atoms)
    files["final"] = _write_final(outputs, atoms)
    summary = {"converged": converged, "steps": int(opt.nsteps), "initial_fmax": fmax0,
               "final_fmax": fmax1, "energy": float(atoms.get_potential_energy())}
    return summary, files


def _fact(exc: Exception) -> str:
    """The statement of a structure check's error without its advice (the first clause):
    advice about the input structure is wrong for a structure a simulation produced."""
    return str(exc).split(";")[0].strip()


def _npt_class():
    """ASE's Melchionna NPT integrator: ``MelchionnaNPT``, named ``NPT`` by older ase."""
    try:
        from ase.md.melchionna import MelchionnaNPT
    except ImportError:  # older ase: only ase.md.npt.NPT, which every ase >= 3.23 has
        from ase.md.npt import NPT as MelchionnaNPT
    return MelchionnaNPT


def _check_npt_cell(atoms, where: str) -> None:
    if not _periodic(atoms):
        raise InputError(f"md.ensemble npt needs a structure with a 3D periodic cell ({where} "
                         f"has pbc={atoms.pbc.tolist()})")
    cell = np.asarray(atoms.cell)
    if not (np.allclose(np.triu(cell, 1), 0) or np.allclose(np.tril(cell, -1), 0)):
        raise InputError(f"ASE's NPT integrator needs a triangular cell matrix ({where} has "
                         f"{cell.round(6).tolist()}); rotate the structure so the cell is upper "
                         "or lower triangular (e.g. atoms.set_cell(atoms.cell.standard_form()[0], "
                         "scale_atoms=True))")


def _make_dynamics(cfg: RunConfig, atoms, rng: np.random.Generator):
    """The run's ASE integrator (the structure checked by :func:`check_task_inputs`)."""
    from ase import units

    md = cfg.md
    dt = md.timestep * units.fs
    if md.ensemble == "nve":
        from ase.md.verlet import VelocityVerlet

        return VelocityVerlet(atoms, timestep=dt)
    if md.ensemble == "nvt":
        from ase.constraints import FixCom
        from ase.md.langevin import Langevin

        # ase >= 3.28 deprecates fixcm=True in favour of a FixCom constraint
        atoms.set_constraint(list(atoms.constraints) + [FixCom()])
        return Langevin(atoms, timestep=dt, temperature_K=md.temperature,
                        friction=md.friction / units.fs, rng=rng, fixcm=False)
    pfactor = (md.taup * units.fs) ** 2 * md.bulk_modulus * units.GPa
    return _npt_class()(atoms, timestep=dt, temperature_K=md.temperature,
                        externalstress=md.pressure * units.bar, ttime=md.taut * units.fs,
                        pfactor=pfactor)


def maxwell_boltzmann(atoms, temperature_K: float, rng: np.random.Generator) -> None:
    """Momenta of ``atoms`` drawn from the Maxwell-Boltzmann distribution at ``temperature_K``
    with ``rng`` (the run's MD and the bench's)."""
    from ase.md import velocitydistribution as vd

    # ase >= 3.29 names it thermalize_momenta (and deprecates MaxwellBoltzmannDistribution)
    thermalize = getattr(vd, "thermalize_momenta", vd.MaxwellBoltzmannDistribution)
    thermalize(atoms, temperature_K=temperature_K, rng=rng)


def _init_velocities(atoms, temperature: float, seed: int, rng: np.random.Generator,
                     log: RunLog) -> None:
    from ase.md import velocitydistribution as vd

    if atoms.has("momenta") and np.any(atoms.get_momenta() != 0):
        log.write("md: starting from the momenta stored in the structure")
        return
    maxwell_boltzmann(atoms, temperature, rng)
    vd.Stationary(atoms)  # no drift of the centre of mass
    log.write(f"md: Maxwell-Boltzmann velocities at {temperature} K (seed {seed})")


_USUAL_TIMESTEP_FS = 2.0  # above this, a diverging MD run is first the timestep's fault


def run_md(cfg: RunConfig, frames: List[Any], calc, outputs: RunFiles,
           progress_stream: Optional[TextIO] = None):
    """Molecular dynamics of one frame; trajectory and stats as it goes, final frame atomically."""
    md = cfg.md
    log = outputs.log
    atoms = frames[0]
    atoms.calc = calc
    rng = np.random.default_rng(md.seed)
    _init_velocities(atoms, md.temperature, md.seed, rng, log)
    dyn = _make_dynamics(cfg, atoms, rng)
    log.write(f"md: {md.ensemble}, {md.steps} steps of {md.timestep} fs, {md.temperature} K"
              + (f", {md.pressure} bar" if md.ensemble == "npt" else ""))
    stats = outputs.stats(atoms, md.ensemble == "npt", lambda: dyn.nsteps, md.timestep)
    files: Dict[str, Path] = {"stats": stats.path}
    dyn.attach(stats, interval=md.stats_every)
    _attach_trajectory(dyn, atoms, md.traj_every, outputs, files)
    with _progress(cfg, md.steps, f"md {md.ensemble}", progress_stream) as bar:
        dyn.attach(lambda: bar.update() if dyn.nsteps else None, interval=1)
        try:
            dyn.run(md.steps)
        except InputError as exc:  # the start was checked: the dynamics made it invalid
            raise SimulationError(_divergence(md, dyn.nsteps + 1, exc)) from None
    files["final"] = _write_final(outputs, atoms)
    summary = {"steps": int(dyn.nsteps), "time_fs": dyn.nsteps * md.timestep,
               "final_temperature_K": float(atoms.get_temperature()),
               "final_epot": float(atoms.get_potential_energy())}
    return summary, files


def _divergence(md, step: int, exc: Exception) -> str:
    """An MD run that diverged, said as such: the step, what broke, the likely cause."""
    text = f"md diverged at step {step} of {md.steps}: {_fact(exc)}. "
    if md.timestep > _USUAL_TIMESTEP_FS:
        return text + (f"The timestep ({md.timestep:g} fs) is likely too large for "
                       f"{md.temperature:g} K: lower it with `md.timestep:` (--set "
                       "md.timestep=...; 1-2 fs suits most solids, 0.5 fs with hydrogen)")
    return text + (f"At a {md.timestep:g} fs timestep the model itself may be unstable here (far "
                   f"from its training data) or {md.temperature:g} K too hot: try a smaller "
                   "`md.timestep:` (--set md.timestep=0.5), a lower `md.temperature:`, or "
                   "another model")
