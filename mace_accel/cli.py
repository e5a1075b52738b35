"""``mace-accel``: convert, revert, inspect and run MACE models from the command line.

    mace-accel convert model.model fast.model --dtype float64 --backend cuda
    mace-accel revert fast.model plain.model
    mace-accel info model.model [--json]
    mace-accel run configs/md_nve.yaml [--set md.steps=100 --set device=cpu] [--dry-run]
    mace-accel bench ...            (when mace_accel.bench is installed)

This module only parses arguments, calls library functions and prints their results; stdout
carries only a command's output (``info --json`` is JSON), notes and warnings go to stderr.
Exit codes: 0 success; 2 anything the user can fix (any
:class:`~mace_accel.errors.MaceAccelError`, and OS errors on a path the user gave: permission
denied, a read-only filesystem, a full disk, not a folder, ...), reported as one ``error: ...``
line on stderr that names the file or key and the fix, never a traceback; 3 a run that finished
without reaching its goal (a geometry optimisation that did not converge: its files are written,
a ``warning:`` line says so); 1 any other OS failure (an I/O error), also one line; 130 Ctrl-C,
with one line saying what was left on disk.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from mace_accel.errors import InputError, Interrupted, MaceAccelError, OutputError
from mace_accel.files import NO_ROOM_ERRNOS, folder_problem, os_error_reason
from mace_accel.options import BACKENDS, DTYPE_NAMES

EXIT_OK, EXIT_OS_ERROR, EXIT_USER_ERROR, EXIT_NOT_CONVERGED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
# OS errors that mean "this path is wrong for what you asked", i.e. a user mistake (exit 2)
_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR,
                errno.EEXIST, errno.ENOENT, errno.ENAMETOOLONG, errno.ELOOP}


# ---------------------------------------------------------------------------------------------
# checks of the paths a command is given, before any work


def check_model_input(path: Path, what: str = "input model") -> None:
    """``path`` must be an existing file (a folder gets its own message)."""
    if path.is_dir():
        raise InputError(f"{what} {str(path)!r} is a folder, not a model file; give the path of "
                         "the .model file (a whole pickled MACE model)")
    if not path.is_file():
        raise InputError(f"{what} not found: {str(path)!r}; check the path")


def check_output_file(dst: Path, force: bool, src: Optional[Path] = None,
                      tag: str = "out") -> None:
    """Raise :class:`OutputError` unless ``dst`` can be written as a new file (or, with
    ``force``, replace one). Creates nothing.

    Args:
        src: the input file (its name, with ``-<tag>`` added, is the example of a file path
            offered when ``dst`` is a folder: never the input file's own path).
    """
    if dst.is_dir():
        stem, suffix = (src.stem, src.suffix or ".model") if src is not None else ("model",
                                                                                    ".model")
        example = dst / f"{stem}-{tag}{suffix}"
        raise OutputError(f"output {str(dst)!r} is a folder; give a file path such as "
                          f"{str(example)!r}")
    if dst.exists() or dst.is_symlink():
        if not force:
            same = src is not None and dst.exists() and dst.resolve() == src.resolve()
            what = "is the input file" if same else "exists"
            raise OutputError(f"output {str(dst)!r} {what}; choose another path or pass --force "
                              "to overwrite it")
    folder = dst.absolute().parent
    existing, problem = folder_problem(folder)
    if problem == "not a folder":
        raise OutputError(f"cannot write {str(dst)!r}: {str(existing)!r} is a file, not a "
                          "folder; choose another output path")
    if existing != folder:
        raise OutputError(f"cannot write {str(dst)!r}: folder {str(folder)!r} does not exist; "
                          f"create it first (mkdir -p {folder}) or choose another output path")
    if problem == "read-only":
        raise OutputError(f"cannot write {str(dst)!r}: folder {str(folder)!r} is on a read-only "
                          "filesystem; choose an output path on a writable one")
    if problem == "no permission":
        raise OutputError(f"cannot write {str(dst)!r}: no permission to write in folder "
                          f"{str(folder)!r}; choose another output path or fix its permissions")


def _save(model, dst: Path, force: bool) -> None:
    """``save_model`` with no-clobber unless ``force``: of two writers racing for a new path,
    the second gets an error instead of silently replacing the first one's file."""
    from mace_accel.models.checkpoint import save_model

    try:
        save_model(model, dst, overwrite=force)
    except RuntimeError as exc:
        # torch.save reports a failed write (a full disk) as a RuntimeError from its zip writer,
        # with the OSError as its context: say the OS error, naming the file (none was left)
        cause = exc.__context__
        if not isinstance(cause, OSError) or cause.errno is None:
            raise
        raise OSError(cause.errno, cause.strerror, str(dst)) from None
    except OutputError:
        if force or not dst.exists():
            raise
        # checked absent before loading: another process created it meanwhile
        raise OutputError(f"output {str(dst)!r} was created by another process while this one "
                          "was converting; it was left as it is and nothing was saved. Choose "
                          "another path or pass --force to overwrite it") from None


# ---------------------------------------------------------------------------------------------
# commands


def cmd_convert(args: argparse.Namespace) -> int:
    from mace_accel.models.checkpoint import load_model
    from mace_accel.options import AccelOptions
    from mace_accel.runs.tasks import check_device
    from mace_accel.surgery import accelerate

    src, dst = Path(args.input), Path(args.output)
    if args.lammps:
        return _convert_for_lammps(args, src, dst)
    if args.head is not None:
        raise InputError("--head is for --lammps (a calculator or a run picks its head itself)")
    options = AccelOptions(backend=args.backend, verify=not args.no_verify,
                           deterministic=not args.nondeterministic)
    check_model_input(src)
    check_output_file(dst, args.force, src, tag="accel")
    device = args.device or ("cuda" if args.backend == "cuda" else "cpu")
    check_device(device, fix="without a GPU, convert with --device cpu --backend reference")
    try:
        model = load_model(src, device=device, dtype=args.dtype)
        report = accelerate(model, options=options)
        print(report)
        _save(model.to("cpu"), dst, args.force)  # CPU tensors: the file loads on any machine
    except KeyboardInterrupt:
        raise Interrupted(f"{dst} was not written") from None
    print(f"saved the accelerated model to {dst}")
    return EXIT_OK


def _convert_for_lammps(args: argparse.Namespace, src: Path, dst: Path) -> int:
    """``convert --lammps``: the ML-IAP unified model file (the plain model, its head and
    dtype; each LAMMPS rank accelerates it on its own GPU, or runs the reference on a CPU)."""
    from mace_accel.lammps import LammpsModel
    from mace_accel.models.checkpoint import load_model, save_object
    from mace_accel.surgery import is_accelerated, revert

    check_model_input(src)
    check_output_file(dst, args.force, src, tag="mliap")
    dtype = args.dtype or "float64"
    try:
        model = load_model(src, device="cpu")
        if is_accelerated(model):
            revert(model)
        try:
            made = LammpsModel(model, head=args.head, dtype=dtype)
        except ValueError as exc:
            raise InputError(f"{exc}; pass --head with one of them") from None
        save_object(made, dst, overwrite=args.force)
    except KeyboardInterrupt:
        raise Interrupted(f"{dst} was not written") from None
    print(f"saved the LAMMPS ML-IAP model to {dst} ({dtype}, elements "
          f"{' '.join(made.element_types)}, cutoff {2 * made.rcutfac:g} Å). In the input file:")
    print(f"  pair_style mliap unified {dst} 0 exchange {made.exchange_width}")
    print(f"  pair_coeff * * {' '.join(made.element_types)}   "
          "# one element per atom type, in the order of the types")
    return EXIT_OK


def cmd_revert(args: argparse.Namespace) -> int:
    from mace_accel.models.checkpoint import load_model
    from mace_accel.surgery import revert

    src, dst = Path(args.input), Path(args.output)
    check_model_input(src)
    check_output_file(dst, args.force, src, tag="plain")
    try:
        model = load_model(src, device="cpu")
        n = revert(model)
        if n == 0:
            raise InputError(f"{str(src)!r} is not accelerated (no patched blocks); nothing to "
                             "revert")
        _save(model, dst, args.force)
    except KeyboardInterrupt:
        raise Interrupted(f"{dst} was not written") from None
    print(f"restored {n} block(s) to e3nn; saved the plain model to {dst}")
    return EXIT_OK


def format_plan(plan: Dict[str, Any], source: str) -> str:
    """``mace-accel info``'s text: the model, then per module each part fused or left."""
    lines = [f"model:       {plan['model']} ({source})",
             f"elements:    {' '.join(plan['elements'])} ({len(plan['elements'])})",
             f"r_max:       {plan['r_max']:g} Å",
             f"heads:       {', '.join(plan['heads'])}",
             f"dtype:       {plan['dtype']}",
             f"parameters:  {plan['parameters']:,}",
             f"accelerated: {'yes' if plan['accelerated'] else 'no'}",
             f"runs here:   {plan['runs_here']}",
             f"modules ({len(plan['blocks'])}):"]
    verb = "fused" if plan["accelerated"] else "would be fused"
    for b in plan["blocks"]:
        lines.append(f"  {b['path'] or '(model)'}: {b['block']}")
        if b["tensor_product"] is not None:
            lines.append(f"    conv_tp: {b['tensor_product']}")
        if b["skipped"] and not b["parts"]:
            lines.append(f"    left: {b['skipped']}")
        for part in b["parts"]:
            status = verb if part["fused"] else "left"
            lines.append(f"    {part['part']:<22} {status}: {part['detail']}")
    return "\n".join(lines)


def cmd_info(args: argparse.Namespace) -> int:
    from mace_accel.models.checkpoint import load_model

    path = Path(args.model)
    check_model_input(path, "model file")
    from mace_accel.surgery import describe_model

    plan = describe_model(load_model(path, device="cpu"))
    print(json.dumps(plan_as_json(plan), indent=2) if args.json else format_plan(plan, str(path)))
    return EXIT_OK


def plan_as_json(plan: Dict[str, Any]) -> Dict[str, Any]:
    """``info --json``'s document: ``patched`` (each block) and ``fused`` (each part) say what
    is so now, ``would_patch`` and ``would_fuse`` what ``accelerate`` does (for a plain model:
    everything ``patched``/``fused`` false, the plan in ``would_*``)."""
    now = bool(plan["accelerated"])
    blocks = []
    for block in plan["blocks"]:
        parts = [{**part, "fused": bool(part["fused"]) and now, "would_fuse": part["fused"]}
                 for part in block["parts"]]
        blocks.append({**block, "patched": bool(block["patched"]) and now,
                       "would_patch": block["patched"], "parts": parts})
    return {**plan, "blocks": blocks}


def cmd_run(args: argparse.Namespace) -> int:
    from mace_accel.runs.config import load_run_config, parse_override
    from mace_accel.runs.distributed import check_launch, current_world
    from mace_accel.runs.tasks import dry_run, run

    overrides = dict(parse_override(s) for s in args.set or [])
    cwd = Path.cwd()  # paths typed on the command line are relative to where it was typed
    if args.dry_run:
        print(dry_run(args.config, overrides, overrides_base=cwd, overwrite=args.overwrite))
        return EXIT_OK
    world = current_world()
    if world is not None:  # a rank of a torchrun launch: the run is shared over the ranks
        return _run_rank(args, overrides, cwd, world)
    if args.gpus is not None and args.gpus > 1:
        check_launch(load_run_config(args.config, overrides, overrides_base=cwd), args.gpus)
        return _launch_ranks(args)
    result = run(args.config, overrides, overrides_base=cwd, overwrite=args.overwrite,
                 warn=False)
    print(result)
    for text in result.warnings:
        print(f"warning: {text}", file=sys.stderr)
    return EXIT_OK if result.ok else EXIT_NOT_CONVERGED


def _run_rank(args: argparse.Namespace, overrides: Dict[str, Any], cwd: Path, world) -> int:
    """One rank of a shared run. An error the ranks agreed on is said once: by the launcher
    of ``--gpus`` (rank 0 hands it over, and every rank exits 0 so that torchrun does not add
    its own failure report), else by rank 0."""
    from mace_accel.runs.distributed import RankFailed, hand_to_launcher, run_distributed

    try:
        result = run_distributed(args.config, overrides, overrides_base=cwd,
                                 overwrite=args.overwrite)
    except RankFailed as exc:
        if hand_to_launcher(world, exc):
            return EXIT_OK
        if world.rank == 0:
            _print_error(str(exc))
        return exc.exit_code
    if result is not None:
        print(result)
    return EXIT_OK


def _launch_ranks(args: argparse.Namespace) -> int:
    """Start ``args.gpus`` ranks of this run with torchrun on this node, their output going
    straight to ours, and wait for them; an error they agreed on is printed as one line."""
    import subprocess
    import tempfile

    from mace_accel.runs.distributed import ERROR_FILE_ENV, launcher_error

    argv = ["run", str(Path(args.config).resolve())]
    for item in args.set or []:
        argv += ["--set", item]
    if args.overwrite:
        argv.append("--overwrite")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.gpus}", "-m", "mace_accel.cli", *argv]
    with tempfile.TemporaryDirectory(prefix="mace-accel-") as tmp:
        error_file = Path(tmp) / "error.json"
        env = dict(os.environ, **{ERROR_FILE_ENV: str(error_file)})
        # torchrun would set 1 thread per process (with a banner); a fair share of the cores
        # matters when the processes are CPU ones
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.gpus)))
        process = subprocess.Popen(command, env=env)
        try:
            code = process.wait()
        except KeyboardInterrupt:  # a terminal's Ctrl-C reaches torchrun too: let it stop
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            raise Interrupted("the run's processes were stopped; rank 0 writes only once "
                              "every frame is evaluated (see run.log in the outputs folder "
                              "if it had begun)") from None
        error = launcher_error(error_file)
    if error is not None:
        _print_error(str(error))
        return error.exit_code
    if code == 0:
        return EXIT_OK
    _print_error(f"the {args.gpus} processes of the run stopped (torchrun exit {code}); "
                 "torchrun's report is above")
    return EXIT_OS_ERROR


