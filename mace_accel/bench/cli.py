"""``mace-accel bench``: the side-by-side benchmark of e3nn, cuEquivariance, OpenEquivariance
and mace-accel on the same batches, in one process.

The main CLI registers it with :func:`add_bench_parser`; ``python -m mace_accel.bench`` goes
through the main CLI too (:func:`mace_accel.cli.main`). Both end in :func:`run_from_args`, which
returns the exit code; the main CLI reports its errors as one ``error:`` line (exit 2).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, List, Sequence

from mace_accel.bench.choices import BACKENDS, DEFAULT_MODEL, DTYPES, SYSTEM_KINDS
from mace_accel.errors import Interrupted
from mace_accel.runs.outputs import check_output_dir

if TYPE_CHECKING:
    from mace_accel.bench.runner import BenchConfig

# torch and the modules that need it are imported inside the functions that run the benchmark:
# building the parser (``mace-accel --help``) must stay cheap.

EXIT_BACKEND_FAILED = 3
DESCRIPTION = """\
Time energy + forces of MACE models with each backend side by side on the same batch (CUDA
events, warm-up, median of many calls), check each backend's forces against e3nn, and write
bench.json, bench_table.txt and bench_times.png under --out. Backends that are not installed,
unavailable, failed or out of memory are reported as such, never dropped."""

EXAMPLES = """\
examples:
  mace-accel bench --models mpa0-medium,mh1,mp0-medium --dtypes float32,float64
  mace-accel bench --models my.model --sizes 512,4096 --backends e3nn,mace-accel --profile
  mace-accel bench --models mp-medium --max-size --backends cueq,mace-accel
  mace-accel bench --models off-medium --md --md-sizes 1000
  mace-accel bench --models mp-medium --backends e3nn,cueq,mace-accel --train --train-size 864
  mace-accel bench --device cpu --allow-reference --models mp-small --sizes 32 --repeats 3"""


def _csv(item: Callable[[str], object]) -> Callable[[str], List]:
    """argparse type of a comma-separated list (argparse names the option in its error)."""
    def parse(text: str) -> List:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("give a comma-separated list")
        try:
            return [item(t) for t in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"could not read {text!r} as a list of "
                                             f"{item.__name__}") from None
    return parse


def _choices(allowed: Sequence[str]) -> Callable[[str], List[str]]:
    def parse(text: str) -> List[str]:
        items = _csv(str)(text)
        bad = [i for i in items if i not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(bad)}; choose from {','.join(allowed)}")
        return items
    return parse


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``bench`` (shared by the subcommand and ``python -m``)."""
    what = parser.add_argument_group("what to run")
    what.add_argument("--models", type=_csv(str), default=[DEFAULT_MODEL],
                      help="comma-separated architectures of the released models with random "
                           "weights (mp0-medium, mpa0-medium, omat0-small, mh1, off23-small, "
                           "off23-medium, off23-large, off24-medium, omol-xl; also mp-small, "
                           "mp-medium (= mp0-medium), mp-large, off-small, off-medium, "
                           f"off-large) or model files (default: {DEFAULT_MODEL}, what "
                           "mace_mp() gives)")
    what.add_argument("--dtypes", type=_choices(DTYPES), default=None,
                      help="default: float32,float64 (on the CPU: float32)")
    what.add_argument("--sizes", type=_csv(int), default=None,
                      help="atom counts; fcc systems round to 4n^3 (default: 256,2048,6912; "
                           "on the CPU: 32,108)")
    what.add_argument("--backends", type=_choices(BACKENDS),
                      default=list(BACKENDS), help=f"default: {','.join(BACKENDS)}")
    what.add_argument("--system", choices=SYSTEM_KINDS, default="auto",
                      help="fcc Cu/Ni supercell, molecular H/C/N/O box, or auto by the "
                           "model's elements (default: auto)")
    what.add_argument("--stress", action="store_true", help="also compute the stress")
    what.add_argument("--device", default=None,
                      help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    what.add_argument("--allow-reference", action="store_true",
                      help="where mace-accel's CUDA backend cannot run, time its plain-torch "
                           "reference backend as 'mace-accel(reference)' instead of reporting "
                           "it unavailable")
    what.add_argument("--seed", type=int, default=0, help="structure seed (default: 0)")
    how = parser.add_argument_group("timing")
    how.add_argument("--warmup", type=int, default=None,
                     help="untimed calls (default: 5; on the CPU: 1)")
    how.add_argument("--repeats", type=int, default=None,
                     help="timed calls (default: 20; on the CPU: 3)")
    how.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                     help="stop starting new measurements after this long; the rest are "
                          "recorded as skipped (default: none)")
    more = parser.add_argument_group("extra modes")
    more.add_argument("--profile", action="store_true",
                      help="also break one call of each case into radial MLP, conv TP, "
                           "linears, symmetric contraction, other (torch.profiler)")
    more.add_argument("--max-size", action="store_true",
                      help="find the largest fcc/molecular system that fits in GPU memory per "
                           "model/dtype/backend (bisection over supercell size n)")
    more.add_argument("--max-size-cells", type=int, default=48, metavar="N",
                      help="upper bound of the search: n cells per side, 4n^3 atoms "
                           "(default: 48)")
    more.add_argument("--max-size-time-limit", type=float, default=120.0, metavar="SECONDS",
                      help="time limit of each search (default: 120)")
    more.add_argument("--md", action="store_true",
                      help="also measure MD throughput with the ASE calculators")
    more.add_argument("--md-sizes", type=_csv(int), default=[256],
                      help="atom counts for --md (default: 256)")
    more.add_argument("--md-steps", type=int, default=20, help="timed MD steps (default: 20)")
    more.add_argument("--md-warmup", type=int, default=5, help="untimed MD steps (default: 5)")
    more.add_argument("--md-compile", action="store_true",
                      help="with --md and cueq: also time mace's MACECalculator(enable_cueq=True, "
                           "compile_mode='reduce-overhead') (compiling takes minutes)")
    more.add_argument("--md-drift-steps", type=int, default=0, metavar="N",
                      help="with --md: also run N NVE steps (e.g. 10000) with mace-accel and "
                           "with e3nn behind the same calculator, and fit the energy drift "
                           "(default: 0, none)")
    more.add_argument("--throughput", type=int, default=0, metavar="FRAMES",
                      help="also time FRAMES structures of 64-256 atoms evaluated batched "
                           "(BatchEvaluator) vs one calculator call per structure (ours and "
                           "mace's with cueq, on the first 200) (default: 0, none)")
    more.add_argument("--throughput-gpus", type=_csv(int), default=[], metavar="N,...",
                      help="with --throughput: also evaluate the frames batched over N GPUs "
                           "(torchrun, one process per GPU), for each N given, e.g. 1,2,4")
    more.add_argument("--train", action="store_true",
                      help="also time one training step (energy + forces loss, backward, Adam) "
                           "per backend on the same batch and targets, and check that the "
                           "backends' first losses agree")
    more.add_argument("--train-size", type=int, default=864, metavar="N",
                      help="atoms of the --train batch (fcc rounds to 4n^3; default: 864)")
    more.add_argument("--train-steps", type=int, default=10,
                      help="timed training steps (default: 10)")
    more.add_argument("--train-warmup", type=int, default=3,
                      help="untimed training steps (default: 3)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"),
                        help="output folder (default: ./bench_out)")
    parser.add_argument("--summarize", type=Path, default=None, metavar="JSON",
                        help="print the tables of an earlier run's bench.json and exit")


