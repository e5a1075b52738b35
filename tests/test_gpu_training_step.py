"""Training steps captured as CUDA graphs (mace_accel.training.TrainingStep) follow the eager
steps: the same losses step by step and the same weights after, across batches of several
structures in two shape buckets, a learning-rate change (a new capture), new weights loaded
in place (read by the next replay) and new constants in the buffers (a new capture)."""

from __future__ import annotations

import copy

import pytest
import torch

import mace_accel
from mace_accel.models.architectures import build_model
from mace_accel.training import TrainingStep

from fine_tuning import SMALL_DENSITY, fine_tune_losses, labelled_batch

pytestmark = pytest.mark.gpu
BOUND = {torch.float64: 1e-9, torch.float32: 1e-4}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_captured_fine_tuning_follows_the_plain_models_loss_curve(dtype):
    plain, captured = fine_tune_losses("mpa0-small-test", dtype, "cuda", steps=12,
                                       training_step=True, graphs=True)
    rel = [abs(a - b) / abs(b) for a, b in zip(captured, plain)]
    assert max(rel) <= BOUND[dtype], rel


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_captured_steps_equal_eager_steps_across_buckets_and_changes(dtype):
    base = build_model(SMALL_DENSITY, dtype=torch.float64, seed=4).to("cuda", dtype)
    mace_accel.accelerate(base, verify=False)
    base.train()
    for p in base.parameters():
        p.requires_grad_(True)
    batches = [labelled_batch(base, n_structures=2, seed=1),
               labelled_batch(base, n_structures=3, seed=2)]
    weights = {k for k, _ in base.named_parameters()}
    # the buffers are the architecture's constants (r_max, Bessel frequencies, distance
    # transform): new values there are read by no replay, they mean a new capture
    new_constants = {k: v * 1.001 if v.is_floating_point() and k not in weights else v
                     for k, v in base.state_dict().items()}
    runs = []
    for graphs in (False, True):
        model = copy.deepcopy(base)
        # capturable in both runs: torch's capturable Adam keeps its step count in the default
        # dtype (float32 here), so its bias correction differs from the eager Adam's by ~1e-8
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
        step = TrainingStep(model, optimizer, graphs=graphs)
        losses = [float(step(batches[i % 2])) for i in range(6)]
        optimizer.param_groups[0]["lr"] = 5e-4  # baked into the graphs: captured afresh
        losses += [float(step(batches[i % 2])) for i in range(4)]
        with torch.no_grad():  # in place: the next replay reads the new weights
            for p in model.parameters():
                p.mul_(1.01)
        losses += [float(step(batches[i % 2])) for i in range(4)]
        model.load_state_dict(new_constants)  # captured afresh
        losses += [float(step(batches[i % 2])) for i in range(4)]
        runs.append((losses, [p.detach().clone() for p in model.parameters()], step))
    (eager, eager_params, _), (captured, captured_params, step) = runs
    rel = [abs(a - b) / abs(b) for a, b in zip(captured, eager)]
    assert max(rel) <= BOUND[dtype], [f"step {i}: {r:.1e}" for i, r in enumerate(rel)
                                      if r > BOUND[dtype]]
    # two buckets, captured again after the lr and after the new constants
    assert step.n_captures == 6, step.n_captures
    assert len(step.buckets) == 2
    for a, b in zip(captured_params, eager_params):
        torch.testing.assert_close(a, b, rtol=BOUND[dtype] * 10, atol=BOUND[dtype])
