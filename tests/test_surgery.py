"""Model surgery on CPU with the reference backend: accelerate / revert / PatchReport.

Matrix (kept small: building a MACE model is the expensive part, ~1-3 s each). A model has two
interaction blocks and ``small_test_model`` takes a class for each, so each model covers two
classes. Ten models cover every one of the six block classes with every hidden irreps (8x0e,
8x0e+8x1o, 8x0e+8x1o+8x2e), and every class sits in the second block (the one whose tensor
product takes the L>0 node features) with L>=1 hidden irreps at least once. One and two heads
and float32/float64 are spread over the matrix diagonally (each irreps has both dtypes and
both head counts). The lifecycle tests (pickling, .to(), double accelerate, ...) use one model.
Models come from conftest's ``tiny_model`` (built once per session, deep-copied per test).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import save_and_load

from mace_accel.errors import BackendUnavailableError, UnsupportedModelError
from mace_accel.models.batch import atoms_to_batch, model_info, random_structure
from mace_accel.patches.conv_tp import FusedConvTP
from mace_accel.patches.interaction_blocks import INTERACTION_BLOCK_CLASSES
from mace_accel.surgery import PatchReport, accelerate, evaluate, is_accelerated, revert, unpatched
from mace_accel.tolerances import MODEL_TOL, rel_norm_error

I, R, D, DR, A, NL = (  # noqa: E741 (I: the interaction block's short name)
    "RealAgnosticInteractionBlock", "RealAgnosticResidualInteractionBlock",
    "RealAgnosticDensityInteractionBlock", "RealAgnosticDensityResidualInteractionBlock",
    "RealAgnosticAttResidualInteractionBlock", "RealAgnosticResidualNonLinearInteractionBlock")
L0, L1, L2 = "8x0e", "8x0e+8x1o", "8x0e+8x1o+8x2e"
F32, F64 = torch.float32, torch.float64
ONE, TWO = ("Default",), ("pbe", "r2scan")

# (first block, second block, hidden irreps, heads, dtype); mace does not allow the
# attention block first, so it is always second. I = RealAgnosticInteractionBlock, R = ...Residual,
# D = ...Density, DR = ...DensityResidual, A = ...AttResidual, NL = ...ResidualNonLinear.
# what accelerate() patches in a two-layer model, in model order: the edge features (the model
# itself), each interaction block (conv), each product block (symmetric contraction)
EXPECTED_PATHS = ["", "node_embedding", "interactions.0", "interactions.1", "products.0",
                  "products.1", "readouts.0", "readouts.1"]

MATRIX = [
    (I, A, L0, ONE, F64), (D, R, L0, TWO, F32), (DR, NL, L0, TWO, F64),
    (I, R, L1, TWO, F64), (NL, D, L1, ONE, F64), (DR, A, L1, ONE, F32),
    (R, DR, L2, ONE, F64), (D, NL, L2, TWO, F32), (NL, A, L2, TWO, F64), (DR, I, L2, ONE, F64),
]


SHORT = {I: "I", R: "R", D: "D", DR: "DR", A: "A", NL: "NL"}


def _case_id(case) -> str:
    first, second, irreps, heads, dtype = case
    return f"{SHORT[first]}-{SHORT[second]}-{irreps}-{len(heads)}h-fp{str(dtype)[-2:]}"


def build(tiny_model, case) -> torch.nn.Module:
    """A fresh copy of the unpatched model of ``case`` (conftest's cached ``tiny_model``)."""
    first, second, irreps, heads, dtype = case
    return tiny_model(second, hidden_irreps=irreps, heads=heads, dtype=dtype,
                      interaction_first=first, seed=1)


def batches(model, n_atoms: int = 7, seed: int = 3):
    """One batch per head of ``model``, of one random periodic structure."""
    info = model_info(model)
    atoms = random_structure(info.atomic_numbers, n_atoms=n_atoms, r_max=info.r_max, seed=seed)
    return {head: atoms_to_batch(atoms, info, head=head) for head in info.heads}


def outputs(model, batch_per_head):
    return {head: evaluate(model, b, compute_stress=True) for head, b in batch_per_head.items()}


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(a, b):
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def assert_bit_identical(a, b):
    for head in b:
        for key in b[head]:
            assert torch.equal(a[head][key], b[head][key]), (head, key)


def test_matrix_covers_every_class_with_every_irreps():
    seen = {(c, irreps) for first, second, irreps, _, _ in MATRIX for c in (first, second)}
    assert seen == {(c, irreps) for c in INTERACTION_BLOCK_CLASSES for irreps in (L0, L1, L2)}
    assert {second for _, second, irreps, _, _ in MATRIX if irreps != L0} == set(
        INTERACTION_BLOCK_CLASSES)


@pytest.mark.parametrize("case", MATRIX, ids=_case_id)
def test_accelerate_matches_unpatched_and_reverts_exactly(case, tiny_model):
    model = build(tiny_model, case)
    dtype = case[4]
    inputs = batches(model)
    before, state_before = outputs(model, inputs), state(model)
    for out in before.values():
        assert out["forces"].abs().max() > 0 and out["stress"].abs().max() > 0

    report = accelerate(model, backend="reference", verify=True)

    # the report lists the model's edge features, every interaction and product block, in model
    # order, all patched
    assert isinstance(report, PatchReport)
    assert report.backend == report.requested_backend == "reference"
    assert [r.path for r in report.records] == EXPECTED_PATHS
    interactions = [r for r in report.records if r.kind == "interaction_block"]
    assert [r.block for r in interactions] == [case[0], case[1]]
    assert len(report.patched) == len(EXPECTED_PATHS) and not report.skipped
    assert all(r.spec is not None and r.spec.unsupported_reason() is None for r in interactions)
    assert [r.part("symmetric_contraction").fused for r in report.records
            if r.kind == "product_block"] == [True, True]
    assert report.tolerance == MODEL_TOL[dtype]
    assert set(report.verification) == {"energy", "forces", "stress"}
    assert all(v <= MODEL_TOL[dtype] for v in report.verification.values())
    assert is_accelerated(model)
    assert all(isinstance(block.conv_tp, FusedConvTP) for block in model.interactions)

    # energy, forces and stress of every head within the tolerance table
    after = outputs(model, inputs)
    for head in before:
        for key in ("energy", "forces", "stress"):
            err = rel_norm_error(after[head][key], before[head][key])
            assert err <= MODEL_TOL[dtype], (head, key, err)

    # the state dict is untouched: same keys, same order, bit-identical values
    assert_same_state(state(model), state_before)

    assert revert(model) == len(EXPECTED_PATHS)
    assert not is_accelerated(model)
    assert not any(isinstance(m, FusedConvTP) for m in model.modules())
    assert not any("conv_fusion" in block.__dict__ for block in model.interactions)
    assert_same_state(state(model), state_before)
    assert_bit_identical(outputs(model, inputs), before)


# ----- lifecycle on one model -------------------------------------------------------------------
LIFE = (I, R, L2, ONE, F64)


@pytest.fixture
def accelerated(tiny_model):
    model = build(tiny_model, LIFE)
    inputs = batches(model)
    plain = outputs(model, inputs)
    plain_state = state(model)
    accelerate(model, backend="reference")
    return model, inputs, plain, plain_state


def test_accelerating_twice_reports_already_accelerated(accelerated):
    model, inputs, plain, plain_state = accelerated
    first = outputs(model, inputs)
    report = accelerate(model, backend="reference")
    assert len(report.records) == len(EXPECTED_PATHS) and not report.patched
    assert [r.skipped for r in report.records] == ["already accelerated"] * len(EXPECTED_PATHS)
    assert not report.verification
    assert "already accelerated" in str(report)
    assert_bit_identical(outputs(model, inputs), first)
    assert_same_state(state(model), plain_state)
    assert revert(model) == len(EXPECTED_PATHS) and revert(model) == 0
    assert_bit_identical(outputs(model, inputs), plain)


def test_unpatched_context_restores_the_fused_modules(accelerated):
    model, inputs, plain, _ = accelerated
    fused = [block.conv_tp for block in model.interactions]
    with unpatched(model):
        assert not is_accelerated(model)
        assert_bit_identical(outputs(model, inputs), plain)
    assert [block.conv_tp for block in model.interactions] == fused


def test_pickle_round_trip_keeps_the_patch_and_results(accelerated):
    model, inputs, plain, plain_state = accelerated
    expected = outputs(model, inputs)
    loaded = save_and_load(model)
    assert is_accelerated(loaded)
    assert all(block.conv_tp.backend == "reference" for block in loaded.interactions)
    assert_bit_identical(outputs(loaded, inputs), expected)
    assert_same_state(state(loaded), plain_state)
    assert revert(loaded) == len(EXPECTED_PATHS)
    assert_same_state(state(loaded), plain_state)
    assert_bit_identical(outputs(loaded, inputs), plain)


def test_deepcopy_of_an_accelerated_model(accelerated):
    model, inputs, plain, plain_state = accelerated
    clone = copy.deepcopy(model)
    assert is_accelerated(clone)
    assert_bit_identical(outputs(clone, inputs), outputs(model, inputs))
    revert(clone)
    assert is_accelerated(model)  # the copy is independent
    assert_same_state(state(clone), plain_state)
    assert_bit_identical(outputs(clone, inputs), plain)


def test_state_dict_round_trip_into_an_accelerated_model(accelerated, tiny_model):
    model, inputs, plain, plain_state = accelerated
    other = build(tiny_model, LIFE)
    torch.manual_seed(0)
    with torch.no_grad():  # make the target differ, then load the accelerated weights into it
        for p in other.parameters():
            p.add_(0.1 * torch.randn_like(p))
    accelerate(other, backend="reference", verify=False)
    other.load_state_dict(model.state_dict())
    assert_bit_identical(outputs(other, inputs), outputs(model, inputs))
    revert(other)
    assert_bit_identical(outputs(other, inputs), plain)


def test_to_dtype_after_accelerate_then_revert(accelerated, tiny_model):
    model, _, _, _ = accelerated
    reference_f32 = build(tiny_model, LIFE).to(F32)  # the unpatched model after .to()
    model.to(F32)
    assert all(p.dtype == F32 for p in model.parameters())
    inputs = batches(reference_f32)
    expected = outputs(reference_f32, inputs)
    got = outputs(model, inputs)
    for head in expected:
        for key in ("energy", "forces", "stress"):
            assert got[head][key].dtype == F32
            assert rel_norm_error(got[head][key], expected[head][key]) <= MODEL_TOL[F32], key
    revert(model)
    assert_same_state(state(model), state(reference_f32))
    assert_bit_identical(outputs(model, inputs), expected)
    # and back up: a reverted model is a plain MACE model again
    report = accelerate(model.to(F64), backend="reference")
    assert len(report.patched) == len(EXPECTED_PATHS) and report.tolerance == MODEL_TOL[F64]


# ----- what is not a model to accelerate ----------------------------------------------------------
# (a path instead of a model, an unknown backend or fallback: tests/test_bad_input.py)
def test_non_mace_module_is_rejected():
    with pytest.raises(UnsupportedModelError, match="not a MACE model"):
        accelerate(torch.nn.Sequential(torch.nn.Linear(3, 3)), backend="reference")


def test_module_without_interaction_blocks_is_rejected():
    class Fake(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.interactions = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    with pytest.raises(UnsupportedModelError, match="no MACE interaction blocks"):
        accelerate(Fake(), backend="reference")


def test_torchscript_model_is_rejected():
    scripted = torch.jit.script(torch.nn.Linear(3, 3))
    with pytest.raises(UnsupportedModelError, match="TorchScript"):
        accelerate(scripted, backend="reference")


def test_cuda_on_a_cpu_model_is_never_a_silent_fallback(tiny_model):
    model = build(tiny_model, LIFE)  # on the CPU: the CUDA backend cannot run, GPU or not
    with pytest.raises(BackendUnavailableError, match="backend='reference'"):
        accelerate(model, backend="cuda")
    assert not is_accelerated(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = accelerate(model, backend="cuda", fallback="warn")
    assert any(issubclass(w.category, RuntimeWarning) and "reference" in str(w.message)
               for w in caught)
    assert report.requested_backend == "cuda" and report.backend == "reference"
    assert all(block.conv_tp.backend == "reference" for block in model.interactions)
    assert "backend 'reference'" in str(report)