# defaults of the options left out, on a GPU and on the CPU (where the GPU sizes take hours:
# one mp-medium call at 6,912 atoms takes minutes on a few CPU cores)
GPU_DEFAULTS = {"dtypes": ["float32", "float64"], "sizes": [256, 2048, 6912], "warmup": 5,
                "repeats": 20}
CPU_DEFAULTS = {"dtypes": ["float32"], "sizes": [32, 108], "warmup": 1, "repeats": 3}


def _defaults_for(args: argparse.Namespace, device: str) -> dict:
    """The values of the size options: given ones as given, the others by device."""
    import torch

    defaults = CPU_DEFAULTS if torch.device(device).type == "cpu" else GPU_DEFAULTS
    return {k: getattr(args, k) if getattr(args, k, None) is not None else v
            for k, v in defaults.items()}


def cpu_plan_note(config: BenchConfig, args: argparse.Namespace) -> str:
    """What a CPU run will do, and how to change it (printed before it starts)."""
    left_out = [k for k in CPU_DEFAULTS if getattr(args, k, None) is None]
    lines = [f"note: benchmarking on the CPU: {', '.join(config.models)}; "
             f"{','.join(config.dtypes)}; {', '.join(map(str, config.sizes))} atoms; "
             f"{config.warmup} warm-up + {config.repeats} timed calls per backend and size"]
    if left_out:
        lines.append("  (CPU-sized defaults for " + ", ".join(f"--{k}" for k in left_out)
                     + ": a few minutes at most; the GPU defaults, 256-6,912 atoms in float32 "
                     "and float64 with 5 + 20 calls, would take hours here)")
    if config.train:
        lines.append(f"  --train: {config.train_warmup} warm-up + {config.train_steps} timed "
                     f"training steps of {config.train_size} atoms per backend; a step costs "
                     "several calls (--train-size N for a smaller batch)")
    if max(config.sizes) > 1000:
        lines.append("  on the CPU one call of mp-medium takes about a second at 108 atoms and "
                     "grows with the atom count (minutes at 6,912 atoms); --time-limit SECONDS "
                     "bounds the run")
    return "\n".join(lines)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Validate the parsed options (raises :class:`~mace_accel.errors.ConfigError` with the fix)."""
    from mace_accel.bench.runner import BenchConfig

    device = args.device or _default_device()
    sized = _defaults_for(args, device)
    return BenchConfig(
        models=args.models, dtypes=sized["dtypes"], sizes=sized["sizes"], backends=args.backends,
        device=device, warmup=sized["warmup"], repeats=sized["repeats"],
        compute_stress=args.stress, allow_reference=args.allow_reference, system=args.system,
        seed=args.seed, time_limit_s=args.time_limit, max_size=args.max_size,
        max_size_cells=args.max_size_cells, max_size_time_limit_s=args.max_size_time_limit,
        md=args.md, md_sizes=args.md_sizes, md_steps=args.md_steps, md_warmup=args.md_warmup,
        md_compile=args.md_compile, md_drift_steps=args.md_drift_steps,
        throughput_frames=args.throughput, throughput_gpus=args.throughput_gpus,
        profile=args.profile, train=args.train, train_size=args.train_size,
        train_steps=args.train_steps, train_warmup=args.train_warmup)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 on success, 3 if it finished but a backend failed (its error is in
    the table and JSON). Invalid options raise :class:`~mace_accel.errors.MaceAccelError`, which
    the main CLI (:func:`mace_accel.cli.main`) reports as one ``error:`` line, exit 2."""
    import torch

    from mace_accel.bench.backends import resolve_model_source
    from mace_accel.bench.report import (
        JSON_NAME,
        environment,
        load_json,
        render_summary,
        write_json,
        write_outputs,
    )
    from mace_accel.bench.runner import run_bench

    if args.summarize is not None:
        print(render_summary(load_json(args.summarize)))
        return 0
    config = config_from_args(args)
    sources = [resolve_model_source(spec) for spec in config.models]
    out: Path = args.out
    check_output_dir(out, "--out folder", fix="choose another folder with --out DIR")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    if torch.device(config.device).type == "cpu":
        print(cpu_plan_note(config, args), file=sys.stderr)
        print("note: timing on the CPU with time.perf_counter (no CUDA device); mace-accel's "
              "CUDA backend is reported unavailable"
              + ("" if config.allow_reference else " (--allow-reference times its reference "
                                                   "backend instead)"), file=sys.stderr)
    try:
        result = run_bench(config, sources, log=lambda line: print(line, flush=True),
                           on_update=lambda r: write_json(r, out / JSON_NAME),
                           environment=environment(config.device))
    except KeyboardInterrupt:
        if (out / JSON_NAME).exists():
            raise Interrupted(f"the results measured so far are in {out / JSON_NAME}") from None
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise Interrupted("nothing was written (no measurement had finished)") from None
    for message in write_outputs(result, out):
        print(message)
    print()
    print(render_summary(result))
    failed = [r for r in list(result.records) + list(result.md) + list(result.train)
              if r.status.startswith("failed")]
    return EXIT_BACKEND_FAILED if failed else 0


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench`` on the main CLI's subparsers; sets ``func=run_from_args``."""
    parser = subparsers.add_parser(
        "bench", help="side-by-side benchmark of e3nn, cueq, oeq and mace-accel",
        description=DESCRIPTION, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run_from_args)
    return parser
