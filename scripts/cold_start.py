"""A fresh process's first energy (GPU machine): import, ``MACEAccelCalculator`` construction and
the first energy + forces of 108 atoms (Cu/Ni fcc, float32), with the kernels compiled on the
way and what NVRTC takes for the same sources on 1, 4 and 16 threads. One model per process,
the kernel cache empty, Python's bytecode written (as after ``pip install``; where
``PYTHONDONTWRITEBYTECODE`` is set, run once under ``PYTHONPYCACHEPREFIX`` first, or every
process compiles torch's and mace's sources again):

    MACE_ACCEL_CACHE_DIR=$(mktemp -d) python scripts/cold_start.py [--model mpa0-medium]

``--model`` is a name of ``mace-accel bench --models`` (default: the bundled model).
"""

from __future__ import annotations

import time

START = time.perf_counter()  # before torch and mace_accel are imported

import argparse  # noqa: E402
import json  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="an architecture name (default: bundled)")
    args = parser.parse_args(argv)

    import torch
    from ase.build import bulk

    from mace_accel.ops import runtime

    sources = []
    compile_cubin = runtime._compile_to_caches

    def recorded(source, arch, options, key):  # every compile, foreground or background
        sources.append((source, arch, options))
        return compile_cubin(source, arch, options, key)

    runtime._compile_to_caches = recorded
    import cupy  # noqa: F401

    from mace_accel._e3nn_compat import import_mace
    from mace_accel.calculator import MACEAccelCalculator

    torch.zeros(1, device="cuda")  # the CUDA context
    imported = time.perf_counter()
    import_mace()
    import mace.modules  # noqa: F401

    mace_imported = time.perf_counter()
    model = None
    if args.model is not None:
        from mace_accel.models.architectures import build_architecture

        model = build_architecture(args.model, dtype=torch.float32)
    made = time.perf_counter()
    calc = MACEAccelCalculator(model=model)
    torch.cuda.synchronize()
    built = time.perf_counter()
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((3, 3, 3))
    atoms.symbols[::3] = "Ni"
    atoms.calc = calc
    atoms.get_forces()
    torch.cuda.synchronize()
    called = time.perf_counter()
    row = {"model": args.model or "bundled", "import_s": round(imported - START, 2),
           "mace_import_s": round(mace_imported - imported, 2),
           "architecture_s": round(made - mace_imported, 2),
           "construction_s": round(built - made, 2), "first_call_s": round(called - built, 2),
           "total_s": round(called - START, 2), "kernels": len(sources)}
    print(json.dumps(row), flush=True)

    from cupy_backends.cuda.libs import nvrtc

    def compile_again(item) -> None:  # no cache
        source, arch, options = item
        program = nvrtc.createProgram(source, "kernel.cu", [], [])
        nvrtc.compileProgram(program, [f"--gpu-architecture={arch}", *options])
        nvrtc.destroyProgram(program)

    seconds = {}
    for threads in (1, 4, 16):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(compile_again, sources))
        seconds[threads] = round(time.perf_counter() - t0, 2)
    print(json.dumps({"model": row["model"], "nvrtc_s_by_threads": seconds}), flush=True)


if __name__ == "__main__":
    main()
