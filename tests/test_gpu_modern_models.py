"""GPU tests of the architectures users run today (MACE-MPA-0's Density blocks with the Agnesi
transform and ZBL, MACE-MH-1's non-linear blocks with six heads) and of the model-state
contract: the ZBL kernel and the tables per pair of elements against their references, each
architecture patched against the unpatched model, the calculator (CUDA graphs) with ``head=``,
and weight changes, revert and casts under a live calculator."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

import mace_accel
from mace_accel.models.architectures import build_architecture
from mace_accel.models.batch import atoms_to_batch, model_info
from mace_accel.tolerances import MODEL_TOL, rel_norm_error

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.float64]
IDS = ["fp32", "fp64"]
# Cr Mn Fe Co Ni Cu and a little H and O: several covalent radii, so several pairs' tables
ALLOY = (24, 25, 26, 27, 28, 29, 1, 8)


def _alloy(n: int = 3, seed: int = 1, light: bool = True):
    """A rattled fcc alloy of six metals and, with ``light``, an H and an O atom (8 elements:
    36 unordered, 64 ordered pairs)."""
    from ase.build import bulk

    rng = np.random.default_rng(seed)
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((n, n, n))
    atoms.set_atomic_numbers(rng.choice(ALLOY[:6], len(atoms)))
    if light:
        atoms.numbers[:3] = [1, 8, 1]
    atoms.positions += rng.normal(0.0, 0.05, atoms.positions.shape)
    return atoms


_BUILT: dict = {}


def _model(name: str, dtype: torch.dtype) -> torch.nn.Module:
    """A fresh copy of the architecture (random weights, built once) on the GPU."""
    if name not in _BUILT:
        _BUILT[name] = build_architecture(name, dtype=torch.float64)
    model = copy.deepcopy(_BUILT[name]).to("cuda", dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _batch(model, atoms, head=None):
    info = model_info(model)
    return atoms_to_batch(atoms, info, head=head or info.heads[-1], device="cuda")


def _results(model, batch):
    from mace_accel.models.outputs import evaluate

    return {k: v.detach().double() for k, v in evaluate(model, dict(batch), True).items()
            if k in ("energy", "forces", "stress")}


def _plain(model, batch):
    return {k: v.detach().double() for k, v in model(dict(batch), training=False,
                                                     compute_force=True,
                                                     compute_stress=True).items()
            if k in ("energy", "forces", "stress")}


def _close(got, want, dtype, truth=None):
    """``got`` within the model tolerance of the unpatched model's ``want``; in float32, where
    the float64 ``truth`` is given, within the tolerance of it or twice the unpatched model's
    own float32 error (a 512-channel LayerNorm model in float32 is ~3e-5 off float64 however
    its sums are ordered)."""
    for key in ("energy", "forces", "stress"):
        err = rel_norm_error(got[key], want[key])
        if dtype == torch.float32 and truth is not None and err > MODEL_TOL[dtype]:
            own = rel_norm_error(want[key], truth[key])
            err = rel_norm_error(got[key], truth[key])
            assert err <= max(MODEL_TOL[dtype], 2 * own), (key, err, own)
        else:
            assert err <= MODEL_TOL[dtype], (key, err)


# ----- the ZBL kernel -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_zbl_kernel_matches_mace(dtype):
    from mace_accel._e3nn_compat import import_mace

    import_mace()
    from mace.modules.radial import ZBLBasis

    from mace_accel.ops.pair_repulsion import autograd
    from mace_accel.ops.pair_repulsion.spec import zbl_spec_from_module
    from mace_accel.ops.species import node_elements

    numbers = (1, 6, 8, 29, 79)
    module = ZBLBasis(p=5).to("cuda", dtype)
    spec, _ = zbl_spec_from_module(module, numbers)
    g = torch.Generator().manual_seed(0)
    n, e = 200, 5000
    attrs = torch.nn.functional.one_hot(torch.randint(0, 5, (n,), generator=g), 5).to(
        "cuda", dtype)
    edge_index = torch.randint(0, n, (2, e), generator=g).cuda()
    r = (0.4 + 4.0 * torch.rand(e, 1, generator=g, dtype=torch.float64)).to("cuda", dtype)
    r.requires_grad_(True)
    want = module(r, attrs, edge_index, torch.tensor(numbers, device="cuda"))
    got = autograd.repulsion(spec, r, node_elements(attrs), edge_index, "cuda")
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    assert rel_norm_error(got, want) < tol
    up = torch.randn(n, generator=g, dtype=torch.float64).to("cuda", dtype)
    (dw,) = torch.autograd.grad(want, r, up)
    (dg,) = torch.autograd.grad(got, r, up)
    assert rel_norm_error(dg, dw) < 10 * tol
    again = autograd.repulsion(spec, r, node_elements(attrs), edge_index, "cuda")
    assert torch.equal(again, got)  # a fixed order: the same bits


# ----- tables per pair of elements ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("edges", [1000, 70001])
def test_pair_table_lookups_match_their_evaluation(dtype, edges):
    from mace_accel.ops.radial.table import autograd as table_ops
    from mace_accel.ops.radial.table.order import length_order
    from mace_accel.ops.radial.table.table import SPECS, build_tables, evaluate

    def curves(r, which):
        k = which.to(r.dtype)
        return torch.stack([torch.sin((1.5 + 0.2 * k) * r) / r, torch.exp(-r / (1 + k)),
                            torch.tanh(r - k)] * 15, dim=1)

    table = build_tables(curves, 5, 5.0, torch.zeros(1, dtype=torch.float64, device="cuda"),
                         SPECS[dtype], dtype)
    coeffs = table.coeffs.to(dtype).contiguous()
    g = torch.Generator().manual_seed(2)
    r = (0.5 + 4.4 * torch.rand(edges, generator=g, dtype=torch.float64)).to("cuda", dtype)
    slots = torch.randint(0, 5, (edges,), generator=g, dtype=torch.int32).cuda()
    want = evaluate(coeffs.double(), table.inv_h, r.double(), slots, 5)
    tol = {torch.float32: 1e-6, torch.float64: 1e-14}[dtype]
    walk = length_order(r, 5.0, slots, 5)
    assert bool((slots[walk].diff() >= 0).all())  # table by table (15-bit keys on the GPU)
    for order in (None, walk):
        rr = r.clone().requires_grad_(True)
        w = table_ops.lookup(rr, order, coeffs, table.inv_h, slots, 5)
        assert rel_norm_error(w, want) < tol
        up = torch.randn(w.shape, generator=g, dtype=torch.float64).to("cuda", dtype)
        (dr,) = torch.autograd.grad(w, rr, up)
        r64 = r.double().requires_grad_(True)
        (dr64,) = torch.autograd.grad(evaluate(coeffs.double(), table.inv_h, r64, slots, 5),
                                      r64, up.double())
        assert rel_norm_error(dr, dr64) < 10 * tol


# ----- whole architectures -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("name", ["mpa0-medium", "omat0-small", "mh1", "off23-medium"])
def test_architecture_matches_the_unpatched_model(name, dtype):
    """Patched (tables per pair where the weights depend on the elements) against the unpatched
    model on a structure of several elements; the tables ran where they may. (MH-1's 64 ordered
    pairs with H and O need a finer grid than the tables' memory allows: there its MLP runs,
    with a warning, checked below on the light alloy.)"""
    model = _model(name, dtype)
    atoms = _molecules() if name == "off23-medium" else _alloy(light=name != "mh1")
    head = "omat_pbe" if name == "mh1" else None
    batch = _batch(model, atoms, head)
    want = _plain(model, batch)
    truth64 = _model(name, torch.float64)
    truth = _plain(truth64, _batch(truth64, atoms, head))
    report = mace_accel.accelerate(model, backend="cuda", verify=False)
    got = _results(model, batch)
    _close(got, want, dtype, truth)
    again = _results(model, batch)
    assert torch.equal(again["forces"], got["forces"])  # deterministic
    assert any("radial tables" in note for note in report.notes)
    if name in ("mpa0-medium", "omat0-small", "mh1"):  # the weights depend on the elements
        texts = [m.describe() for m in model.modules()
                 if type(m).__name__ in ("FusedRadialMLP", "FusedLayerNormMLP")]
        # float64 holds tables to 1e-13 of the weights: a random 512-channel LayerNorm MLP may
        # need a finer grid than their memory allows, and then says so
        allowed = ("one per pair of elements",) + (
            ("runs as an MLP, not as tables",) if dtype == torch.float64 else ())
        without = [t for t in texts if not any(a in t for a in allowed)]
        assert texts and not without, without
    if name == "mh1":
        light = _alloy()
        with pytest.warns(RuntimeWarning, match="tables"):
            got = _results(model, _batch(model, light, head))
        _close(got, _plain(_model(name, dtype), _batch(model, light, head)), dtype,
               _plain(truth64, _batch(truth64, light, head)))


def _molecules():
    from mace_accel.bench.systems import molecular_box

    return molecular_box(120, {1: 1, 6: 6, 7: 7, 8: 8}, seed=3)


# ----- through the calculator --------------------------------------------------------------------
@pytest.mark.parametrize("name,head", [("mpa0-medium", None), ("mh1", "omat_pbe"),
                                       ("mh1", "spice_wB97M")])
def test_calculator_with_graphs(name, head):
    """(MH-1's 64 ordered pairs of 8 elements with H need a finer grid than the tables' memory
    allows: its MLP runs there, with a warning; the metals alone have tables.)"""
    from mace_accel import MACEAccelCalculator

    atoms = _alloy(light=name != "mh1")
    model = _model(name, torch.float32)
    plain = copy.deepcopy(model)
    calc = MACEAccelCalculator(model=model, device="cuda", head=head, graphs=True)
    atoms.calc = calc
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to eager calls
        f1 = atoms.get_forces()
        atoms.positions[0] += 0.01
        f2 = atoms.get_forces()
    assert calc._graphed is not None and calc._graphed.n_captures >= 1
    want = _plain(plain, _batch(plain, atoms, head))
    truth64 = _model(name, torch.float64)
    truth = _plain(truth64, _batch(truth64, atoms, head))
    got = {"forces": torch.from_numpy(f2).cuda(), "energy": want["energy"],
           "stress": want["stress"]}
    _close(got, want, torch.float32, truth)
    assert not np.allclose(f1, f2)


def test_a_call_that_cannot_be_captured_runs_eagerly_with_one_warning():
    from mace_accel import MACEAccelCalculator

    atoms = _alloy(2)
    model = _model("mpa0-medium", torch.float32)
    calc = MACEAccelCalculator(model=model, device="cuda", graphs=True)
    # a module that reads a number back on the host: allowed eagerly, not in a CUDA graph
    def read_back(module, args, out) -> None:  # returns None: the output stays as it is
        float(out.sum())

    calc.model.products[0].register_forward_hook(read_back)
    atoms.calc = calc
    with pytest.warns(RuntimeWarning, match="cannot be captured"):
        e1 = atoms.get_potential_energy()
    assert calc._graphed is None
    atoms.positions[1] += 0.01
    e2 = atoms.get_potential_energy()
    assert np.isfinite(e2) and e1 != e2


# ----- the model-state contract ------------------------------------------------------------------
def _perturbed(model, seed: int) -> dict:
    """New weights (the parameters; the buffers are the architecture's constants)."""
    g = torch.Generator().manual_seed(seed)
    weights = {k for k, _ in model.named_parameters()}
    return {k: (v + 0.05 * v.abs().mean() * torch.randn(v.shape, generator=g,
                                                         dtype=torch.float64).to(v)
                if k in weights else v)
            for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name,dtype,graphs,reset", [
    ("mpa0-medium", "float32", True, True), ("mpa0-medium", "float64", True, False),
    ("mpa0-medium", "float32", False, False), ("mp0-medium", "float32", True, False),
    ("mp0-medium", "float64", True, True), ("mp0-medium", "float32", False, True)])
