"""Batched evaluation (``mace_accel.batched``): the batch built from arrays equals mace's own,
results per frame equal the calculator's, in input order, and bad frames are named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk

from mace_accel import batched
from mace_accel.batched import BatchEvaluator
from mace_accel.calculator import MACEAccelCalculator
from mace_accel.errors import ConfigError, InputError
from mace_accel.models.batch import atoms_to_batch
from mace_accel.models.frames import FrameBatcher, host_frame, species_table

# mace-accel's own (reference) ops on the CPU, where backend "auto" runs mace's modules
REFERENCE = {"device": "cpu", "backend": "reference"}


def _frames(n: int = 9):
    """Periodic Cu/Ni cells of three sizes and a few molecules-in-vacuum, rattled."""
    rng = np.random.default_rng(3)
    frames = []
    for i in range(n):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 1, 1 + i % 3))
        atoms.numbers[rng.integers(0, len(atoms), 2)] = 28
        atoms.rattle(0.05, seed=i)
        if i % 3 == 2:  # a cluster without a cell
            atoms.pbc = False
            atoms.cell = np.zeros((3, 3))
        frames.append(atoms)
    return frames


@pytest.fixture(scope="module")
def evaluator():
    return BatchEvaluator(None, **REFERENCE, default_dtype="float64", max_edges=2500)


@pytest.fixture(scope="module")
def calculator():
    return MACEAccelCalculator(None, **REFERENCE, default_dtype="float64")


def _edge_set(batch):
    ei = batch["edge_index"].T.tolist()
    us = batch["unit_shifts"].round().to(torch.int64).tolist()
    return sorted(tuple(e) + tuple(s) for e, s in zip(ei, us))


def test_collated_batch_equals_maces_own(evaluator):
    """Every field mace's data path makes for a batch of frames, ours makes equal (edges as a
    set: vesin's order differs), for periodic and non-periodic frames together."""
    p = evaluator.prepared
    frames = _frames(3)
    batcher = FrameBatcher(frames[0], p.info, p.head, p.dtype, "cpu")
    table = species_table(p.info)
    ours = batcher.collate([host_frame(a, p.info, table) for a in frames])
    singles = [atoms_to_batch(a, p.info, head=p.head, dtype=p.dtype) for a in frames]
    offsets = np.cumsum([0] + [len(a) for a in frames])
    want_edges = sorted(
        tuple((s["edge_index"][:, k] + int(offsets[g])).tolist())
        + tuple(s["unit_shifts"][k].round().to(torch.int64).tolist())
        for g, s in enumerate(singles) for k in range(s["edge_index"].shape[1]))
    assert _edge_set(ours) == want_edges
    for name in singles[0]:
        if name in ("edge_index", "shifts", "unit_shifts") or name.endswith("weight") \
                or name in ("energy", "forces", "stress", "virials", "dipole", "polarizability"):
            continue
        if name == "ptr":
            want = torch.tensor(offsets)
        elif name == "batch":
            want = torch.cat([torch.full((len(a),), g) for g, a in enumerate(frames)])
        else:
            want = torch.cat([s[name] for s in singles])
        assert name in ours, name
        assert ours[name].dtype == want.dtype, name
        if name in ("volume", "rcell"):  # mace derives these in torch's default dtype
            torch.testing.assert_close(ours[name], want, rtol=1e-6, atol=1e-9, msg=name)
        else:
            assert torch.equal(ours[name], want), name
    # each edge's shift is its unit shift times its own graph's cell
    graph_of_edge = ours["batch"][ours["edge_index"][0]]
    cells = ours["cell"].view(-1, 3, 3)[graph_of_edge]
    want_shifts = torch.einsum("ei,eij->ej", ours["unit_shifts"], cells)
    torch.testing.assert_close(ours["shifts"], want_shifts, rtol=0, atol=1e-12)


def test_results_equal_calculator_in_input_order(evaluator, calculator):
    frames = _frames()
    calls_before = evaluator.n_calls
    results = evaluator.evaluate(frames)
    assert evaluator.n_calls - calls_before > 1  # max_edges=2500 forces several chunks
    assert len(results) == len(frames)
    for atoms, got in zip(frames, results):
        atoms = atoms.copy()
        atoms.calc = calculator
        assert got["energy"] == pytest.approx(atoms.get_potential_energy(), abs=1e-10)
        np.testing.assert_allclose(got["forces"], atoms.get_forces(), atol=1e-10)
        np.testing.assert_allclose(got["energies"], calculator.results["energies"], atol=1e-10)
        if atoms.pbc.any():
            np.testing.assert_allclose(got["stress"], atoms.get_stress(), atol=1e-10)
        else:
            assert "stress" not in got


