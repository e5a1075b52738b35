"""Generated edge-feature kernels vs the reference path, over the catalog (GPU only).

float32 is compared as relative L-inf against the float64 reference on the same (upcast) inputs,
float64 as relative norm (the tolerance table). Inputs are random, never zeros.
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import pass_error

from mace_accel.bench.timing import capture_graph
from mace_accel.errors import KernelError
from mace_accel.ops.edge_features import autograd as ops
from mace_accel.ops.edge_features import reference
from mace_accel.ops.edge_features.catalog import CATALOG, select, unique_radial, unique_sh
from mace_accel.options import AccelOptions
from mace_accel.tolerances import MODEL_TOL, PASS_TOL, rel_norm_error

pytestmark = pytest.mark.gpu
F32, F64 = torch.float32, torch.float64
DTYPES = (F32, F64)
N_EDGES = 5000
SH_NAMES = [p.name for p in unique_sh(select())]
RADIAL_NAMES = [p.name for p in unique_radial(select())]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sh_inputs(spec, n: int, dtype, seed: int = 0):
    """``(vectors [n, 3], grad [n, dim], upstream [n, 3])`` on the GPU; lengths 0.5..6."""
    g = _gen(seed)
    v = torch.randn(n, 3, generator=g, dtype=F64)
    v = v / v.norm(dim=1, keepdim=True) * torch.empty(n, 1, dtype=F64).uniform_(0.5, 6.0,
                                                                                 generator=g)
    grad = torch.randn(n, spec.dim, generator=g, dtype=F64)
    up = torch.randn(n, 3, generator=g, dtype=F64)
    return [t.to("cuda", dtype) for t in (v, grad, up)]


def radial_inputs(spec, n: int, dtype, seed: int = 0):
    """``(lengths [n, 1], grad [n, B], grad_cutoff [n, 1] or None, upstream [n, 1])``; lengths
    from 0.5 to beyond r_max."""
    g = _gen(seed)
    r = torch.empty(n, 1, dtype=F64).uniform_(0.5, 1.2 * spec.r_max, generator=g)
    grad = torch.randn(n, spec.num_basis, generator=g, dtype=F64)
    gc = None if spec.apply_cutoff else torch.randn(n, 1, generator=g, dtype=F64)
    up = torch.randn(n, 1, generator=g, dtype=F64)
    return [None if t is None else t.to("cuda", dtype) for t in (r, grad, gc, up)]


def radial_r0(spec, n: int, dtype, seed: int = 0):
    """``[n, 1]``: the transform's r0 of random pairs of the spec's elements (None without a
    transform)."""
    if spec.transform is None:
        return None
    a, b = torch.randint(0, len(spec.transform.radii), (2, n), generator=_gen(seed)).tolist()
    return torch.tensor([spec.transform.r0(i, j) for i, j in zip(a, b)], dtype=F64
                        ).unsqueeze(-1).to("cuda", dtype)


def _up(t):
    return None if t is None else t.double()


def _sh_prims(spec, dtype):
    from mace_accel.ops.edge_features.cuda import CudaSphericalHarmonics

    return CudaSphericalHarmonics(spec, dtype, torch.device("cuda"))


def _radial_prims(spec, dtype):
    from mace_accel.ops.edge_features.cuda import CudaRadialEmbedding

    return CudaRadialEmbedding(spec, dtype, torch.device("cuda"))


# ----- every pass of every catalog problem vs the reference ---------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SH_NAMES)
def test_sh_kernels_vs_reference(name, dtype):
    spec = CATALOG[name].sh_spec()
    prims, err, tol = _sh_prims(spec, dtype), pass_error(dtype), PASS_TOL[dtype]
    v, g, a = sh_inputs(spec, N_EDGES, dtype, seed=1)
    vd, gd, ad = _up(v), _up(g), _up(a)
    out = prims.forward(v)
    assert out.dtype == dtype and out.shape == (N_EDGES, spec.dim)
    assert err(out, reference.sh_forward(spec, vd)) < tol["forward"]
    if spec.lmax == 0:
        return
    got = prims.backward(v, g)
    assert err(got, reference.sh_backward(spec, vd, gd)) < tol["backward"]
    dv, dg = prims.double_backward(v, g, a)
    want_dv, want_dg = reference.sh_double_backward(spec, vd, gd, ad)
    assert err(dv, want_dv) < tol["double_backward"], err(dv, want_dv)
    assert err(dg, want_dg) < tol["double_backward"], err(dg, want_dg)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", RADIAL_NAMES)
def test_radial_kernels_vs_reference(name, dtype):
    spec = CATALOG[name].radial_spec()
    prims, err, tol = _radial_prims(spec, dtype), pass_error(dtype), PASS_TOL[dtype]
    r, g, gc, a = radial_inputs(spec, N_EDGES, dtype, seed=2)
    r0 = radial_r0(spec, N_EDGES, dtype, seed=3)
    rd, gd, gcd, ad, r0d = _up(r), _up(g), _up(gc), _up(a), _up(r0)
    feats, cutoff = prims.forward(r, r0)
    want_feats, want_cutoff = reference.radial_forward(spec, rd, r0d)
    assert err(feats, want_feats) < tol["forward"]
    beyond = (r >= spec.r_max).squeeze(1)
    assert beyond.any() and (~beyond).any()
    if spec.apply_cutoff:
        assert cutoff is None and torch.all(feats[beyond] == 0)
    else:
        assert err(cutoff, want_cutoff) < tol["forward"] and torch.all(cutoff[beyond] == 0)
    got = prims.backward(r, g, gc, r0)
    assert err(got, reference.radial_backward(spec, rd, gd, gcd, r0d)) < tol["backward"]
    d_r, d_g, d_c = prims.double_backward(r, g, gc, a, r0)
    want_r, want_g, want_c = reference.radial_double_backward(spec, rd, gd, gcd, ad, r0d)
    assert err(d_r, want_r) < tol["double_backward"], err(d_r, want_r)
    assert err(d_g, want_g) < tol["double_backward"], err(d_g, want_g)
    if not spec.apply_cutoff:
        assert err(d_c, want_c) < tol["double_backward"]


# ----- the custom ops' autograd composition on the CUDA backend -----------------------------------
def _second(fn, x, seed: int):
    x = x.detach().clone().requires_grad_()
    outs = fn(x)
    outs = outs if isinstance(outs, tuple) else (outs,)
    ups = [torch.randn(o.shape, generator=_gen(seed + i), dtype=F64).to(o).requires_grad_()
           for i, o in enumerate(outs)]
    (gx,) = torch.autograd.grad(outs, x, ups, create_graph=True)
    s = gx.pow(2).sum() * sum(u.norm() for u in ups) + (gx * gx.detach().sin()).sum()
    return [gx.detach(), *torch.autograd.grad(s, [x] + ups)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_autograd_cuda_vs_reference(dtype):
    sh = CATALOG["mp"].sh_spec()
    key = ops.register_sh(sh)
    v, _, _ = sh_inputs(sh, 2000, dtype, seed=3)
    got = _second(lambda x: ops.spherical_harmonics(key, x, "cuda"), v, 4)
    want = _second(lambda x: ops.spherical_harmonics(key, x, "reference"), v.double(), 4)
    for i, (a, b) in enumerate(zip(got, want)):
        tol = PASS_TOL[dtype]["backward" if i == 0 else "double_backward"]
        assert pass_error(dtype)(a, b) < tol, (i, pass_error(dtype)(a, b))
    for name in ("mp", "no-cutoff", "agnesi", "soft"):
        spec = CATALOG[name].radial_spec()
        rkey = ops.register_radial(spec)
        r, _, _, _ = radial_inputs(spec, 2000, dtype, seed=5)
        r0 = radial_r0(spec, 2000, dtype, seed=7)

        def fused(x, backend, rkey=rkey, r0=r0):
            feats, cutoff = ops.radial_embedding(rkey, x, backend, r0)
            return (feats,) if cutoff is None else (feats, cutoff)
        got = _second(lambda x: fused(x, "cuda"), r, 6)
        want = _second(lambda x: fused(x, "reference"), r.double(), 6)
        for i, (a, b) in enumerate(zip(got, want)):
            tol = PASS_TOL[dtype]["backward" if i == 0 else "double_backward"]
            assert pass_error(dtype)(a, b) < tol, (name, i, pass_error(dtype)(a, b))


# ----- determinism, grid-stride, CUDA graphs, edge cases, checks ----------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_bit_identical_repeats(dtype):
    sh, radial = CATALOG["mp"].sh_spec(), CATALOG["no-cutoff"].radial_spec()
    sp, rp = _sh_prims(sh, dtype), _radial_prims(radial, dtype)
    v, g, a = sh_inputs(sh, 100_000, dtype, seed=7)
    r, rg, gc, ra = radial_inputs(radial, 100_000, dtype, seed=8)

    def run():
        return [sp.forward(v), sp.backward(v, g), *sp.double_backward(v, g, a),
                *rp.forward(r), rp.backward(r, rg, gc), *rp.double_backward(r, rg, gc, ra)]
    first = run()
    for _ in range(5):
        assert all(torch.equal(x, y) for x, y in zip(first, run()))


def test_more_edges_than_one_grid():
    """The grid-stride loop covers edges beyond gridDim x blockDim (int64 offsets)."""
    spec = CATALOG["lmax4"].sh_spec()
    prims = _sh_prims(spec, F64)
    n = prims.plan.max_blocks * prims.plan.threads * 2 + 17
    v, g, _ = sh_inputs(spec, n, F64, seed=9)
    assert rel_norm_error(prims.forward(v), reference.sh_forward(spec, v)) < 1e-12
    assert rel_norm_error(prims.backward(v, g), reference.sh_backward(spec, v, g)) < 1e-11
    radial = CATALOG["mp"].radial_spec()
    rprims = _radial_prims(radial, F64)
    r, _, _, _ = radial_inputs(radial, n, F64, seed=10)
    assert rel_norm_error(rprims.forward(r)[0], reference.radial_forward(radial, r)[0]) < 1e-12


def test_empty_edges():
    sh, radial = CATALOG["mp"].sh_spec(), CATALOG["no-cutoff"].radial_spec()
    sp, rp = _sh_prims(sh, F32), _radial_prims(radial, F32)
    v = torch.empty(0, 3, device="cuda")
    assert sp.forward(v).shape == (0, 16)
    assert sp.double_backward(v, torch.empty(0, 16, device="cuda"), v)[1].shape == (0, 16)
    r = torch.empty(0, 1, device="cuda")
    feats, cutoff = rp.forward(r)
    assert feats.shape == (0, radial.num_basis) and cutoff.shape == (0, 1)


def test_cuda_graph_capture_and_replay():
    sh, radial = CATALOG["mp"].sh_spec(), CATALOG["no-cutoff"].radial_spec()
    sp, rp = _sh_prims(sh, F32), _radial_prims(radial, F32)
    v, g, a = sh_inputs(sh, 4096, F32, seed=11)
    r, rg, gc, ra = radial_inputs(radial, 4096, F32, seed=12)

    def run():
        return [sp.forward(v), sp.backward(v, g), *sp.double_backward(v, g, a), *rp.forward(r),
                rp.backward(r, rg, gc), *rp.double_backward(r, rg, gc, ra)]
    graph, captured = capture_graph(run)  # after a warm-up call: every kernel loaded
    v.mul_(-1.5)
    r.add_(0.25)
    g.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    eager = run()
    assert all(torch.equal(x, y) for x, y in zip(captured, eager))


def test_prelaunch_checks():
    spec = CATALOG["mp"].sh_spec()
    prims = _sh_prims(spec, F64)
    v, g, _ = sh_inputs(spec, 100, F64)
    with pytest.raises(KernelError, match="expected torch.float64"):
        prims.forward(v.float())
    with pytest.raises(KernelError, match="device"):
        prims.forward(v.cpu())
    with pytest.raises(KernelError, match="expected shape"):
        prims.backward(v, g[:, :-1].contiguous())
    with pytest.raises(KernelError, match="contiguous"):
        prims.forward(v.t().contiguous().t())
    radial = CATALOG["no-cutoff"].radial_spec()
    rprims = _radial_prims(radial, F32)
    r, rg, gc, _ = radial_inputs(radial, 100, F32)
    with pytest.raises(KernelError, match="grad_cutoff is required"):
        rprims.backward(r, rg, None)
    with pytest.raises(KernelError, match=r"expected shape \(100, 1\)"):
        rprims.backward(r, rg, gc[:50])
    with pytest.raises(KernelError, match="expected shape"):
        rprims.forward(r.reshape(50, 2))
    transformed = _radial_prims(CATALOG["agnesi"].radial_spec(), F32)
    with pytest.raises(KernelError, match="r0 .E, 1. is required"):
        transformed.forward(r)
    with pytest.raises(KernelError, match=r"expected shape \(100, 1\)"):
        transformed.forward(r, r[:50].contiguous())


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_with_fused_edge_features_matches_unpatched(dtype, tiny_model):
    pytest.importorskip("mace")
    from mace_accel.models.batch import atoms_to_batch, model_info, random_structure
    from mace_accel.patches.edge_features import EdgeFeaturesPatch, FusedRadialEmbedding
    from mace_accel.surgery import accelerate, evaluate, revert

    model = tiny_model("RealAgnosticResidualInteractionBlock", max_ell=3, dtype=dtype).cuda()
    info = model_info(model)
    atoms = random_structure(info.atomic_numbers, n_atoms=16, r_max=info.r_max, seed=13)
    batch = atoms_to_batch(atoms, info, device="cuda")
    plain = evaluate(model, batch, True)
    record = EdgeFeaturesPatch().apply("", model, AccelOptions(backend="cuda"))
    assert record.patched and isinstance(model.radial_embedding, FusedRadialEmbedding)
    fused = evaluate(model, batch, True)
    for key in plain:
        assert rel_norm_error(fused[key], plain[key]) <= MODEL_TOL[dtype], key
    EdgeFeaturesPatch().revert(model)
    report = accelerate(model, backend="cuda", verify=True)
    assert all(r.patched for r in report.records)
    revert(model)
