"""Whole models on the GPU: patched (CUDA kernels) vs unpatched MACE-MP-0 architectures."""

from __future__ import annotations

import ase.build
import numpy as np
import pytest
import torch

import mace_accel
from mace_accel.models.architectures import build_architecture
from mace_accel.models.batch import atoms_to_batch, model_info
from mace_accel.surgery import evaluate, unpatched
from mace_accel.tolerances import MODEL_TOL, rel_norm_error

pytestmark = pytest.mark.gpu


def _cu_ni(n: int = 3, seed: int = 0):
    atoms = ase.build.bulk("Cu", "fcc", a=3.61, cubic=True).repeat((n, n, n))
    rng = np.random.default_rng(seed)
    atoms.numbers[rng.random(len(atoms)) < 0.5] = 28
    atoms.rattle(0.05, seed=seed)
    return atoms


def _assert_matches_unpatched(model, dtype) -> None:
    """Energy, forces and stress of a Cu/Ni cell within the tolerance table of the
    unpatched model's."""
    batch = atoms_to_batch(_cu_ni(), model_info(model), device="cuda")
    got = evaluate(model, batch, compute_stress=True)
    with unpatched(model):
        want = evaluate(model, batch, compute_stress=True)
    for key in ("energy", "forces", "stress"):
        assert rel_norm_error(got[key], want[key]) < MODEL_TOL[dtype], key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("arch", ["mp-medium", "mp-large"])
def test_patched_matches_unpatched(arch, dtype):
    model = build_architecture(arch, dtype=dtype, device="cuda")
    report = mace_accel.accelerate(model, backend="cuda", verify=True)
    assert report.backend == "cuda"
    assert [r.kind for r in report.patched] == ["edge_features", "node_embedding"] + \
        ["interaction_block"] * 2 + ["product_block"] * 2 + ["readout_block"] * 2
    assert all(r.part("symmetric_contraction").fused for r in report.patched
               if r.kind == "product_block")
    _assert_matches_unpatched(model, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_recomputed_tp_weights_in_small_chunks_match_unpatched(dtype, monkeypatch):
    """The radial MLP's last layer folded into the conv, weights recomputed chunk by chunk."""
    from mace_accel.ops.conv_tp import folded

    monkeypatch.setattr(folded, "CHUNK_MEMORY_FRACTION", 1e-6)  # ~60 edges per chunk
    model = build_architecture("mp-medium", dtype=dtype, device="cuda")
    mace_accel.accelerate(model, backend="cuda", verify=False, options=mace_accel.AccelOptions(
        recompute_tp_weights="always"))
    _assert_matches_unpatched(model, dtype)


@pytest.mark.parametrize("recompute", ["never", "always"])
def test_training_double_backward_matches(recompute):
    """Loss on forces, differentiated w.r.t. parameters (double backward through the kernels)."""
    model = build_architecture("mp-medium", dtype=torch.float64, device="cuda")
    batch = atoms_to_batch(_cu_ni(2), model_info(model), device="cuda")
    mace_accel.accelerate(model, backend="cuda", verify=False,
                          options=mace_accel.AccelOptions(recompute_tp_weights=recompute))

    def param_grads():
        out = model(dict(batch), training=True, compute_force=True)
        loss = out["forces"].square().sum()
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.autograd.grad(loss, params, allow_unused=True)

    got = param_grads()
    with unpatched(model):
        want = param_grads()
    for a, b in zip(got, want):
        if b is not None:
            assert rel_norm_error(a, b) < 1e-9
