"""torch-sim batched MD: mace-accel's AcceleratedMaceModel vs torch-sim's own MaceModel
(e3nn, and with cuEquivariance), same systems, same process (GPU machine).

    python scripts/bench_torchsim.py --model mp-medium --systems 64 --atoms 108 --steps 100

Reports atoms x steps per second of ``ts.integrate(..., integrator=ts.nvt_langevin)`` after a
warm-up run, and each model's energies against ours on the first state.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from mace_accel.bench.backends import resolve_model_source
from mace_accel.bench.systems import build_system
from mace_accel.models.batch import model_info


def _systems(model, n_systems: int, n_atoms: int):
    info = model_info(model)
    return [build_system(info, n_atoms, seed=k).atoms for k in range(n_systems)]


def _models(base, dtype, device):
    import torch_sim.models.mace as ts_mace

    from mace_accel.torchsim import AcceleratedMaceModel

    yield "mace-accel", lambda: AcceleratedMaceModel(copy.deepcopy(base), device=device,
                                                      default_dtype=str(dtype).split(".")[1],
                                                      compute_stress=False)
    def theirs(cueq: bool):
        model = ts_mace.MaceModel(copy.deepcopy(base), device=device, dtype=dtype,
                                  compute_stress=False, enable_cueq=cueq)
        # torch-sim 0.3.0 leaves mace's cuEquivariance conversion on the CPU: move it back
        model.model = model.model.to(device)
        return model

    for cueq in (False, True):
        name = "torch-sim MaceModel" + (" (cueq)" if cueq else " (e3nn)")
        yield name, lambda cueq=cueq: theirs(cueq)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(model_name: str, n_systems: int, n_atoms: int, steps: int, dtype_name: str,
        device: torch.device) -> None:
    import torch_sim as ts

    dtype = getattr(torch, dtype_name)
    base = resolve_model_source(model_name).load(dtype, device)
    systems = _systems(base, n_systems, n_atoms)
    total_atoms = sum(len(a) for a in systems)
    reference = None
    model = None
    for name, make in _models(base, dtype, device):
        try:
            model = make()
            state = ts.io.atoms_to_state(systems, device, dtype)
            energy = model(state)["energy"].detach()
            if reference is None:
                reference = energy
            diff = float((energy - reference).abs().max())
            kwargs = dict(integrator=ts.nvt_langevin, temperature=300, timestep=0.001)
            ts.integrate(state, model, n_steps=5, **kwargs)  # warm-up (compile, capture)
            _sync(device)
            t0 = time.perf_counter()
            ts.integrate(state, model, n_steps=steps, **kwargs)
            _sync(device)
            seconds = time.perf_counter() - t0
            print(f"torchsim {model_name} {dtype_name} {n_systems}x{n_atoms} atoms, {name}: "
                  f"{total_atoms * steps / seconds:,.0f} atom-steps/s "
                  f"({1e3 * seconds / steps:.2f} ms/step; energy vs ours {diff:.2e} eV)",
                  flush=True)
        except Exception as exc:  # a model that cannot run is reported, the others still run
            print(f"torchsim {model_name} {dtype_name} {name}: failed: "
                  f"{type(exc).__name__}: {str(exc)[:200]}", flush=True)
        finally:
            model = None
            if device.type == "cuda":
                torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mp-medium")
    parser.add_argument("--systems", type=int, default=64)
    parser.add_argument("--atoms", type=int, default=108)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    run(args.model, args.systems, args.atoms, args.steps, args.dtype, torch.device(args.device))


if __name__ == "__main__":
    main()
