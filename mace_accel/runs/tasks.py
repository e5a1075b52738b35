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
``SinglePointCalculator``, so ``ase.io.read`` hands them back. Files written as the run goes are
flushed after each record, so an interrupted run keeps what it did, readable record by record;
files written whole (``config.yaml``, ``final.extxyz``) are written atomically with the umask's
file mode (:func:`mace_accel.files.atomic_write`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, TextIO

import numpy as np

from mace_accel.errors import BackendUnavailableError, ConfigError, InputError, Interrupted
from mace_accel.files import atomic_write, atomic_write_text
from mace_accel.runs.config import RunConfig, load_run_config
from mace_accel.runs.outputs import RunFolder
from mace_accel.runs.progress import progress_bar

STATS_COLUMNS = ("step", "time_fs", "epot_eV", "ekin_eV", "etot_eV", "temperature_K")
NPT_STATS_COLUMNS = ("volume_A3", "pressure_bar")


@dataclasses.dataclass
class RunResult:
    """What a run did.

    Attributes:
        task: ``singlepoint | geomopt | md``.
        outputs: the output directory.
        files: ``{role: path}`` of the files written (log, config, results / trajectory, ...).
        backend: the mace-accel backend the calculator ran with.
        summary: task-specific numbers (frames, steps, converged, final max force, ...).
    """

    task: str
    outputs: Path
    files: Dict[str, Path]
    backend: Optional[str]
    summary: Dict[str, Any]

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
        progress_stream: Optional[TextIO] = None) -> RunResult:
    """Run a YAML run file (or a :class:`RunConfig`) to the end.

    Args:
        config: a run file path or an already validated :class:`RunConfig`.
        overrides: dotted keys set before validation (``{"md.steps": 5, "device": "cpu"}``);
            only with a path.
        overrides_base: directory relative paths in ``overrides`` are taken from (default: the
            run file's directory, like the paths in the file).
        overwrite: if the output folder holds an earlier run's files, delete them first
            (default: refuse the folder). Files a run does not write are never deleted.
        progress_stream: where the progress bar draws (default stderr, only if a terminal).

    Returns:
        a :class:`RunResult`; the files are in ``result.outputs``.

    Raises:
        ConfigError, InputError, CheckpointError, OutputError, BackendUnavailableError,
        VerificationError: a check failed; nothing was written.
        Interrupted: Ctrl-C while the run was writing (its ``note`` says where the files are).
    """
    cfg = _as_config(config, overrides, overrides_base)
    cfg = resolve_auto_device(cfg)
    check_device(cfg.device)
    structures = read_structures(cfg)
    check_task_inputs(cfg, structures)
    folder = RunFolder(cfg.outputs, overwrite=overwrite)
    folder.check()  # before loading the model: a refused folder fails fast
    calc = make_calculator(cfg, compute_stress=_needs_stress(cfg, structures.frames))
    validate_structures(structures, calc.info, cfg)
    with folder:  # everything is checked: from here on the run writes
        try:
            return _run_in(folder.path, cfg, structures, calc, progress_stream)
        except KeyboardInterrupt:
            raise Interrupted(f"the files written so far are in {folder.path} (see run.log)") \
                from None


def _run_in(out: Path, cfg: RunConfig, structures: Structures, calc,
            progress_stream: Optional[TextIO]) -> RunResult:
    frames = structures.frames
    files = {"log": out / "run.log", "config": out / "config.yaml"}
    atomic_write_text(files["config"], _yaml_dump(cfg.to_dict()))
    with RunLog(files["log"]) as log:
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
            summary, task_files = task(cfg, frames, calc, log, progress_stream)
        except KeyboardInterrupt:
            log.write("interrupted by the user; the files written so far are kept")
            raise
        except Exception as exc:
            log.write(f"stopped by an error ({type(exc).__name__}: {exc}); the files written "
                      "so far are kept")
            raise
        files.update(task_files)
        log.write("finished: " + ", ".join(f"{k}={_fmt(v)}" for k, v in summary.items()))
    return RunResult(cfg.task, out, files, getattr(calc, "backend", None), summary)


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
        print("mace-accel: device auto -> cpu (no CUDA GPU visible): the reference (plain "
              "torch) backend runs", file=sys.stderr)
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
        raise InputError(f"could not read structure file {str(path)!r} with ase.io.read: "
                         f"{type(exc).__name__}: {exc}") from None
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
            validate_atoms(atoms, info, min_distance=cfg.min_distance or None)
        except InputError as exc:
            text = str(exc).replace("lower min_distance", "lower `min_distance:` in the run file")
            raise InputError(f"{structures.where(i)}: {text}") from None