def test_new_weights_under_a_live_calculator(name, dtype, graphs, reset):
    """load_state_dict under a live calculator (radial tables, folded conv and graphs in use):
    the next forces are the plain model's with the new weights, after ``reset()`` or (atoms
    moved) without it."""
    from mace_accel import MACEAccelCalculator

    torch_dtype = getattr(torch, dtype)
    atoms = _alloy()
    base = _model(name, torch_dtype)
    calc = MACEAccelCalculator(model=copy.deepcopy(base), device="cuda", default_dtype=dtype,
                               graphs=graphs)
    atoms.calc = calc
    atoms.get_forces()
    new = _perturbed(base, seed=3)
    calc.model.load_state_dict(new)
    if reset:
        calc.reset()
    else:
        atoms.positions[2] += 0.02
    forces = atoms.get_forces()
    plain = copy.deepcopy(base)
    plain.load_state_dict(new)
    want = _plain(plain, _batch(plain, atoms))["forces"].cpu()
    assert rel_norm_error(torch.from_numpy(forces), want) < MODEL_TOL[torch_dtype]


def test_optimizer_steps_copy_revert_and_casts_under_a_live_calculator():
    from mace_accel import MACEAccelCalculator
    from mace_accel.surgery import accelerate, revert

    atoms = _alloy()
    base = _model("mpa0-medium", torch.float32)
    calc = MACEAccelCalculator(model=copy.deepcopy(base), device="cuda")
    atoms.calc = calc
    atoms.get_forces()

    def check(model_like, dtype=torch.float32):
        calc.reset()
        forces = torch.from_numpy(atoms.get_forces())
        plain = copy.deepcopy(model_like)
        from mace_accel.surgery import is_accelerated
        if is_accelerated(plain):
            revert(plain)
        want = _plain(plain, _batch(plain, atoms))["forces"].cpu()
        assert rel_norm_error(forces, want) < MODEL_TOL[dtype]

    with torch.no_grad():  # copy_ under no_grad
        for p in calc.model.parameters():
            p.copy_(p * 1.01)
    check(calc.model)
    revert(calc.model)  # mace's own modules from now on
    check(calc.model)
    accelerate(calc.model, backend="cuda")
    check(calc.model)
    calc.model.to(torch.float64)  # followed: the next call is float64
    atoms.positions[0] += 0.01
    forces = torch.from_numpy(atoms.get_forces())
    plain = copy.deepcopy(calc.model)
    revert(plain)
    want = _plain(plain, _batch(plain, atoms))["forces"].cpu()
    assert calc.dtype == torch.float64
    assert rel_norm_error(forces, want) < MODEL_TOL[torch.float64]
    calc.model.to("cpu")
    with pytest.raises(mace_accel.errors.InputError, match="on cpu now"):
        atoms.positions[0] += 0.01
        atoms.get_forces()


# ----- training through the accelerated model ----------------------------------------------------
@pytest.mark.parametrize("dtype,bound", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
def test_fine_tuning_follows_the_plain_models_loss_curve(dtype, bound):
    from fine_tuning import fine_tune_losses

    plain, fast = fine_tune_losses("mpa0-small-test", dtype, "cuda", steps=20)
    rel = [abs(a - b) / abs(b) for a, b in zip(fast, plain)]
    assert max(rel) <= bound, rel
