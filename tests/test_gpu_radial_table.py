"""GPU tests of the radial table (:mod:`mace_accel.ops.radial.table`): the lookup kernels
against the float64 evaluation of the same table, the table against the float64 MLP, repeats
bit for bit, double backward, and whole models patched vs unpatched with the tables on."""

from __future__ import annotations

import math

import pytest
import torch

import mace_accel
from mace_accel.ops.radial import mlp as radial_mlp
from mace_accel.ops.radial.table import autograd as table_ops
from mace_accel.ops.radial.table.table import SPECS, build_table, evaluate
from mace_accel.tolerances import MODEL_TOL, rel_linf_error, rel_norm_error

pytestmark = pytest.mark.gpu
R_MAX = 5.0


def _net(n_out: int, seed: int):
    """A Bessel x cutoff embedding into a random SiLU MLP, float64 on the GPU."""
    g = torch.Generator().manual_seed(seed)
    widths = (8, 64, 64, n_out)
    weights = [(torch.randn(widths[i], widths[i + 1], generator=g, dtype=torch.float64)
                / widths[i] ** 0.5).cuda() for i in range(3)]
    n = torch.arange(1, 9, dtype=torch.float64, device="cuda")

    def f(r: torch.Tensor) -> torch.Tensor:
        x = r / R_MAX
        cut = 1 - 28 * x ** 6 + 48 * x ** 7 - 21 * x ** 8
        feats = torch.sin(n * math.pi * r[:, None] / R_MAX) / r[:, None] * cut[:, None]
        return radial_mlp.reference(feats, weights)

    return f