def check_task_inputs(cfg: RunConfig, structures: Structures) -> None:
    """What the task needs of its structure (a periodic cell for relax_cell and npt, a
    triangular cell for npt) and of ase, checked before anything is written."""
    atoms = structures.frames[0]
    if cfg.task == "geomopt" and cfg.geomopt.relax_cell:
        if not _periodic(atoms):
            raise InputError(f"geomopt.relax_cell needs a structure with a 3D periodic cell "
                             f"({structures.where(0)} has pbc={atoms.pbc.tolist()}); set "
                             "relax_cell: false or give the structure a cell and pbc")
        _cell_filter_class()
    if cfg.task == "md" and cfg.md.ensemble == "npt":
        _check_npt_cell(atoms, structures.where(0))
        _npt_class()


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
    the ASE calculator for geomopt and md."""
    if cfg.task == "singlepoint":
        from mace_accel.batched import BatchEvaluator

        return BatchEvaluator(model=_model_file(cfg), device=cfg.device, default_dtype=cfg.dtype,
                              head=cfg.head, backend=cfg.backend, verify=cfg.verify,
                              fallback=cfg.fallback, deterministic=cfg.deterministic,
                              min_distance=cfg.min_distance or None,
                              max_edges=cfg.singlepoint.max_edges, compute_stress=compute_stress)
    from mace_accel.calculator import MACEAccelCalculator

    return MACEAccelCalculator(model=_model_file(cfg), device=cfg.device,
                               default_dtype=cfg.dtype, head=cfg.head,
                               compute_stress=compute_stress, backend=cfg.backend,
                               verify=cfg.verify, fallback=cfg.fallback,
                               deterministic=cfg.deterministic,
                               min_distance=cfg.min_distance or None, graphs=cfg.graphs,
                               skin=cfg.skin)


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


class RunLog:
    """Timestamped lines in ``run.log``, flushed after each write."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.file: TextIO = open(self.path, "w")

    def write(self, text: str) -> None:
        stamp = datetime.datetime.now().isoformat(timespec="seconds")
        for line in str(text).splitlines() or [""]:
            self.file.write(f"{stamp}  {line}\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def snapshot(atoms, properties: Optional[List[str]] = None):
    """A copy of ``atoms`` holding its calculator's results in a ``SinglePointCalculator``.

    Args:
        properties: keep only these results (default: every standard ASE property computed).
    """
    from ase.calculators.calculator import all_properties
    from ase.calculators.singlepoint import SinglePointCalculator

    results = dict(atoms.calc.results) if atoms.calc is not None else {}
    keep = set(properties) if properties is not None else set(all_properties)
    results = {k: v for k, v in results.items() if k in keep}
    copy = atoms.copy()
    copy.calc = SinglePointCalculator(copy, **{k: np.array(v) if np.ndim(v) else v
                                               for k, v in results.items()})
    return copy


def write_frame(handle: TextIO, atoms) -> None:
    """Append one extxyz frame and flush it to disk."""
    import ase.io

    ase.io.write(handle, atoms, format="extxyz")
    handle.flush()


def _atomic_write_frames(path: Path, frames: List[Any]) -> None:
    with atomic_write(path, "w") as f:
        for atoms in frames:
            write_frame(f, atoms)


def _yaml_dump(data: Mapping[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(dict(data), sort_keys=False)


def _version() -> str:
    from mace_accel import __version__

    return __version__


def _progress(cfg: RunConfig, total: int, desc: str, stream: Optional[TextIO]):
    return progress_bar(total, desc=desc, stream=stream, enabled=None if cfg.progress else False)


def _max_force(atoms) -> float:
    forces = atoms.get_forces()
    return float(np.sqrt((forces**2).sum(axis=1)).max()) if len(forces) else 0.0


# ---------------------------------------------------------------------------------------------
# tasks: each returns (summary, {role: path})


def run_singlepoint(cfg: RunConfig, frames: List[Any], evaluator, log: RunLog,
                    progress_stream: Optional[TextIO] = None):
    """Evaluate ``singlepoint.properties`` on every frame, many frames per model call
    (:class:`~mace_accel.batched.BatchEvaluator`); write ``results.extxyz`` in input order."""
    from ase.calculators.singlepoint import SinglePointCalculator

    out = Path(cfg.outputs) / "results.extxyz"
    partial = out.with_name(out.name + ".partial")
    wanted = list(cfg.singlepoint.properties)
    skipped_stress = 0
    with open(partial, "w") as handle, _progress(cfg, len(frames), "singlepoint",
                                                 progress_stream) as bar:
        results = evaluator.iter_results(frames, progress=bar.update)
        for i, (atoms, result) in enumerate(zip(frames, results)):
            props = [p for p in wanted if p != "stress" or "stress" in result]
            skipped_stress += len(props) < len(wanted)
            frame = atoms.copy()
            frame.calc = SinglePointCalculator(frame, **{p: result[p] for p in props})
            write_frame(handle, frame)
            log.write(f"frame {i}: {len(atoms)} atoms, energy {result['energy']:.8f} eV")
    os.replace(partial, out)
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


def _cell_filter_class():
    try:
        from ase.filters import FrechetCellFilter

        return FrechetCellFilter
    except ImportError:
        pass
    try:
        from ase.filters import ExpCellFilter
    except ImportError:
        try:
            from ase.constraints import ExpCellFilter  # ase < 3.23
        except ImportError:
            raise InputError("geomopt.relax_cell needs ase's FrechetCellFilter or "
                             "ExpCellFilter; upgrade ase (pip install -U ase)") from None
    return ExpCellFilter


def _cell_filter(atoms):
    return _cell_filter_class()(atoms)


def run_geomopt(cfg: RunConfig, frames: List[Any], calc, log: RunLog,
                progress_stream: Optional[TextIO] = None):
    """Relax one frame with an ASE optimizer; trajectory as it goes, final frame atomically."""
    opts = cfg.geomopt
    atoms = frames[0]
    atoms.calc = calc
    if opts.relax_cell and not _periodic(atoms):
        raise InputError("geomopt.relax_cell needs a structure with a 3D periodic cell; set "
                         "relax_cell: false or give the structure a cell and pbc")
    out = Path(cfg.outputs)
    files: Dict[str, Path] = {"final": out / "final.extxyz"}
    fmax0 = _max_force(atoms)
    log.write(f"geomopt: {opts.optimizer}, fmax {opts.fmax} eV/Å, at most {opts.steps} steps, "
              f"relax_cell {opts.relax_cell}; initial max force {fmax0:.6g} eV/Å")
    target = _cell_filter(atoms) if opts.relax_cell else atoms
    with contextlib.ExitStack() as stack:
        traj = None
        if opts.traj_every:
            files["trajectory"] = out / "trajectory.extxyz"
            traj = stack.enter_context(open(files["trajectory"], "w"))
        bar = stack.enter_context(_progress(cfg, opts.steps, "geomopt", progress_stream))
        opt = _make_optimizer(opts.optimizer)(target, logfile=log.file)
        if traj is not None:
            opt.attach(lambda: write_frame(traj, snapshot(atoms)), interval=opts.traj_every)
        opt.attach(lambda: bar.update() if opt.nsteps else None, interval=1)
        converged = bool(opt.run(fmax=opts.fmax, steps=opts.steps))
    fmax1 = _max_force(atoms)
    _atomic_write_frames(files["final"], [snapshot(atoms)])
    if not converged:
        log.write(f"warning: not converged to fmax {opts.fmax} in {opts.steps} steps")
    summary = {"converged": converged, "steps": int(opt.nsteps), "initial_fmax": fmax0,
               "final_fmax": fmax1, "energy": float(atoms.get_potential_energy())}
    return summary, files


def _npt_class():
    try:
        from ase.md.melchionna import MelchionnaNPT

        return MelchionnaNPT
    except ImportError:
        pass
    try:
        from ase.md.npt import NPT
    except ImportError:
        raise InputError("md.ensemble npt needs ASE's NPT (Melchionna) integrator, which this ase "
                         "does not have; upgrade ase (pip install -U ase)") from None
    return NPT


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
    from ase import units

    md = cfg.md
    dt = md.timestep * units.fs
    if md.ensemble == "nve":
        from ase.md.verlet import VelocityVerlet

        return VelocityVerlet(atoms, timestep=dt)
    if md.ensemble == "nvt":
        from ase.md.langevin import Langevin

        try:  # ase >= 3.28 deprecates fixcm=True in favour of a FixCom constraint
            from ase.constraints import FixCom
        except ImportError:
            return Langevin(atoms, timestep=dt, temperature_K=md.temperature,
                            friction=md.friction / units.fs, rng=rng, fixcm=True)
        atoms.set_constraint(list(atoms.constraints) + [FixCom()])
        return Langevin(atoms, timestep=dt, temperature_K=md.temperature,
                        friction=md.friction / units.fs, rng=rng, fixcm=False)
    _check_npt_cell(atoms, "the structure")
    pfactor = (md.taup * units.fs) ** 2 * md.bulk_modulus * units.GPa
    return _npt_class()(atoms, timestep=dt, temperature_K=md.temperature,
                        externalstress=md.pressure * units.bar, ttime=md.taut * units.fs,
                        pfactor=pfactor)


def _init_velocities(atoms, temperature: float, seed: int, rng: np.random.Generator,
                     log: RunLog) -> None:
    from ase.md import velocitydistribution as vd

    if atoms.has("momenta") and np.any(atoms.get_momenta() != 0):
        log.write("md: starting from the momenta stored in the structure")
        return
    # ase >= 3.29 names it thermalize_momenta (and deprecates MaxwellBoltzmannDistribution)
    thermalize = getattr(vd, "thermalize_momenta", vd.MaxwellBoltzmannDistribution)
    thermalize(atoms, temperature_K=temperature, rng=rng)
    vd.Stationary(atoms)  # no drift of the centre of mass
    log.write(f"md: Maxwell-Boltzmann velocities at {temperature} K (seed {seed})")


class _StatsWriter:
    """Rows of ``stats.dat`` (whitespace columns, ``#`` header), flushed after each row."""

    def __init__(self, handle: TextIO, atoms, npt: bool, step_offset: Callable[[], int],
                 timestep_fs: float) -> None:
        self.handle, self.atoms, self.npt = handle, atoms, npt
        self.step_offset, self.timestep_fs = step_offset, timestep_fs
        columns = STATS_COLUMNS + (NPT_STATS_COLUMNS if npt else ())
        # "#" + names right-aligned over the 16-character value columns below them
        handle.write("#" + " ".join([f"{columns[0]:>15}"] + [f"{c:>16}" for c in columns[1:]])
                     + "\n")
        handle.flush()

    def __call__(self) -> None:
        from ase import units

        a = self.atoms
        step = self.step_offset()
        epot, ekin = a.get_potential_energy(), a.get_kinetic_energy()
        row = [f"{step:16d}", f"{step * self.timestep_fs:16.6f}", f"{epot:16.8f}",
               f"{ekin:16.8f}", f"{epot + ekin:16.8f}", f"{a.get_temperature():16.6f}"]
        if self.npt:
            pressure = -np.trace(a.get_stress(voigt=False, include_ideal_gas=True)) / 3.0
            row += [f"{a.get_volume():16.6f}", f"{pressure / units.bar:16.6f}"]
        self.handle.write(" ".join(row) + "\n")
        self.handle.flush()


def run_md(cfg: RunConfig, frames: List[Any], calc, log: RunLog,
           progress_stream: Optional[TextIO] = None):
    """Molecular dynamics of one frame; trajectory and stats as it goes, final frame atomically."""
    md = cfg.md
    atoms = frames[0]
    atoms.calc = calc
    rng = np.random.default_rng(md.seed)
    _init_velocities(atoms, md.temperature, md.seed, rng, log)
    dyn = _make_dynamics(cfg, atoms, rng)
    out = Path(cfg.outputs)
    files: Dict[str, Path] = {"stats": out / "stats.dat", "final": out / "final.extxyz"}
    log.write(f"md: {md.ensemble}, {md.steps} steps of {md.timestep} fs, {md.temperature} K"
              + (f", {md.pressure} bar" if md.ensemble == "npt" else ""))
    with contextlib.ExitStack() as stack:
        stats = stack.enter_context(open(files["stats"], "w"))
        dyn.attach(_StatsWriter(stats, atoms, md.ensemble == "npt", lambda: dyn.nsteps,
                                md.timestep), interval=md.stats_every)
        if md.traj_every:
            files["trajectory"] = out / "trajectory.extxyz"
            traj = stack.enter_context(open(files["trajectory"], "w"))
            dyn.attach(lambda: write_frame(traj, snapshot(atoms)), interval=md.traj_every)
        bar = stack.enter_context(_progress(cfg, md.steps, f"md {md.ensemble}", progress_stream))
        dyn.attach(lambda: bar.update() if dyn.nsteps else None, interval=1)
        dyn.run(md.steps)
    _atomic_write_frames(files["final"], [snapshot(atoms)])
    summary = {"steps": int(dyn.nsteps), "time_fs": dyn.nsteps * md.timestep,
               "final_temperature_K": float(atoms.get_temperature()),
               "final_epot": float(atoms.get_potential_energy())}
    return summary, files
