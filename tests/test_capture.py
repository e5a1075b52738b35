"""Whole-call CUDA graphs (mace_accel.capture): the padding contributes exactly zero (CPU, the
padded call run eagerly), the bucket ladder, and on a GPU the replayed graph against the eager
call of the same model (fp32 and fp64, stress, several structures through one bucket)."""

from __future__ import annotations

import pytest
import torch
from ase.build import bulk, molecule

import mace_accel
import numpy as np

from mace_accel.capture import (PAD_EDGES_PER_ATOM, GraphedCall, bucket, bucket_below,
                                padded_shape, unpack)
from mace_accel.models.batch import atoms_to_batch, model_info
from mace_accel.models.checkpoint import default_model_path, load_model
from mace_accel.tolerances import MODEL_TOL, energy_error, rel_norm_error

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


def test_padded_atoms_depend_only_on_the_edge_bucket():
    """MD's edge count wanders within a bucket as the list is rebuilt: the padded shape (so the
    graph) stays the same, and each padding atom carries at most PAD_EDGES_PER_ATOM edges."""
    rungs = sorted({bucket(n) for n in range(1, 100_000)})
    for low, high in zip(rungs, rungs[1:]):
        assert bucket_below(high) == low
    for n_atoms in (8, 256, 864, 6912):
        for e_pad in (r for r in rungs if 8 * n_atoms <= r <= 100 * n_atoms):
            counts = [e for e in range(bucket_below(e_pad) + 1, e_pad + 1) if bucket(e) == e_pad]
            shapes = {padded_shape(n_atoms, e) for e in counts}
            assert len(shapes) == 1, (n_atoms, e_pad, shapes)
            n_pad, e = shapes.pop()
            dummies = n_pad - n_atoms
            assert e == e_pad and dummies >= 1
            assert e_pad - min(counts) <= dummies * PAD_EDGES_PER_ATOM


@pytest.fixture(scope="module")
def cpu_graphed():
    """``(model, GraphedCall)``: the bundled model, float64, accelerated on the reference
    backend, and its padded calls (run eagerly on the CPU)."""
    model = _model(F64)
    return model, GraphedCall(model, model_info(model).r_max)


@pytest.mark.parametrize("stress", [True, False])
def test_packed_results_unpack_to_the_outputs(stress, cpu_graphed):
    """The one vector a step copies to the host holds the energy, stress, node energies,
    forces and the shortest interatomic distance of the real structure."""
    model, graphed = cpu_graphed
    info = model_info(model)
    atoms = _structures()[0]
    batch = atoms_to_batch(atoms, info)
    got = graphed.padded_eager(batch, compute_stress=stress)
    packed, shortest = unpack(got["packed"].numpy(), len(atoms), got["n_pad"], stress)
    assert packed["energy"] == got["energy"].item()
    np.testing.assert_array_equal(packed["forces"], got["forces"].detach().numpy())
    np.testing.assert_array_equal(packed["node_energy"], got["node_energy"].detach().numpy())
    if stress:
        np.testing.assert_array_equal(packed["stress"], got["stress"][0].detach().numpy())
    assert shortest == pytest.approx(atoms.get_all_distances(mic=True)[
        np.triu_indices(len(atoms), 1)].min(), abs=1e-12)


@pytest.mark.parametrize("stress", [True, False])
def test_padding_contributes_exactly_zero(stress, cpu_graphed):
    """The padded call (what a graph replays) gives the unpadded results to rounding (sums
    with extra exact zeros, in another order); the padding atoms get exactly zero forces."""
    model, graphed = cpu_graphed
    info = model_info(model)
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
@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
def test_replayed_graph_matches_eager(dtype):
    """The replays against the plain model's call, to the tolerance table; and against the
    eager padded call bit for bit, replay after replay: a replay runs the same deterministic
    kernels on the same padded inputs, and the lean energy head sums the energies without
    atomics."""
    model = _model(dtype, device="cuda", backend="cuda")
    info = model_info(model)
    graphed = GraphedCall(model, info.r_max)
    for stress in (True, False):
        for atoms in _structures():
            batch = atoms_to_batch(atoms, info, device="cuda")
            s = stress and bool(atoms.pbc.any())
            eager = graphed.padded_eager(batch, compute_stress=s)
            want = model(dict(batch), training=False, compute_force=True, compute_stress=s)
            calls = [{k: v.clone() for k, v in graphed(batch, compute_stress=s).items()
                      if torch.is_tensor(v)} for _ in range(3)]  # captured, then replayed
            got = calls[-1]
            # the energy against its per-atom terms' scale: mace sums them in float32
            assert energy_error(got["energy"], want["energy"], want["node_energy"]) \
                < MODEL_TOL[dtype]
            for key in ("forces",) + (("stress",) if s else ()):
                assert rel_norm_error(got[key], want[key]) < MODEL_TOL[dtype], key
            for key in ("energy", "node_energy", "forces") + (("stress",) if s else ()):
                assert all(torch.equal(call[key], eager[key]) for call in calls), key
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


@pytest.mark.gpu
def test_new_edges_in_the_same_bucket_rebuild_the_edge_orderings():
    """The graph reads edge orderings built outside it: a new neighbour list within the bucket
    rebuilds them in place, and the replay gives the new structure's forces."""
    model = _model(F64, device="cuda", backend="cuda")
    info = model_info(model)
    graphed = GraphedCall(model, info.r_max)

    def structure(seed):
        atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2)
        atoms.rattle(0.1, seed=seed)
        atoms.numbers[::3] = 28
        return atoms_to_batch(atoms, info, device="cuda")

    first, second = structure(1), structure(6)
    shapes = [padded_shape(32, int(b["edge_index"].shape[1])) for b in (first, second)]
    assert shapes[0] == shapes[1]  # one bucket, one graph
    assert first["edge_index"].shape != second["edge_index"].shape \
        or not torch.equal(first["edge_index"], second["edge_index"])
    for batch in (first, second, first):
        got = graphed(batch, compute_stress=False)["forces"].clone()
        want = model(dict(batch), training=False, compute_force=True)["forces"]
        assert rel_norm_error(got, want) < MODEL_TOL[F64]
    assert graphed.n_captures == 1
