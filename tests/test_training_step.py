"""mace_accel.training.TrainingStep on the CPU: the loss is mace's WeightedEnergyForcesLoss, the
padded step (what a captured step computes) equals the unpadded one in the loss and every
gradient, the step follows the plain model's fine-tuning curve, and what a captured step baked
in is watched. The captured steps themselves run in tests/test_gpu_training_step.py."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import mace_accel
from mace_accel.capture import padded_shape
from mace_accel.errors import InputError
from mace_accel.models.architectures import build_model
from mace_accel.training import TrainingStep

from fine_tuning import SMALL_DENSITY, fine_tune_losses, labelled_batch


@pytest.fixture(scope="module")
def small():
    model = build_model(SMALL_DENSITY, dtype=torch.float64, seed=4)
    mace_accel.accelerate(model, backend="reference", verify=False)
    return model.train()


def _trainable(model):
    model = copy.deepcopy(model)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def _mace_loss(model, batch):
    """mace's own WeightedEnergyForcesLoss of the plain forward."""
    from mace.modules.loss import WeightedEnergyForcesLoss

    class Ref(dict):  # mace's loss reads ref.ptr and ref["energy"]
        __getattr__ = dict.__getitem__

    inputs = dict(batch)
    inputs["positions"] = batch["positions"].clone().requires_grad_(True)
    out = model(inputs, training=True, compute_force=True)
    return WeightedEnergyForcesLoss(energy_weight=2.0, forces_weight=10.0).to(
        torch.float64)(Ref(batch), out)


def test_the_loss_is_maces_weighted_energy_forces_loss(small):
    model = _trainable(small)
    batch = labelled_batch(model, n_structures=3, seed=1)
    batch["weight"] = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    want = float(_mace_loss(_trainable(small), batch))
    step = TrainingStep(model, torch.optim.Adam(model.parameters(), lr=1e-3), energy_weight=2.0,
                        forces_weight=10.0, graphs=False)
    assert float(step(batch)) == pytest.approx(want, rel=1e-12)


def test_the_padded_step_equals_the_unpadded_one(small):
    """Padding atoms, edges and the dummy structure change neither the loss nor any gradient
    (the captured step is this padded step, replayed)."""
    batch = labelled_batch(small, n_structures=2, seed=2)
    results = []
    for padded in (False, True):
        model = _trainable(small)
        step = TrainingStep(model, torch.optim.SGD(model.parameters(), lr=0.0), graphs=False)
        if padded:
            n, e = batch["positions"].shape[0], batch["edge_index"].shape[1]
            bucket = step._new_bucket((*padded_shape(n, e), 2), batch)
            step._fill(bucket, batch)
            assert bucket.entry.inputs["positions"].shape[0] > n
            loss = step._padded_step(bucket)
        else:
            loss = step(batch)
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((float(loss), grads))
    (loss0, grads0), (loss1, grads1) = results
    assert loss1 == pytest.approx(loss0, rel=1e-12)
    assert len(grads0) == len(grads1) > 0
    for a, b in zip(grads0, grads1):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-13)


def test_training_steps_follow_the_plain_models_loss_curve():
    plain, steps = fine_tune_losses("mpa0-small-test", torch.float64, "cpu", steps=4,
                                    training_step=True)
    np.testing.assert_allclose(steps, plain, rtol=1e-9)


def test_what_a_captured_step_baked_in_is_watched(small):
    model = _trainable(small)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = TrainingStep(model, optimizer, graphs=False)
    step(labelled_batch(model, n_structures=1, seed=3))
    before = step._current_fingerprint()
    with torch.no_grad():  # new values in the same storage: a replay reads them
        next(model.parameters()).mul_(1.01)
    assert step._current_fingerprint() == before
    optimizer.param_groups[0]["lr"] = 5e-4  # a float hyper-parameter is baked into the graph
    assert step._current_fingerprint() != before
    optimizer.param_groups[0]["lr"] = 1e-3
    assert step._current_fingerprint() == before
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # new state tensors
    assert step._current_fingerprint() != before
    before = step._current_fingerprint()
    with torch.no_grad():  # a buffer (the architecture's constants, read when kernels are made)
        next(b for b in model.buffers() if b.is_floating_point()).mul_(1.0)
    assert step._current_fingerprint() != before
    before = step._current_fingerprint()
    mace_accel.revert(model)
    assert step._current_fingerprint() != before


def test_bad_input_is_one_clear_error(small, monkeypatch):
    model = _trainable(small)
    with pytest.raises(InputError, match="graphs=False"):
        TrainingStep(model, torch.optim.Adam(model.parameters()), graphs=True)
    monkeypatch.setattr("mace_accel.training.graphs_unavailable_reason", lambda device: None)
    with pytest.raises(InputError, match="capturable=True"):
        TrainingStep(model, torch.optim.Adam(model.parameters()), graphs=True)
    step = TrainingStep(model, torch.optim.Adam(model.parameters()), graphs=False)
    batch = labelled_batch(model, n_structures=1, seed=3)
    del batch["forces"]
    with pytest.raises(InputError, match="no forces"):
        step(batch)
