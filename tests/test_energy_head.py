"""The lean energy head (mace_accel.models.energy_head): the same energies, node energies, forces
and stress as mace's own forward, for every interaction class, MACE and ScaleShiftMACE,
multi-head and pair-repulsion models; and mace's forward wherever it does not apply."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.build import bulk, molecule
from helpers import default_dtype

import mace_accel
from mace_accel.errors import VerificationError
from mace_accel.models import energy_head
from mace_accel.models.architectures import Architecture, build_model
from mace_accel.models.batch import model_info
from mace_accel.models.frames import FrameBatcher, host_frame, species_table
from mace_accel.models.outputs import evaluate
from mace_accel.patches.interaction_blocks import INTERACTION_BLOCK_CLASSES
from mace_accel.tolerances import energy_error, rel_norm_error

KEYS = ("energy", "node_energy", "forces", "stress")


def _frames():
    solid = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 1, 1))
    solid.set_cell(solid.cell.array @ np.array([[1, 0.05, 0], [0, 1, 0.02], [0, 0, 1]]),
                   scale_atoms=True)
    solid.rattle(0.05, seed=1)
    solid.numbers[::3] = 1
    mol = molecule("CH3OH")
    mol.rattle(0.02, seed=2)
    return [solid, mol]


def _batch(model, head=None):
    info = model_info(model)
    frames = _frames()
    batcher = FrameBatcher(frames[0], info, head or info.heads[0], torch.float64, "cpu")
    table = species_table(info)
    return batcher.collate([host_frame(a, info, table) for a in frames])


def _model(interaction="RealAgnosticResidualInteractionBlock", scale_shift=True,
           heads=("Default",)):
    arch = Architecture(hidden_irreps="8x0e+8x1o", r_max=4.0, elements=(1, 6, 8, 29), max_ell=2,
                        correlation=2, num_bessel=4, radial_mlp=(16, 16), mlp_irreps="4x0e",
                        interaction=interaction, interaction_first=interaction,
                        avg_num_neighbors=8.0, heads=tuple(heads))
    with default_dtype(torch.float64):
        model = build_model(arch, dtype=torch.float64, scale_shift=scale_shift)
    for p in model.parameters():
        p.requires_grad_(False)
    if scale_shift:  # a scale-shift that changes the numbers (built as 1 and 0)
        scale, shift = model.scale_shift.scale, model.scale_shift.shift
        scale.copy_(torch.linspace(1.3, 0.7, scale.numel()).reshape(scale.shape))
        shift.copy_(torch.linspace(-0.4, 0.2, scale.numel()).reshape(shift.shape))
    return model


def _compare(model, head=None, tol=1e-12):
    want = model(_batch(model, head), training=False, compute_force=True, compute_stress=True)
    got = evaluate(model, _batch(model, head), compute_stress=True)
    for key in KEYS:
        assert got[key].shape == want[key].shape, key
        assert got[key].dtype == want[key].dtype, key
        assert rel_norm_error(got[key], want[key]) < tol, (key, rel_norm_error(got[key], want[key]))
    plain = evaluate(model, _batch(model, head), compute_stress=False)
    assert set(plain) == {"energy", "node_energy", "forces"}
    assert rel_norm_error(plain["forces"], want["forces"]) < tol
    assert got["stress"][0].abs().max() > 1e-6  # a real stress was compared
    return got


# MACE without the scale-shift for one interaction class by default: the head does not depend on
# which class made the node features (every class runs with the scale-shift)
@pytest.mark.parametrize("interaction, scale_shift", [
    *[(name, True) for name in INTERACTION_BLOCK_CLASSES],
    *[pytest.param(name, False, marks=() if name == "RealAgnosticResidualInteractionBlock"
                   else pytest.mark.slow) for name in INTERACTION_BLOCK_CLASSES]])
def test_lean_head_equals_maces_forward(interaction, scale_shift):
    model = _model(interaction, scale_shift)
    report = mace_accel.accelerate(model, backend="reference")
    assert energy_head.lean_plan(model) is not None
    assert any(n.startswith("energy head: lean") for n in report.notes)
    _compare(model)


def test_multi_head_model_selects_each_nodes_head():
    model = _model(heads=("first", "second"))
    mace_accel.accelerate(model, backend="reference")
    plan = energy_head.lean_plan(model)
    assert plan is not None
    first, second = _compare(model, "first"), _compare(model, "second")
    assert rel_norm_error(first["energy"], second["energy"]) > 1e-6  # the heads differ


def test_pair_repulsion_is_part_of_the_head():
    from mace.modules.radial import ZBLBasis

    model = _model()
    with default_dtype(torch.float64):
        model.pair_repulsion_fn = ZBLBasis(p=5)
    model.pair_repulsion = True
    mace_accel.accelerate(model, backend="reference")
    assert energy_head.lean_plan(model).pair_repulsion
    _compare(model)


def test_forces_are_the_same_bits_as_maces():
    model = _model()
    mace_accel.accelerate(model, backend="reference")
    want = model(_batch(model), training=False, compute_force=True)
    got = evaluate(model, _batch(model), compute_stress=False)
    assert torch.equal(got["forces"], want["forces"])


def test_models_it_does_not_apply_to_run_maces_forward(tiny_model, monkeypatch):
    plain = tiny_model()
    assert energy_head.lean_plan(plain) is None  # not accelerated: nothing changes

    off = tiny_model()
    with monkeypatch.context() as m:
        m.setattr(energy_head, "_LEAN", False)  # the tests' switch
        report = mace_accel.accelerate(off, backend="reference")
        assert energy_head.lean_plan(off) is None
    assert "energy head: mace's forward (the lean head is switched off)" in report.notes

    hooked = tiny_model()
    mace_accel.accelerate(hooked, backend="reference")
    seen = []
    hooked.register_forward_hook(lambda module, args, out: seen.append(1))
    assert energy_head.lean_plan(hooked) is None
    assert "forward hooks" in energy_head.plan_head(hooked)[1]
    evaluate(hooked, _batch(hooked), compute_stress=False)
    assert seen == [1]  # the user's hook ran: mace's forward was called

    extra = tiny_model()
    mace_accel.accelerate(extra, backend="reference")
    extra.les_block = torch.nn.Identity()
    plan, reason = energy_head.plan_head(extra)
    assert plan is None and "les_block" in reason


def test_verification_covers_the_lean_head(tiny_model, monkeypatch):
    """accelerate(verify=True) compares the lean head's results with the unpatched forward."""
    real = energy_head.forward

    def shifted(model, plan, data):
        out = real(model, plan, data)
        out.energy = out.energy + 1.0
        return out

    monkeypatch.setattr(energy_head, "forward", shifted)
    model = tiny_model()
    with pytest.raises(VerificationError, match="energy"):
        mace_accel.accelerate(model, backend="reference")
    assert not mace_accel.is_accelerated(model)


