"""Where an ASE MD step of MACEAccelCalculator spends its time (GPU machine).

    python scripts/profile_md.py --model mp-medium --sizes 256,864 --steps 200

Per size: steps/s of velocity Verlet; the calculator's own split (checks, neighbour list,
model incl. the results' copy); the bare graph replay of the same call (with and without
stress); and the 25 functions with the most own time under cProfile (with ``--serial``
instead the same without the radial MLPs' overlap, one after the other in the process).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from ase import units
from ase.md.verlet import VelocityVerlet

from mace_accel.bench.backends import resolve_model_source
from mace_accel.bench.md import _thermalize
from mace_accel.bench.systems import build_system
from mace_accel.bench.timing import time_calls
from mace_accel.calculator import MACEAccelCalculator, CallTimings
from mace_accel.models.batch import model_info
from mace_accel.models.outputs import evaluate as evaluate_model
from mace_accel.options import AccelOptions


def profile(model_name: str, size: int, steps: int, dtype: str, overlap: bool = True,
            cprofile: bool = True) -> None:
    source = resolve_model_source(model_name)
    model = source.load(getattr(torch, dtype), torch.device("cuda"))
    atoms = build_system(model_info(model), size).atoms
    _thermalize(atoms, 300.0, 0)
    calc = MACEAccelCalculator(model, device="cuda", default_dtype=dtype,
                               options=AccelOptions(overlap_radial=overlap))
    atoms.calc = calc
    dyn = VelocityVerlet(atoms, timestep=1.0 * units.fs)
    dyn.run(20)  # captures, compiles
    calc.timings = CallTimings()
    builds = calc._resident.neighbours.n_builds
    t0 = time.perf_counter()
    dyn.run(steps)
    wall = time.perf_counter() - t0
    split = calc.timings.per_call_ms()
    print(f"{model_name} {dtype} {len(atoms)} atoms{'' if overlap else ' (serial)'}: "
          f"{steps / wall:.1f} steps/s, "
          f"{1e3 * wall / steps:.2f} ms/step; calculator per call: "
          + ", ".join(f"{k} {v:.3f} ms" for k, v in split.items())
          + f"; calls/step {calc.timings.calls / steps:.2f}; list rebuilds "
          f"{calc._resident.neighbours.n_builds - builds}; graphs {calc._graphed.buckets}",
          flush=True)
    batch = calc._resident.batch(atoms)
    for stress in (False, True):
        ms = time_calls(lambda: calc._graphed(batch, compute_stress=stress), "cuda", 5,
                        50).median_ms
        print(f"   bare graph replay (stress={stress}): {ms:.3f} ms", flush=True)
    if not cprofile:
        return
    prof = cProfile.Profile()
    prof.enable()
    dyn.run(min(steps, 100))
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue()[-6000:], flush=True)


def stress_profile(model_name: str, size: int, dtype: str) -> None:
    """The CUDA kernels of one eager call (as the calculator makes it) with and without stress,
    most time first."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    source = resolve_model_source(model_name)
    model = source.load(getattr(torch, dtype), torch.device("cuda"))
    atoms = build_system(model_info(model), size).atoms
    calc = MACEAccelCalculator(model, device="cuda", default_dtype=dtype, graphs=False)
    batch = calc._resident.batch(atoms)
    for stress in (False, True):
        call = lambda: evaluate_model(calc.model, dict(batch), stress)  # noqa: E731
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        print(f"== eager call, {len(atoms)} atoms, stress={stress}", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                        max_name_column_width=70), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mp-medium")
    parser.add_argument("--sizes", default="256,864")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--serial", action="store_true",
                        help="also run without the radial MLPs' overlap (no cProfile tables)")
    parser.add_argument("--stress-profile", type=int, default=0, metavar="ATOMS",
                        help="only profile the kernels of one call with and without stress")
    args = parser.parse_args()
    if args.stress_profile:
        stress_profile(args.model, args.stress_profile, args.dtype)
        return
    for size in (int(s) for s in args.sizes.split(",")):
        profile(args.model, size, args.steps, args.dtype, cprofile=not args.serial)
        if args.serial:
            profile(args.model, size, args.steps, args.dtype, overlap=False, cprofile=False)


if __name__ == "__main__":
    main()
