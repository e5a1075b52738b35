"""``mace-accel``: convert, revert, inspect and run MACE models from the command line.

    mace-accel convert model.model fast.model --dtype float64 --backend cuda
    mace-accel revert fast.model plain.model
    mace-accel info model.model [--json]
    mace-accel run configs/md_nve.yaml [--set md.steps=100 --set device=cpu] [--dry-run]
    mace-accel bench ...            (when mace_accel.bench is installed)

This module only parses arguments, calls library functions and prints their results. User
errors (any :class:`~mace_accel.errors.MaceAccelError`) end with one ``error: ...`` line on
stderr and exit code 2; success is 0; an I/O failure (disk full, permission denied) is 1;
Ctrl-C is 130.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from mace_accel.errors import InputError, MaceAccelError
from mace_accel.options import BACKENDS, DTYPE_NAMES

EXIT_OK, EXIT_OS_ERROR, EXIT_USER_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130


# ---------------------------------------------------------------------------------------------
# commands


def _check_output(src: Path, dst: Path, force: bool) -> None:
    if not src.is_file():
        raise InputError(f"input model not found: {str(src)!r}")
    if dst.exists() and not force:
        same = dst.resolve() == src.resolve()
        what = "is the input file" if same else "exists"
        raise InputError(f"output {str(dst)!r} {what}; choose another path or pass --force to "
                         "overwrite it")
    if not dst.resolve().parent.is_dir():
        raise InputError(f"output directory {str(dst.resolve().parent)!r} does not exist")


def cmd_convert(args: argparse.Namespace) -> int:
    from mace_accel.models.checkpoint import load_model, save_model
    from mace_accel.runs.tasks import check_device
    from mace_accel.surgery import accelerate

    src, dst = Path(args.input), Path(args.output)
    _check_output(src, dst, args.force)
    device = args.device or ("cuda" if args.backend == "cuda" else "cpu")
    check_device(device, fix="without a GPU, convert with --device cpu --backend reference")
    model = load_model(src, device=device, dtype=args.dtype)
    report = accelerate(model, backend=args.backend, verify=not args.no_verify)
    print(report)
    save_model(model.to("cpu"), dst)  # CPU tensors: the file loads on any machine
    print(f"saved the accelerated model to {dst}")
    return EXIT_OK


def cmd_revert(args: argparse.Namespace) -> int:
    from mace_accel.models.checkpoint import load_model, save_model
    from mace_accel.surgery import revert

    src, dst = Path(args.input), Path(args.output)
    _check_output(src, dst, args.force)
    model = load_model(src, device="cpu")
    n = revert(model)
    if n == 0:
        raise InputError(f"{str(src)!r} is not accelerated (no patched blocks); nothing to revert")
    save_model(model, dst)
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
    if not path.is_file():
        raise InputError(f"model file not found: {str(path)!r}")
    from mace_accel.surgery import describe_model

    plan = describe_model(load_model(path, device="cpu"))
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan, str(path)))
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from mace_accel.runs.config import parse_override
    from mace_accel.runs.tasks import dry_run, run

    overrides = dict(parse_override(s) for s in args.set or [])
    cwd = Path.cwd()  # paths typed on the command line are relative to where it was typed
    if args.dry_run:
        print(dry_run(args.config, overrides, overrides_base=cwd))
        return EXIT_OK
    print(run(args.config, overrides, overrides_base=cwd))
    return EXIT_OK


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


def build_parser() -> argparse.ArgumentParser:
    from mace_accel import __version__

    parser = argparse.ArgumentParser(
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
    p.add_argument("--no-verify", action="store_true",
                   help="skip the check against the unpatched model")
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
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("run", help="run a YAML run file (singlepoint, geomopt, md)",
                       description="Run a YAML run file; see configs/ for examples.")
    p.add_argument("config", metavar="CONFIG.yaml", help="run file")
    p.add_argument("--set", metavar="KEY=VALUE", action="append",
                   help="override a key before validation, e.g. --set md.steps=100 "
                   "--set device=cpu (repeatable)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate and show the run without loading the model or writing files")
    p.set_defaults(func=cmd_run)

    _register_bench(sub)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``mace-accel`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        # warnings reach a CLI user as one line; library noise from e3nn/torch is hidden
        warnings.showwarning = _show_warning
        warnings.filterwarnings("ignore", category=UserWarning, module=r"e3nn\.")
        warnings.filterwarnings("ignore", message=r".*TorchScript type system.*")
        warnings.filterwarnings("ignore", message=r".*TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD.*")
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.\w+` is deprecated.*")
        try:
            return args.func(args)
        except MaceAccelError as exc:
            first, *rest = str(exc).splitlines() or [type(exc).__name__]
            print(f"error: {first}", file=sys.stderr)
            for line in rest:
                print(f"  {line}", file=sys.stderr)
            return EXIT_USER_ERROR
        except OSError as exc:  # disk full, permission denied, ...: the environment, not a bug
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_OS_ERROR
        except KeyboardInterrupt:
            print("error: interrupted; files written so far are kept", file=sys.stderr)
            return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
