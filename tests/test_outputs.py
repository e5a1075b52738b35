"""The stress from the edges (mace_accel.models.outputs) equals mace's displacement stress, on
batches of several structures (triclinic, cubic, no cell), plain and accelerated models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.build import bulk, molecule

import mace_accel
from mace_accel.models.batch import model_info
from mace_accel.models.checkpoint import default_model_path, load_model
from mace_accel.models.frames import FrameBatcher, host_frame, species_table
from mace_accel.models.outputs import evaluate, stress_from_edges_supported
from mace_accel.tolerances import rel_norm_error


def _frames():
    skewed = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 1))
    skewed.set_cell(skewed.cell.array @ np.array([[1, 0.08, 0], [0, 1, 0.03], [0.02, 0, 1]]),
                    scale_atoms=True)
    skewed.rattle(0.05, seed=1)
    skewed.numbers[::3] = 28
    cubic = bulk("Ni", "fcc", a=3.52, cubic=True).repeat(2)
    cubic.rattle(0.04, seed=2)
    cluster = molecule("CH4")
    cluster.numbers[:] = 29
    cluster.positions *= 2.2
    return [skewed, cubic, cluster]


@pytest.mark.parametrize("accelerated", [False, True])
def test_stress_from_edges_equals_maces(accelerated):
    model = load_model(default_model_path(), device="cpu", dtype=torch.float64)
    for p in model.parameters():
        p.requires_grad_(False)
    if accelerated:
        mace_accel.accelerate(model, backend="reference")
    assert stress_from_edges_supported(model)
    info = model_info(model)
    frames = _frames()
    batcher = FrameBatcher(frames[0], info, info.heads[-1], torch.float64, "cpu")
    table = species_table(info)

    def batch():
        return batcher.collate([host_frame(a, info, table) for a in frames])

    want = model(batch(), training=False, compute_force=True, compute_stress=True)
    got = evaluate(model, batch(), compute_stress=True)
    for key in ("energy", "node_energy", "forces", "stress"):
        assert rel_norm_error(got[key], want[key]) < 1e-12, key
    assert torch.count_nonzero(got["stress"][2]) == 0  # no cell: zero, as mace
    assert got["stress"][0].abs().max() > 1e-4  # a real stress was compared
    plain = evaluate(model, batch(), compute_stress=False)
    assert rel_norm_error(plain["forces"], want["forces"]) < 1e-12


def test_other_models_take_maces_path():
    assert not stress_from_edges_supported(torch.nn.Linear(3, 1))