# ---------------------------------------------------------------------------------------------
# parser


def _register_bench(subparsers: Any) -> None:
    """Add ``bench`` if the optional ``mace_accel.bench`` package is present.

    Only a missing package is tolerated; an import error inside an existing one propagates.
    """
    if importlib.util.find_spec("mace_accel.bench") is None:
        return
    if importlib.util.find_spec("mace_accel.bench.cli") is None:
        return
    importlib.import_module("mace_accel.bench.cli").add_bench_parser(subparsers)


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``error:`` line naming the help to read (exit 2),
    like every other error of the command line; subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    from mace_accel import __version__

    parser = _Parser(
        prog="mace-accel", description="Fused CUDA tensor products for MACE potentials: convert "
        "checkpoints, inspect models and run YAML-driven simulations.")
    parser.add_argument("--version", action="version", version=f"mace-accel {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("convert", help="accelerate a MACE checkpoint and save it",
                       description="Load a MACE model, patch its interaction blocks, verify them "
                       "against the original and save the result (kernels rebuild on load).")
    p.add_argument("input", metavar="IN", help="MACE model file (torch.save of the model)")
    p.add_argument("output", metavar="OUT", help="where to write the accelerated model")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="cast the model (default: keep its dtype)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="device to patch and verify on (default: cuda for the cuda backend)")
    p.add_argument("--backend", choices=BACKENDS, default="cuda",
                   help="fused backend (default: cuda)")
    p.add_argument("--nondeterministic", action="store_true",
                   help="allow float atomics in the CUDA backward (faster; repeats may differ "
                   "in the last bits)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the check against the unpatched model")
    p.add_argument("--lammps", action="store_true",
                   help="write a LAMMPS ML-IAP unified model file instead (pair_style mliap "
                   "unified; needs a LAMMPS built by scripts/build_lammps.sh); default dtype "
                   "float64")
    p.add_argument("--head", default=None,
                   help="with --lammps: the head of a multi-head model (default: its last)")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("revert", help="turn an accelerated checkpoint back into a plain one")
    p.add_argument("input", metavar="IN", help="accelerated model file")
    p.add_argument("output", metavar="OUT", help="where to write the plain e3nn model")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.set_defaults(func=cmd_revert)

    p = sub.add_parser("info", help="show a model and what accelerate would patch",
                       description="Print the model's elements, cutoff, heads, dtype and, per "
                       "interaction block, its tensor product and whether it would be patched. "
                       "Changes nothing.")
    p.add_argument("model", metavar="MODEL", help="MACE model file (plain or accelerated)")
    p.add_argument("--json", action="store_true",
                   help="machine-readable output (patched / fused: what is so now; would_patch "
                   "/ would_fuse: what convert does)")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("run", help="run a YAML run file (singlepoint, geomopt, md)",
                       description="Run a YAML run file; see configs/ for examples. Relative "
                       "paths in the file are taken from the file's folder, those given with "
                       "--set from the current folder. Exit 0: done; 2: an error (one line on "
                       "stderr); 3: a geomopt that did not converge (files written, a warning "
                       "on stderr).")
    p.add_argument("config", metavar="CONFIG.yaml", help="run file")
    p.add_argument("--set", metavar="KEY=VALUE", action="append",
                   help="override a key before validation, e.g. --set md.steps=100 "
                   "--set device=cpu (repeatable)")
    p.add_argument("--dry-run", action="store_true",
                   help="run every check (run file, model, each frame of the structure, "
                   "outputs folder) and show the run, without running it or writing files")
    p.add_argument("--overwrite", action="store_true",
                   help="if the outputs folder holds an earlier run's files, delete them first "
                   "(default: refuse the folder; other files are never deleted)")
    p.add_argument("--gpus", type=_positive_int, default=None, metavar="N",
                   help="singlepoint: share the frames over N GPUs of this node (starts N "
                   "processes with torchrun; with `device: cpu`, N CPU processes: a testing aid)")
    p.set_defaults(func=cmd_run)

    _register_bench(sub)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr)


