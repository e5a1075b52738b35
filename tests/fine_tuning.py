"""A short fine-tune of a small model, plain and accelerated, for the training tests (CPU with the
reference backend, GPU with the CUDA one): the same weights, data and Adam steps; the losses of
each step returned so the two curves can be compared."""

from __future__ import annotations

import copy
from typing import Dict, List, Tuple

import numpy as np
import torch

import mace_accel
from mace_accel.models.architectures import Architecture, build_model
from mace_accel.models.batch import atoms_to_batch, model_info
from mace_accel.training import TrainingStep

Tensor = torch.Tensor

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


def labelled_batch(model: torch.nn.Module, n_structures: int, seed: int) -> Dict[str, Tensor]:
    """A mace batch dict of ``n_structures`` structures (mace's own collation) with random
    ``energy [S]`` and ``forces [N, 3]`` labels, on the model's device and dtype."""
    from mace import data as mace_data
    from mace.tools import torch_geometric, utils

    info = model_info(model)
    p = next(model.parameters())
    keyspec = mace_data.KeySpecification(info_keys={}, arrays_keys={})
    graphs = [mace_data.AtomicData.from_config(
        mace_data.config_from_atoms(a, key_specification=keyspec, head_name=info.heads[-1]),
        z_table=utils.AtomicNumberTable(list(info.atomic_numbers)), cutoff=info.r_max,
        heads=list(info.heads)) for a in _structures(n_structures, seed)]
    batch = torch_geometric.Batch.from_data_list(graphs).to_dict()
    batch = {k: (v.to(p.device, p.dtype) if v.is_floating_point() else v.to(p.device))
             for k, v in batch.items() if torch.is_tensor(v)}
    g = torch.Generator().manual_seed(seed)
    n = batch["positions"].shape[0]
    batch["energy"] = torch.randn(n_structures, generator=g, dtype=torch.float64).to(p)
    batch["forces"] = 0.3 * torch.randn(n, 3, generator=g, dtype=torch.float64).to(p)
    return batch


def fine_tune_losses(name: str, dtype: torch.dtype, device: str, steps: int = 20,
                     lr: float = 1e-3, training_step: bool = False,
                     graphs: bool = False) -> Tuple[List[float], List[float]]:
    """``(plain losses, accelerated losses)`` of ``steps`` Adam steps on energies and forces
    (forces in the loss: a double backward through the model), from the same weights; with
    ``training_step`` the accelerated model trains through
    :class:`mace_accel.training.TrainingStep` (captured as CUDA graphs if ``graphs``)."""
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
        # the same optimizer arithmetic in both runs (capturable Adam rounds its bias
        # correction in the default dtype: see mace_accel.training)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr, capturable=graphs)
        losses = []
        if accelerated and training_step:
            train = TrainingStep(model, optimizer, graphs=graphs)
            for step in range(steps):
                batch = dict(batches[step % len(batches)])
                energy, forces = targets[step % len(batches)]
                batch["energy"], batch["forces"] = energy, forces
                losses.append(float(train(batch)))
            curves.append(losses)
            continue
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