def test_segment_sums_match_index_add():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(50, 3, generator=gen, dtype=torch.float32)
    ptr = torch.tensor([0, 7, 7, 31, 50])
    batch = torch.repeat_interleave(torch.arange(4), ptr.diff())
    want = torch.zeros(4, 3, dtype=torch.float64).index_add_(0, batch, values.double())
    got = energy_head.segment_sums(values, ptr)
    assert got.dtype == torch.float64
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert torch.count_nonzero(got[1]) == 0  # an empty structure sums to zero


def test_receiver_sums_and_their_gradients_match_a_scatter_sum():
    """The density blocks' per-receiver sums (a segmented sum, gradient written as a gather): the
    values, the gradient and the second derivative of a scatter sum; a node without edges gets
    zero."""
    from mace_accel.patches.nonlinear_block import receiver_sums

    gen = torch.Generator().manual_seed(1)
    n_nodes, n_edges = 9, 40
    edge_index = torch.stack([torch.randint(0, n_nodes, (n_edges,), generator=gen),
                              torch.randint(0, n_nodes - 1, (n_edges,), generator=gen)])
    values = torch.randn(n_edges, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    got = receiver_sums(values, edge_index, n_nodes)
    want = torch.zeros(n_nodes, 2, dtype=torch.float64).index_add(0, edge_index[1], values)
    assert torch.allclose(got, want, rtol=0, atol=1e-12) and not got[-1].any()
    g = torch.randn(n_nodes, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    (gv,) = torch.autograd.grad(got, values, g, create_graph=True)
    (want_gv,) = torch.autograd.grad(want, values, g, create_graph=True)
    assert torch.equal(gv, want_gv)
    # training on forces differentiates the gradient again (here in the incoming gradient)
    assert torch.equal(torch.autograd.grad(gv.square().sum(), g)[0],
                       torch.autograd.grad(want_gv.square().sum(), g)[0])
    assert torch.autograd.gradgradcheck(lambda v: receiver_sums(v, edge_index, n_nodes),
                                        (values,))


def test_divide_rows_and_its_gradients_match_a_division():
    """The blocks' ``message / density term`` with its gradient written directly: values,
    gradients and second derivatives of torch's division."""
    from mace_accel.patches.nonlinear_block import divide_rows

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    d = (torch.rand(7, 1, generator=gen, dtype=torch.float64) + 0.5).requires_grad_(True)
    assert torch.allclose(divide_rows(x, d), x / d, rtol=1e-15, atol=0)
    assert torch.autograd.gradcheck(divide_rows, (x, d))
    assert torch.autograd.gradgradcheck(divide_rows, (x, d))
    wide = torch.rand(7, 5, generator=gen, dtype=torch.float64) + 0.5  # not one per row
    assert torch.equal(divide_rows(x, wide), x / wide)


def _cuda_model(dtype):
    from mace_accel.models.checkpoint import default_model_path, load_model

    model = load_model(default_model_path(), device="cuda", dtype=dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    mace_accel.accelerate(model)
    return model


def _cuda_batch(model):
    from mace_accel.models.batch import atoms_to_batch

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(3)
    atoms.rattle(0.05, seed=3)
    atoms.numbers[::4] = 28
    return atoms_to_batch(atoms, model_info(model), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_gpu_lean_head_matches_and_repeats_bit_for_bit(dtype):
    from mace_accel.tolerances import MODEL_TOL

    model = _cuda_model(dtype)
    batch = _cuda_batch(model)
    want = model(dict(batch), training=False, compute_force=True, compute_stress=True)
    first = evaluate(model, dict(batch), compute_stress=True)
    for key in ("node_energy", "forces", "stress"):
        assert rel_norm_error(first[key], want[key]) < MODEL_TOL[dtype], key
    assert energy_error(first["energy"], want["energy"], want["node_energy"]) < MODEL_TOL[dtype]
    # the total is its per-atom terms' sum in float64, rounded once to the model's dtype
    exact = first["node_energy"].double().sum()
    terms = first["node_energy"].double().abs().sum()
    assert abs(first["energy"].double() - exact).item() \
        <= torch.finfo(dtype).eps * abs(exact) + 1e-13 * terms
    for _ in range(3):  # the energies too: no atomics in the lean head's sums
        again = evaluate(model, dict(batch), compute_stress=True)
        assert all(torch.equal(again[k], first[k]) for k in KEYS)


@pytest.mark.gpu
def test_gpu_lean_head_launches_fewer_kernels(monkeypatch):
    from torch.profiler import ProfilerActivity, profile

    def kernels(model) -> int:
        batch = _cuda_batch(model)
        evaluate(model, dict(batch), compute_stress=False)  # warm
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            evaluate(model, dict(batch), compute_stress=False)
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)

    model = _cuda_model(torch.float32)
    lean = kernels(model)
    monkeypatch.setattr(energy_head, "_LEAN", False)  # mace's forward, the same fused blocks
    maces = kernels(model)
    assert lean <= maces - 15, (lean, maces)