def quiet_library_warnings() -> None:
    """Hide the known deprecation noise of torch/e3nn/mace (inside ``catch_warnings``)."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"e3nn\.")
    warnings.filterwarnings("ignore", message=r".*TorchScript type system.*")
    warnings.filterwarnings("ignore", message=r".*TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD.*")
    warnings.filterwarnings("ignore", message=r".*weights_only.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*torch\.jit\.\w+.? is deprecated.*")


def _print_error(text: str) -> None:
    first, *rest = text.splitlines() or [""]
    print(f"error: {first}", file=sys.stderr)
    for line in rest:
        print(f"  {line}", file=sys.stderr)


def _os_error(exc: OSError) -> int:
    """One line for an OS error, naming a filesystem's state where it is one; exit 2 if the
    user can fix it (a wrong path, a read-only filesystem, a full disk), 1 if the system
    failed."""
    what = os_error_reason(exc)
    path = exc.filename
    if exc.errno in NO_ROOM_ERRNOS:
        where = f"cannot write {str(path)!r}" if path is not None else "cannot write"
        _print_error(f"{where}: {what}; free space there or write somewhere else")
        return EXIT_USER_ERROR
    if exc.errno == errno.EROFS and path is not None:
        _print_error(f"cannot write {str(path)!r}: {what}; choose a path on a writable "
                     "filesystem")
        return EXIT_USER_ERROR
    if exc.errno in _PATH_ERRNOS and path is not None:
        _print_error(f"cannot use {str(path)!r}: {what}; check that the path is right and that "
                     "you may write there")
        return EXIT_USER_ERROR
    _print_error(f"{str(path)!r}: {what}" if path is not None else what)
    return EXIT_OS_ERROR


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``mace-accel`` console script; returns the exit code."""
    with warnings.catch_warnings():
        # warnings reach a CLI user as one line; library noise from e3nn/torch is hidden
        warnings.showwarning = _show_warning
        quiet_library_warnings()
        try:
            args = build_parser().parse_args(argv)
            return args.func(args)
        except MaceAccelError as exc:
            _print_error(str(exc) or type(exc).__name__)
            return EXIT_USER_ERROR
        except OSError as exc:
            return _os_error(exc)
        except KeyboardInterrupt as exc:
            note = getattr(exc, "note", "") or "nothing was written"
            print(f"error: interrupted; {note}", file=sys.stderr)
            return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
