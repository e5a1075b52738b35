"""Training through the accelerated model (reference backend, CPU): an Adam fine-tune on energies
and forces follows the plain model's loss curve (10 steps here; 20 on the CUDA backend in
tests/test_gpu_modern_models.py)."""

from __future__ import annotations

import pytest
import torch

from fine_tuning import fine_tune_losses


@pytest.mark.parametrize("dtype,bound", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
def test_fine_tuning_follows_the_plain_models_loss_curve(dtype, bound):
    plain, fast = fine_tune_losses("mpa0-small-test", dtype, "cpu", steps=10)
    assert len(plain) == len(fast) == 10 and plain[-1] < plain[0]  # it learns
    rel = [abs(a - b) / abs(b) for a, b in zip(fast, plain)]
    assert max(rel) <= bound, rel
