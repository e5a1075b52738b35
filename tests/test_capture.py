"""Whole-call CUDA graphs (mace_accel.capture): the padding contributes exactly zero (CPU, the
padded call run eagerly), the bucket ladder, and on a GPU the replayed graph against the eager
call of the same model (fp32 and fp64, stress, several structures through one bucket)."""

from __future__ import annotations

import pytest
import torch
from ase.build import bulk, molecule

import mace_accel
from mace_accel.capture import GraphedCall, bucket
from mace_accel.models.batch import atoms_to_batch, model_info
from mace_accel.models.checkpoint import default_model_path, load_model
from mace_accel.tolerances import MODEL_TOL, rel_norm_error

F32, F64 = torch.float32, torch.float64


def _model(dtype, device="cpu", backend="reference"):
    model = load_model(default_model_path(), device=device, dtype=dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    mace_accel.accelerate(model, backend=backend)
    return model


def _structures():
    cu = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2)
    cu.rattle(0.05, seed=1)
    cu.numbers[::3] = 28
    cluster = molecule("CH4")  # non-periodic, elements replaced by the model's
    cluster.numbers[:] = 29
    cluster.positions *= 2.2
    cluster.center(vacuum=3.0)
    return [cu, cluster]


def test_bucket_ladder():
    assert bucket(1) == bucket(16) == 16
    sizes = [bucket(n) for n in range(1, 5000)]
    assert all(b >= n for b, n in zip(sizes, range(1, 5000)))
    assert all(b % 8 == 0 for b in sizes)
    assert max(b / n for b, n in zip(sizes, range(1, 5000)) if n > 64) < 1.2
    assert max(b / n for b, n in zip(sizes, range(1, 5000)) if n > 256) < 1.12
    assert len(set(sizes)) < 60  # few distinct shapes, so few graphs


@pytest.mark.parametrize("stress", [True, False])
def test_padding_contributes_exactly_zero(stress):
    """The padded call (what a graph replays) gives the unpadded results to rounding (sums
    with extra exact zeros, in another order); the padding atoms get exactly zero forces."""
    model = _model(F64)
    info = model_info(model)
    graphed = GraphedCall(model, info.r_max)
    for atoms in _structures():
        batch = atoms_to_batch(atoms, info)
        want = model(dict(batch), training=False, compute_force=True,
                     compute_stress=stress and atoms.pbc.any())
        got = graphed.padded_eager(batch, compute_stress=stress and atoms.pbc.any())
        for key in ("energy", "node_energy", "forces"):
            assert rel_norm_error(got[key], want[key]) < 1e-13, key
        if stress and atoms.pbc.any():
            assert rel_norm_error(got["stress"], want["stress"]) < 1e-13
        assert torch.count_nonzero(got["padding"]["forces"]) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
def test_replayed_graph_matches_eager(dtype):
    model = _model(dtype, device="cuda", backend="cuda")
    info = model_info(model)
    graphed = GraphedCall(model, info.r_max)
    for stress in (True, False):
        for atoms in _structures():
            batch = atoms_to_batch(atoms, info, device="cuda")
            s = stress and bool(atoms.pbc.any())
            eager = graphed.padded_eager(batch, compute_stress=s)
            want = model(dict(batch), training=False, compute_force=True, compute_stress=s)
            for _ in range(2):  # the second call replays the captured graph
                got = {k: v.clone() for k, v in graphed(batch, compute_stress=s).items()}
            for key in ("energy", "forces") + (("stress",) if s else ()):
                assert rel_norm_error(got[key], want[key]) < MODEL_TOL[dtype], key
                assert rel_norm_error(got[key], eager[key]) < MODEL_TOL[dtype], key
    assert graphed.n_captures == len(graphed.buckets) <= 4
    # a moved structure in the same bucket replays the same graph with new inputs
    atoms = _structures()[0]
    atoms.positions[0] += 0.05
    batch = atoms_to_batch(atoms, info, device="cuda")
    n = graphed.n_captures
    got = graphed(batch, compute_stress=True)["forces"].clone()
    want = model(dict(batch), training=False, compute_force=True)["forces"]
    assert graphed.n_captures == n
    assert rel_norm_error(got, want) < MODEL_TOL[dtype]
