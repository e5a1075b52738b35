"""The radial MLPs' overlap (mace_accel.patches.radial.overlap): who gets linked, the report,
pickling (CPU); on a GPU, the forked call against the serial one, bit for bit, eager, in a
captured graph and in training (the energy up to the order of mace's atomic energy sum, see
``gpu_helpers.assert_same_results``)."""

from __future__ import annotations

import pickle

import ase.build
import numpy as np
import pytest
import torch

import mace_accel
from mace_accel.models.architectures import build_architecture, small_test_model
from mace_accel.options import AccelOptions
from mace_accel.patches.radial import overlap as radial_overlap
from mace_accel.patches.radial.mlp import FusedRadialMLP
from mace_accel.patches.radial.overlap import RadialOverlap
from gpu_helpers import assert_same_results

KEYS = ("energy", "forces", "stress")


class _Member(torch.nn.Module):
    """A stand-in radial MLP: ``compute`` counts its calls."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale, self.calls = scale, 0

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.scale


class _Model(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Member(float(i + 1)) for i in range(n))


def _is_member(m: torch.nn.Module) -> bool:
    return isinstance(m, _Member)


def test_link_needs_the_cuda_backend_and_two_blocks(monkeypatch):
    cuda = AccelOptions(backend="cuda")
    for options, n in ((AccelOptions(backend="reference"), 2), (cuda, 1)):
        model = _Model(n)
        assert radial_overlap.link(model, options, _is_member) is None
        assert all(b.overlap is None for b in model.blocks)
    with monkeypatch.context() as m:
        m.setattr(radial_overlap, "_OVERLAP", False)  # the tests' serial order
        model = _Model(2)
        assert radial_overlap.link(model, cuda, _is_member) is None
        assert all(b.overlap is None for b in model.blocks)
    model = _Model(3)
    group = radial_overlap.link(model, cuda, _is_member)
    assert group is not None and group.members == list(model.blocks)
    assert all(b.overlap is group for b in model.blocks)
    assert "MLPs 2..3 of the model's 3" in group.describe()


def test_off_the_gpu_every_block_computes_its_own_in_order():
    model = _Model(3)
    group = radial_overlap.link(model, AccelOptions(backend="cuda"), _is_member)
    x = torch.randn(5, 4)
    outs = [group(b, x) for b in model.blocks]
    for i, (b, out) in enumerate(zip(model.blocks, outs)):
        assert b.calls == 1
        assert torch.equal(out, x * (i + 1))
    assert not group._pending
    assert group(_Member(7.0), x).equal(x * 7.0)  # not a member: its own, serially


def test_overlap_pickles_without_results():
    model = _Model(2)
    group = radial_overlap.link(model, AccelOptions(backend="cuda"), _is_member)
    group._pending[1] = ("stale",)
    copy = pickle.loads(pickle.dumps(model))
    new = copy.blocks[0].overlap
    assert isinstance(new, RadialOverlap) and new is copy.blocks[1].overlap
    assert new.members == list(copy.blocks) and not new._pending


def test_start_forks_nothing_off_the_gpu():
    group = RadialOverlap([torch.nn.Identity(), torch.nn.Identity()])
    assert group.start(torch.randn(10, 4)) is False and not group._pending


def test_reference_backend_links_nothing_and_reports_no_overlap():
    model = small_test_model("RealAgnosticResidualInteractionBlock")
    report = mace_accel.accelerate(model, backend="reference", verify=False)
    assert not any("radial MLPs" in n for n in report.notes)
    assert report.to_dict()["notes"] == report.notes
    radials = [m for m in model.modules() if isinstance(m, FusedRadialMLP)]
    assert len(radials) == 2 and all(m.overlap is None for m in radials)


# -- on the GPU ------------------------------------------------------------------------------
def _cu_ni_batch(model, n: int = 3):
    from mace_accel.models.batch import atoms_to_batch, model_info

    atoms = ase.build.bulk("Cu", "fcc", a=3.61, cubic=True).repeat((n, n, n))
    atoms.numbers[np.random.default_rng(0).random(len(atoms)) < 0.5] = 28
    atoms.rattle(0.05, seed=0)
    return atoms_to_batch(atoms, model_info(model), device="cuda")


def _patched_pair(dtype):
    """The same MACE-MP-medium model twice, patched with and without the overlap."""
    models = []
    for overlap in (True, False):
        model = build_architecture("mp-medium", dtype=dtype, device="cuda")
        with pytest.MonkeyPatch.context() as m:
            m.setattr(radial_overlap, "_OVERLAP", overlap)
            report = mace_accel.accelerate(model, options=AccelOptions(backend="cuda"))
        assert any("radial MLPs" in n for n in report.notes) == overlap
        models.append(model)
    return models


def _count_joins(monkeypatch) -> list:
    joined = []
    original = RadialOverlap._join

    def counting(pending, x, serial):
        joined.append(pending[0] is x)
        return original(pending, x, serial)

    monkeypatch.setattr(RadialOverlap, "_join", staticmethod(counting))
    return joined


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_forked_call_equals_the_serial_one_bit_for_bit(dtype, monkeypatch):
    forked, serial = _patched_pair(dtype)
    joined = _count_joins(monkeypatch)
    batch = _cu_ni_batch(forked)
    for _ in range(2):
        got = forked(dict(batch), training=False, compute_force=True, compute_stress=True)
        want = serial(dict(batch), training=False, compute_force=True, compute_stress=True)
        assert_same_results(got, want, KEYS, len(batch["positions"]))
    assert joined == [True, True]  # block 2 took the forked result, in each call


@pytest.mark.gpu
def test_the_lean_head_starts_every_block_early_bit_for_bit(monkeypatch):
    """The lean energy head forks every block's radial MLP, the first block's too, as soon as
    the edge features exist; the forces are those of the serial forward, bit for bit."""
    from mace_accel.models.outputs import evaluate

    forked, serial = _patched_pair(torch.float32)
    joined = _count_joins(monkeypatch)
    batch = _cu_ni_batch(forked)
    for _ in range(2):
        got = evaluate(forked, dict(batch), compute_stress=False)
        want = serial(dict(batch), training=False, compute_force=True)
        assert torch.equal(got["forces"], want["forces"])
    assert joined == [True, True] * 2  # both blocks took the early results, in each call


@pytest.mark.gpu
def test_forked_graph_replay_equals_the_serial_eager_call():
    from mace_accel.capture import GraphedCall
    from mace_accel.models.batch import model_info

    forked, serial = _patched_pair(torch.float32)
    batch = _cu_ni_batch(forked)
    want = GraphedCall(serial, model_info(serial).r_max).padded_eager(batch, True)
    graphed = GraphedCall(forked, model_info(forked).r_max)
    for _ in range(3):
        assert_same_results(graphed(batch, compute_stress=True), want, KEYS,
                            len(batch["positions"]))
    assert graphed.n_captures == 1


@pytest.mark.gpu
def test_forked_training_step_equals_the_serial_one():
    """Training on forces: the forked radial MLPs' double backward runs on the side stream;
    the parameter gradients match the serial ones bit for bit."""
    forked, serial = _patched_pair(torch.float64)
    batch = _cu_ni_batch(forked, n=2)
    grads = []
    for model in (forked, serial):
        out = model(dict(batch), training=True, compute_force=True)
        loss = out["energy"].sum() + (out["forces"] ** 2).sum()
        params = [p for p in model.parameters() if p.requires_grad]
        grads.append(torch.autograd.grad(loss, params))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.gpu
def test_a_block_given_other_features_computes_its_own():
    forked, _ = _patched_pair(torch.float32)
    first, second = [m for m in forked.modules() if isinstance(m, FusedRadialMLP)]
    x = torch.randn(100, first.hs[0], device="cuda")
    first(x)
    other = x.clone()
    assert torch.equal(second(other), second.compute(other))
    assert not first.overlap._pending
