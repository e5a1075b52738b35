"""A short fine-tune of a small model, plain and accelerated, for the training tests (CPU with the
reference backend, GPU with the CUDA one): the same weights, data and Adam steps; the losses of
each step returned so the two curves can be compared."""

from __future__ import annotations

import copy
from typing import List, Tuple

import numpy as np
import torch

import mace_accel
from mace_accel.models.architectures import Architecture, build_model
from mace_accel.models.batch import atoms_to_batch, model_info

# a small model of MACE-MPA-0's kind: Density blocks, Agnesi transform, ZBL
SMALL_DENSITY = Architecture(hidden_irreps="16x0e+16x1o", r_max=4.5, elements=(1, 8, 28, 29),
                             max_ell=2, correlation=2, num_bessel=6, radial_mlp=(16, 16),
                             mlp_irreps="8x0e",
                             interaction="RealAgnosticDensityResidualInteractionBlock",
                             interaction_first="RealAgnosticDensityInteractionBlock",
                             avg_num_neighbors=12.0, distance_transform="Agnesi",
                             pair_repulsion=True)
MODELS = {"mpa0-small-test": SMALL_DENSITY}


def _structures(n: int, seed: int):
    from ase.build import bulk

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 1))
        atoms.set_atomic_numbers(rng.choice([28, 29], len(atoms)))
        atoms.numbers[0] = 8
        atoms.positions += rng.normal(0.0, 0.08, atoms.positions.shape)
        out.append(atoms)
    return out


def fine_tune_losses(name: str, dtype: torch.dtype, device: str, steps: int = 20,
                     lr: float = 1e-3) -> Tuple[List[float], List[float]]:
    """``(plain losses, accelerated losses)`` of ``steps`` Adam steps on energies and forces
    (forces in the loss: a double backward through the model), from the same weights."""
    base = build_model(MODELS[name], dtype=torch.float64, seed=4).to(device, dtype)
    backend = "cuda" if torch.device(device).type == "cuda" else "reference"
    frames = _structures(3, seed=5)
    info = model_info(base)
    batches = [atoms_to_batch(a, info, device=device) for a in frames]
    g = torch.Generator().manual_seed(6)
    targets = [(torch.randn(1, generator=g, dtype=torch.float64).to(device, dtype),
                0.3 * torch.randn(len(a), 3, generator=g, dtype=torch.float64).to(device, dtype))
               for a in frames]
    curves = []
    for accelerated in (False, True):
        model = copy.deepcopy(base).train()
        if accelerated:
            mace_accel.accelerate(model, backend=backend, verify=False)
        for p in model.parameters():
            p.requires_grad_(True)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        losses = []
        for step in range(steps):
            batch = dict(batches[step % len(batches)])
            energy, forces = targets[step % len(batches)]
            batch["positions"] = batch["positions"].clone().requires_grad_(True)
            out = model(batch, training=True, compute_force=True)
            n_atoms = batch["positions"].shape[0]
            loss = ((out["energy"] - energy) / n_atoms).pow(2).mean() \
                + (out["forces"] - forces).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        curves.append(losses)
    return curves[0], curves[1]