def test_one_chunk_equals_many_chunks():
    frames = _frames(6)
    one = BatchEvaluator(None, **REFERENCE, default_dtype="float64", verify=False,
                         max_edges=10**7)
    many = BatchEvaluator(None, **REFERENCE, default_dtype="float64", verify=False,
                          max_edges=1)
    a, b = one.evaluate(frames), many.evaluate(frames)
    assert one.n_calls == 1 and many.n_calls == len(frames)
    for x, y in zip(a, b):
        assert x["energy"] == pytest.approx(y["energy"], abs=1e-10)
        np.testing.assert_allclose(x["forces"], y["forces"], atol=1e-10)


def test_progress_counts_frames():
    evaluator = BatchEvaluator(None, **REFERENCE, default_dtype="float64", verify=False,
                               max_edges=800)
    seen = []
    evaluator.evaluate(_frames(5), progress=seen.append)
    assert sum(seen) == 5 and len(seen) >= 2


@pytest.mark.parametrize("bad, match", [
    (lambda: Atoms("Au2", positions=[[0, 0, 0], [0, 0, 2.5]]), "frame 2: .*Au"),
    (lambda: Atoms("Cu2", positions=[[0, 0, 0], [0, 0, 0.1]]), "frame 2: .*apart"),
    (lambda: Atoms("Cu2", positions=[[0, 0, 0], [0, 0, np.nan]]), "frame 2: .*NaN"),
    (lambda: "not atoms", "frame 2: not an ase.Atoms"),
])
def test_bad_frame_is_named(evaluator, bad, match):
    frames = _frames(2) + [bad()] + _frames(1)
    with pytest.raises(InputError, match=match):
        evaluator.evaluate(frames)


def test_out_of_memory_splits_the_chunk(monkeypatch):
    """A chunk that runs out of device memory is retried in halves with a smaller budget."""
    ev = BatchEvaluator(None, **REFERENCE, default_dtype="float64", verify=False,
                        max_edges=10**7)
    frames = _frames(4)
    want = [r["energy"] for r in ev.evaluate(frames)]
    real = batched.evaluate_model

    def tight(model, batch, compute_stress):
        if int(batch["ptr"].numel()) - 1 > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return real(model, batch, compute_stress)

    monkeypatch.setattr(batched, "evaluate_model", tight)
    got = [r["energy"] for r in ev.evaluate(frames)]
    assert got == pytest.approx(want, abs=1e-10)
    assert ev.budget.max_edges < 10**7


def test_single_frame_out_of_memory_is_a_clear_error(monkeypatch):
    ev = BatchEvaluator(None, **REFERENCE, default_dtype="float64", verify=False)

    def never(model, batch, compute_stress):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(batched, "evaluate_model", never)
    with pytest.raises(InputError, match="does not fit"):
        ev.evaluate(_frames(1))


@pytest.mark.parametrize("kwargs, match", [
    ({"max_edges": 0}, "max_edges"), ({"max_edges": True}, "max_edges"),
    ({"memory_fraction": 1.5}, "memory_fraction"), ({"workers": 0}, "workers"),
])
def test_bad_options(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        BatchEvaluator(None, **REFERENCE, **kwargs)


def test_empty_iterable_and_generator(evaluator):
    assert evaluator.evaluate([]) == []
    frames = _frames(3)
    from_generator = evaluator.evaluate(a for a in frames)  # any iterable, consumed once
    assert [r["energy"] for r in from_generator] == [r["energy"]
                                                     for r in evaluator.evaluate(frames)]



@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gpu_batched_equals_calculator_and_measures_memory(dtype):
    """On a GPU the fused kernels evaluate the batch; the first chunk measures the budget."""
    frames = _frames(9)
    evaluator = BatchEvaluator(None, device="cuda", default_dtype=dtype, fallback="error",
                               probe_edges=2000)
    assert evaluator.backend == "cuda"
    results = evaluator.evaluate(frames)
    assert evaluator.budget.source == "measured" and evaluator.budget.bytes_per_edge > 0
    assert evaluator.budget.max_edges > 2000
    calc = MACEAccelCalculator(None, device="cuda", default_dtype=dtype, fallback="error",
                               graphs=False, verify=False)
    tol = 1e-9 if dtype == "float64" else 1e-4
    for atoms, got in zip(frames, results):
        atoms = atoms.copy()
        atoms.calc = calc
        assert got["energy"] == pytest.approx(atoms.get_potential_energy(), abs=tol * len(atoms))
        np.testing.assert_allclose(got["forces"], atoms.get_forces(), atol=tol * 10)