def _lengths(e: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (0.7 + (R_MAX - 0.7) * torch.rand(e, generator=g, dtype=torch.float64)).cuda()


# per dtype: the kernels against the same table evaluated in float64 (values, d r), and the
# table against the MLP (relative to its largest weight)
BOUNDS = {torch.float32: (1e-6, 1e-5, 1e-6), torch.float64: (1e-14, 1e-12, 1e-12)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("n_out", [1280, 90, 1])
@pytest.mark.parametrize("edges", [1, 1000, 70000, 70001])
def test_lookup_matches_the_table_and_the_mlp(n_out, edges, dtype):
    """Forward and ``d r`` of the kernels (cubic float32, quintic float64 tables) against the
    float64 evaluation of the same table (rounding only) and against the float64 MLP (the
    table's tolerance); the walks in order of length, in any order and shuffled agree, and
    repeats give the same bits."""
    f = _net(n_out, seed=1)
    table = build_table(f, R_MAX, torch.zeros(1, dtype=torch.float64, device="cuda"),
                        SPECS[dtype], dtype)
    coeffs = table.coeffs.to(dtype).contiguous()
    r64 = _lengths(edges, seed=2)
    r = r64.to(dtype).requires_grad_(True)
    order = torch.argsort(r.detach())
    w = table_ops.lookup(r, order, coeffs, table.inv_h)
    g = torch.randn(edges, n_out, device="cuda", dtype=dtype)
    (dr,) = torch.autograd.grad(w, r, g)
    # the same table in float64 at the same lengths
    rr = r.detach().double().requires_grad_(True)
    w64 = evaluate(coeffs.double(), table.inv_h, rr)
    (dr64,) = torch.autograd.grad(w64, rr, g.double())
    bound_w, bound_dr, bound_mlp = BOUNDS[dtype]
    assert rel_linf_error(w.detach(), w64.detach()) < bound_w
    assert rel_linf_error(dr, dr64) < bound_dr
    # the MLP itself, relative to its largest weight over the table's range
    scale = float(f(torch.linspace(0.7, R_MAX, 4000, dtype=torch.float64, device="cuda"))
                  .abs().max())
    assert float((w.detach().double() - f(r.detach().double())).abs().max()) / scale \
        < bound_mlp
    # the forward's bits do not depend on the walk; the sorted backward's do not depend on the
    # order it is given (a shuffle), the backward in any order (its sums in another order)
    # agrees to rounding; repeats give the same bits
    w_unsorted = table_ops.lookup(r, None, coeffs, table.inv_h)
    (dr_unsorted,) = torch.autograd.grad(w_unsorted, r, g)
    assert torch.equal(w_unsorted, w) and rel_linf_error(dr_unsorted, dr.double()) < bound_dr
    shuffled = torch.randperm(edges, generator=torch.Generator().manual_seed(5)).cuda()
    w_shuffled = table_ops.lookup(r, shuffled, coeffs, table.inv_h)
    (dr_shuffled,) = torch.autograd.grad(w_shuffled, r, g)
    assert torch.equal(w_shuffled, w) and torch.equal(dr_shuffled, dr)
    w2 = table_ops.lookup(r, order, coeffs, table.inv_h)
    (dr2,) = torch.autograd.grad(w2, r, g)
    w3 = table_ops.lookup(r, None, coeffs, table.inv_h)
    (dr3,) = torch.autograd.grad(w3, r, g)
    assert torch.equal(w2, w) and torch.equal(dr2, dr) and torch.equal(dr3, dr_unsorted)


def test_double_backward_is_the_table_second_derivative():
    """Under ``create_graph`` the backward is torch ops: its value is the kernel's, and its
    derivative in ``r`` is the table's second derivative (float64 check)."""
    f = _net(64, seed=3)
    table = build_table(f, R_MAX, torch.zeros(1, dtype=torch.float64, device="cuda"))
    coeffs = table.coeffs.float().contiguous()
    r = _lengths(500, seed=4).float().requires_grad_(True)
    g = torch.randn(500, 64, device="cuda")
    w = table_ops.lookup(r, None, coeffs, table.inv_h)
    (dr,) = torch.autograd.grad(w, r, g, create_graph=True)
    (dr_kernel,) = torch.autograd.grad(table_ops.lookup(r, None, coeffs, table.inv_h), r, g)
    assert rel_linf_error(dr.detach(), dr_kernel.double()) < 1e-5
    (d2,) = torch.autograd.grad(dr.sum(), r)
    rr = r.detach().double().requires_grad_(True)
    (s,) = torch.autograd.grad(evaluate(coeffs.double(), table.inv_h, rr), rr, g.double(),
                               create_graph=True)
    (d2_64,) = torch.autograd.grad(s.sum(), rr)
    assert rel_linf_error(d2, d2_64) < 1e-4


def test_lookup_checks_before_launch():
    from mace_accel.errors import KernelError

    coeffs = torch.zeros(16, 4, 8, device="cuda")
    r = torch.ones(10, device="cuda")
    with pytest.raises(KernelError, match="lengths"):
        table_ops.lookup(r.double(), None, coeffs, 1.0)
    with pytest.raises(KernelError, match="table"):
        table_ops.lookup(r, None, coeffs[:, :3], 1.0)
    with pytest.raises(KernelError, match="order"):
        table_ops.lookup(r, torch.zeros(9, dtype=torch.int64, device="cuda"), coeffs, 1.0)


def _inference_model(arch: str, dtype: torch.dtype = torch.float32):
    from mace_accel.models.architectures import build_architecture

    model = build_architecture(arch, dtype=dtype, device="cuda")
    for p in model.parameters():  # inference: no weight gradients (training runs the MLP)
        p.requires_grad_(False)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("arch", ["mp-medium", "mp-large"])
def test_model_with_tables_matches_unpatched(arch, dtype, monkeypatch):
    """A model with the tables on (the default) against the unpatched model within the
    model-level tolerance, every block's weights looked up (sorted walk too: the thresholds
    lowered), and the report says so."""
    from test_gpu_model import _assert_matches_unpatched

    from mace_accel.patches.radial import table as table_patch

    monkeypatch.setattr(table_patch, "SORT_MIN_EDGES", 0)
    monkeypatch.setattr(table_patch, "LARGE_TABLE_BYTES", 0)
    calls = []
    real = table_patch.lookup
    monkeypatch.setattr(table_patch, "lookup", lambda *a: calls.append(1) or real(*a))
    model = _inference_model(arch, dtype)
    report = mace_accel.accelerate(model, backend="cuda", verify=False)
    assert any("Hermite table" in line for line in report.notes)
    _assert_matches_unpatched(model, dtype)
    assert len(calls) >= 2
    # the report, asked after the first call, names each block's table
    kind = "cubic" if dtype == torch.float32 else "quintic"
    blocks = [m for m in model.modules() if type(m).__name__ == "FusedRadialMLP"]
    assert blocks and all(f"looked up in a {kind} Hermite table" in m.describe()
                          for m in blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_tables_off_runs_the_mlp_and_agrees(dtype, monkeypatch):
    """``radial_table=False`` runs the MLP kernels; energy, forces and stress agree with the
    tables' within the model tolerance, and the tables' forces repeat bit for bit (mace's own
    energy sum uses float atomics)."""
    from test_gpu_model import _cu_ni

    from mace_accel.models.batch import atoms_to_batch, model_info
    from mace_accel.surgery import evaluate
    from mace_accel.patches.radial import table as table_patch

    calls = []
    real = table_patch.lookup
    monkeypatch.setattr(table_patch, "lookup", lambda *a: calls.append(1) or real(*a))
    results = {}
    for on in (True, False):
        model = _inference_model("mp-medium", dtype)
        mace_accel.accelerate(model, backend="cuda", verify=False,
                              options=mace_accel.AccelOptions(radial_table=on))
        batch = atoms_to_batch(_cu_ni(), model_info(model), device="cuda")
        n = len(calls)
        results[on] = [evaluate(model, batch, compute_stress=True) for _ in range(2)]
        assert (len(calls) > n) == on
    table, mlp = results[True], results[False]
    assert torch.equal(table[0]["forces"], table[1]["forces"])
    for key in ("energy", "forces", "stress"):
        assert rel_norm_error(table[0][key], mlp[0][key]) < MODEL_TOL[dtype], key
