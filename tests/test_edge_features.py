"""The fused edge-feature ops on CPU: specs, reference, custom ops, generated maths, surgery.

Oracles: e3nn's ``SphericalHarmonics`` and mace's ``RadialEmbeddingBlock`` (plain autograd through
them for the derivatives). The generated kernels' maths is checked here too: the sympy programs
the code generator prints into CUDA are run in numpy (:meth:`Program.evaluate`). The GPU side is
``tests/test_gpu_edge_features.py``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from helpers import default_dtype, save_and_load
from torch.autograd.gradcheck import GradcheckError

from mace_accel.errors import KernelError
from mace_accel.models.batch import atoms_to_batch, model_info, random_structure
from mace_accel.ops.edge_features import autograd as ops
from mace_accel.ops.edge_features import codegen, reference, symbolic
from mace_accel.ops.edge_features.catalog import CATALOG, select, unique_radial, unique_sh
from mace_accel.ops.edge_features.schedule import plan_edges, plan_for
from mace_accel.ops.edge_features.spec import (
    NORMALIZE_EPS,
    RadialSpec,
    SHSpec,
    make_radial_spec,
    radial_spec_from_module,
    sh_spec_from_module,
)
from mace_accel.options import AccelOptions
from mace_accel.patches.edge_features import (
    EdgeFeaturesPatch,
    FusedRadialEmbedding,
    FusedSphericalHarmonics,
)
from mace_accel.surgery import accelerate, evaluate, revert
from mace_accel.tolerances import MODEL_TOL, PASS_TOL, rel_norm_error


F32, F64 = torch.float32, torch.float64
TOL = PASS_TOL[F64]
REF = AccelOptions(backend="reference")


# ----- helpers ------------------------------------------------------------------------------------
def e3nn_sh(lmax: int, normalize: bool = True, normalization: str = "component"):
    from mace_accel._e3nn_compat import o3

    irreps = o3().Irreps.spherical_harmonics(lmax)
    return o3().SphericalHarmonics(irreps, normalize=normalize, normalization=normalization)


def mace_radial(r_max: float = 5.0, num_bessel: int = 8, p: int = 5, **kwargs):
    from mace_accel._e3nn_compat import import_mace

    import_mace()
    from mace.modules.blocks import RadialEmbeddingBlock

    with default_dtype(F64):
        return RadialEmbeddingBlock(r_max=r_max, num_bessel=num_bessel,
                                    num_polynomial_cutoff=p, **kwargs)


def edge_vectors(n: int = 40, seed: int = 0) -> torch.Tensor:
    """Random directions, lengths from 1e-9 to 1e9, one below e3nn's normalize eps."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, 3, generator=g, dtype=F64)
    v = v * torch.exp(torch.empty(n, 1, dtype=F64).uniform_(-20.0, 20.0, generator=g))
    v[0] = torch.tensor([3e-13, -2e-13, 1e-13], dtype=F64)  # |v| < 1e-12: clamped norm
    v[1] = torch.tensor([0.0, 0.0, 2.5], dtype=F64)         # on an axis
    return v


def edge_lengths(r_max: float, n: int = 40, seed: int = 0) -> torch.Tensor:
    """``[n, 1]`` lengths from 0.5 to beyond r_max, exactly r_max and just below it."""
    g = torch.Generator().manual_seed(seed)
    r = torch.empty(n, 1, dtype=F64).uniform_(0.5, 1.3 * r_max, generator=g)
    r[0], r[1], r[2] = r_max, r_max * (1 - 1e-9), 2 * r_max
    return r


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def randn_like(t: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.randn(t.shape, generator=torch.Generator().manual_seed(seed), dtype=t.dtype)


# ----- specs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("lmax", range(5))
def test_sh_spec_from_e3nn(lmax):
    spec, reason = sh_spec_from_module(e3nn_sh(lmax))
    assert reason is None and spec == SHSpec(lmax, "component", True)
    assert spec.dim == (lmax + 1) ** 2
    assert hash(spec) == hash(SHSpec(lmax)) and spec.key() == SHSpec(lmax).key()
    assert re.fullmatch(r"[0-9a-f]{16}", spec.key())
    assert f"lmax={lmax}" in spec.describe()


def test_sh_spec_reasons():
    from mace_accel._e3nn_compat import o3

    assert sh_spec_from_module(e3nn_sh(2, normalize=False, normalization="norm"))[0] == \
        SHSpec(2, "norm", False)
    spec, reason = sh_spec_from_module(e3nn_sh(5))
    assert spec is None and "lmax 5" in reason and "<= 4" in reason
    spec, reason = sh_spec_from_module(o3().SphericalHarmonics([1, 2], normalize=True))
    assert spec is None and "orders [1, 2]" in reason
    spec, reason = sh_spec_from_module(torch.nn.Linear(3, 3))
    assert spec is None and "not e3nn's o3.SphericalHarmonics" in reason


@pytest.mark.parametrize("apply_cutoff", [True, False])
def test_radial_spec_from_mace(apply_cutoff):
    module = mace_radial(5.0, 8, 5, apply_cutoff=apply_cutoff)
    spec, reason = radial_spec_from_module(module)
    assert reason is None
    assert spec == make_radial_spec(5.0, 8, 5, apply_cutoff)  # mace's own float64 constants
    assert spec.frequencies == tuple(module.bessel_fn.bessel_weights.tolist())
    assert spec.key() != make_radial_spec(5.0, 8, 5, not apply_cutoff).key()
    assert "8 Bessel" in spec.describe()


def test_radial_spec_reasons():
    module = mace_radial()
    del module.apply_cutoff  # a checkpoint from before apply_cutoff: the cutoff is applied
    assert radial_spec_from_module(module)[0].apply_cutoff is True
    float32 = mace_radial().float()  # constants are read off the buffers, in their dtype
    assert radial_spec_from_module(float32)[0].frequencies == tuple(
        float(v) for v in float32.bessel_fn.bessel_weights.double())
    cases = {
        "GaussianBasis": mace_radial(radial_type="gaussian"),
        "ChebychevBasis": mace_radial(radial_type="chebyshev"),
        "the model's elements": mace_radial(distance_transform="Agnesi"),  # no atomic numbers
    }
    trainable = mace_radial()
    trainable.bessel_fn.bessel_weights = torch.nn.Parameter(trainable.bessel_fn.bessel_weights)
    cases["trainable Bessel frequencies"] = trainable
    for expected, module in cases.items():
        spec, reason = radial_spec_from_module(module)
        assert spec is None and expected in reason, reason
    spec, reason = radial_spec_from_module(torch.nn.Linear(1, 8))
    assert spec is None and "RadialEmbeddingBlock" in reason
    for transform in ("Agnesi", "Soft"):  # fused with the model's elements' covalent radii
        spec, reason = radial_spec_from_module(mace_radial(distance_transform=transform),
                                               (1, 29))
        assert reason is None and spec.transform.kind == transform
        assert spec.transform.radii == (0.31, 1.32) and transform in spec.describe()
    assert "positive integer" in RadialSpec(2, (1.0, 2.0), 1.0, 5.0, 0).unsupported_reason()


# ----- reference vs e3nn / mace (float64) ---------------------------------------------------------
@pytest.mark.parametrize("lmax", range(5))
@pytest.mark.parametrize("normalization", ["component", "integral", "norm"])
def test_sh_reference_matches_e3nn(lmax, normalization):
    """The forward; its derivatives: :func:`test_sh_op_matches_e3nn_autograd` (the op's
    reference backend runs ``reference.sh_backward`` and ``sh_double_backward``)."""
    module = e3nn_sh(lmax, normalization=normalization)
    spec = sh_spec_from_module(module)[0]
    v = edge_vectors(seed=lmax)
    assert rel_norm_error(reference.sh_forward(spec, v), module(v)) <= TOL["forward"]
    # the directions, not the lengths, decide: very short and very long vectors alike
    unit = torch.nn.functional.normalize(v[2:], dim=-1)
    assert torch.allclose(reference.sh_forward(spec, v[2:]), module(unit), rtol=0, atol=1e-14)


@pytest.mark.parametrize("apply_cutoff", [True, False])
@pytest.mark.parametrize("p", [5, 6])
def test_radial_reference_matches_mace(apply_cutoff, p):
    module = mace_radial(5.0, 8, p, apply_cutoff=apply_cutoff)
    spec = radial_spec_from_module(module)[0]
    r = edge_lengths(spec.r_max)
    feats, cutoff = module(r, None, None, None)
    got, got_cutoff = reference.radial_forward(spec, r)
    assert torch.equal(got, feats)  # the same formulas in the same order: bit-identical
    assert (got_cutoff is None) == apply_cutoff
    beyond = (r >= spec.r_max).squeeze(1)
    if apply_cutoff:
        assert torch.all(got[beyond] == 0)  # the mask zeros every edge at or beyond r_max
    else:
        assert torch.equal(got_cutoff, cutoff) and torch.all(got_cutoff[beyond] == 0)
        assert torch.all(got[beyond] != 0)


def _radial_outputs(module, r):
    feats, cutoff = module(r, None, None, None)
    return (feats,) if cutoff is None else (feats, cutoff)


# ----- custom ops (reference backend) vs plain autograd through the modules ----------------------
def _sh_fused(spec):
    key = ops.register_sh(spec)
    return lambda v: ops.spherical_harmonics(key, v, backend="reference")


def _radial_fused(spec):
    key = ops.register_radial(spec)

    def fn(r):
        feats, cutoff = ops.radial_embedding(key, r, backend="reference")
        return (feats,) if cutoff is None else (feats, cutoff)
    return fn


def _first_and_second(fn, x, probe_seed: int = 5):
    """Output, gradient and the gradients of ``s = <probe, gx> + |gx|^2 |upstream|`` w.r.t. the
    input and the upstream gradient (mixes every branch of the double backward)."""
    x = x.detach().clone().requires_grad_()
    outs = fn(x)
    outs = outs if isinstance(outs, tuple) else (outs,)
    ups = [randn_like(o, 30 + i).requires_grad_() for i, o in enumerate(outs)]
    (gx,) = torch.autograd.grad(outs, x, ups, create_graph=True)
    probe = randn_like(gx, probe_seed)
    s = (gx * probe).sum() + gx.pow(2).sum() * sum(u.norm() for u in ups)
    second = torch.autograd.grad(s, [x] + ups)
    return [o.detach() for o in outs], gx.detach(), second


@pytest.mark.parametrize("lmax", [1, 2, 3, 4])
@pytest.mark.parametrize("normalization", ["component", "integral", "norm"])
def test_sh_op_matches_e3nn_autograd(lmax, normalization):
    module = e3nn_sh(lmax, normalization=normalization)
    spec = sh_spec_from_module(module)[0]
    # realistic scales for the product term of the probe; then every scale, 1e-9 to 1e9, with a
    # vector below the normalize eps and one on an axis
    for v in (edge_vectors(seed=7)[2:] / 1e3, edge_vectors(seed=lmax)):
        got = _first_and_second(_sh_fused(spec), v)
        want = _first_and_second(module, v)
        assert rel_norm_error(got[0][0], want[0][0]) <= TOL["forward"]
        assert rel_norm_error(got[1], want[1]) <= TOL["backward"]
        for a, b in zip(got[2], want[2]):
            assert b.norm() > 0
            assert rel_norm_error(a, b) <= TOL["double_backward"]


@pytest.mark.parametrize("apply_cutoff", [True, False])
def test_radial_op_matches_mace_autograd(apply_cutoff):
    module = mace_radial(5.0, 8, 5, apply_cutoff=apply_cutoff)
    spec = radial_spec_from_module(module)[0]
    r = edge_lengths(spec.r_max, seed=8)
    got = _first_and_second(_radial_fused(spec), r)
    want = _first_and_second(lambda x: _radial_outputs(module, x), r)
    for a, b in zip(got[0], want[0]):
        assert rel_norm_error(a, b) <= TOL["forward"]
    assert rel_norm_error(got[1], want[1]) <= TOL["backward"]
    for a, b in zip(got[2], want[2]):
        assert b.norm() > 0
        assert rel_norm_error(a, b) <= TOL["double_backward"]


def test_radial_op_with_only_one_output_used():
    spec = make_radial_spec(5.0, 8, 5, apply_cutoff=False)
    module = mace_radial(5.0, 8, 5, apply_cutoff=False)
    r = edge_lengths(5.0, seed=9)
    for which in (0, 1):
        rf, rp = leaves(r, r)
        (gf,) = torch.autograd.grad(_radial_fused(spec)(rf)[which].sum(), rf)
        (gp,) = torch.autograd.grad(_radial_outputs(module, rp)[which].sum(), rp)
        assert rel_norm_error(gf, gp) <= TOL["backward"]


def unit_scale_vectors(n: int = 5, seed: int = 0) -> torch.Tensor:
    """Random vectors of length ~1 (finite differences need a well-scaled input)."""
    return torch.randn(n, 3, generator=torch.Generator().manual_seed(seed), dtype=F64)


def test_gradcheck_and_gradgradcheck():
    for lmax in (2, 4):
        v = leaves(unit_scale_vectors(seed=lmax))
        assert torch.autograd.gradcheck(_sh_fused(SHSpec(lmax)), v, eps=1e-6, atol=1e-8,
                                        rtol=1e-6, fast_mode=True)
        assert torch.autograd.gradgradcheck(_sh_fused(SHSpec(lmax)), v, eps=1e-6, atol=1e-8,
                                            rtol=1e-6, fast_mode=True)
    assert torch.autograd.gradcheck(_sh_fused(SHSpec(3, "norm", False)),
                                    leaves(unit_scale_vectors()), eps=1e-6, atol=1e-8,
                                    fast_mode=True)
    for apply_cutoff in (True, False):
        spec = make_radial_spec(4.0, 6, 5, apply_cutoff)
        r = leaves(edge_lengths(3.6, n=8, seed=1)[3:])  # inside and beyond r_max, not at it
        assert torch.autograd.gradcheck(_radial_fused(spec), r, eps=1e-6, atol=1e-8, rtol=1e-6,
                                        fast_mode=True)
        assert torch.autograd.gradgradcheck(_radial_fused(spec), r, eps=1e-6, atol=1e-8,
                                            rtol=1e-6, fast_mode=True)


def test_gradcheck_catches_a_wrong_backward(monkeypatch):
    """The oracle has teeth: a backward off by 1% fails gradcheck, a wrong Hessian gradgradcheck
    (in the fast mode the checks above use: a random projection of the Jacobian)."""
    v = leaves(unit_scale_vectors(seed=3))
    exact_bwd, exact_dbl = reference.sh_backward, reference.sh_double_backward
    monkeypatch.setattr(reference, "sh_backward", lambda *a: 1.01 * exact_bwd(*a))
    with pytest.raises(GradcheckError):
        torch.autograd.gradcheck(_sh_fused(SHSpec(3)), v, eps=1e-6, atol=1e-8, rtol=1e-6,
                                 fast_mode=True)
    monkeypatch.setattr(reference, "sh_backward", exact_bwd)

    def wrong_hessian(*args):
        dv, dg = exact_dbl(*args)
        return 1.01 * dv, dg
    monkeypatch.setattr(reference, "sh_double_backward", wrong_hessian)
    with pytest.raises(GradcheckError):
        torch.autograd.gradgradcheck(_sh_fused(SHSpec(3)), v, eps=1e-6, atol=1e-8, rtol=1e-6,
                                     fast_mode=True)


def test_third_derivative_is_a_clear_error():
    v = leaves(unit_scale_vectors())[0]
    out = _sh_fused(SHSpec(2))(v)
    (g,) = torch.autograd.grad(out.pow(2).sum(), v, create_graph=True)
    (h,) = torch.autograd.grad(g.pow(2).sum(), v, create_graph=True)
    with pytest.raises(KernelError, match="cannot be differentiated again"):
        torch.autograd.grad(h.sum(), v)


def test_an_unknown_backend_is_refused():
    """(The ops' fake implementations and fresh outputs: tests/test_compile.py's opcheck.)"""
    with pytest.raises(KernelError, match="backend must be"):
        ops.sh_op(edge_vectors(8), ops.register_sh(SHSpec(3)), "triton")


# ----- the generated maths, run in numpy ----------------------------------------------------------
def _unit_inputs(v: np.ndarray, normalize: bool) -> dict:
    """What the kernels' ``_sh_unit`` computes before the printed program."""
    if normalize:
        n = np.sqrt((v * v).sum(1))
        di = 1.0 / np.where(n < NORMALIZE_EPS, NORMALIZE_EPS, n)
        k = (n >= NORMALIZE_EPS).astype(np.float64)
        u = v * di[:, None]
    else:
        u, di, k = v, np.ones(len(v)), np.zeros(len(v))
    return {"u0": u[:, 0], "u1": u[:, 1], "u2": u[:, 2], "di": di, "k": k}


@pytest.mark.parametrize("name", [p.name for p in unique_sh(select())])
def test_generated_sh_maths_matches_reference(name):
    spec = CATALOG[name].sh_spec()
    v = edge_vectors(30, seed=11)
    g = randn_like(torch.empty(30, spec.dim, dtype=F64), 12)
    a = randn_like(v, 13)
    values = _unit_inputs(v.numpy(), spec.normalize)
    values.update({f"g{k}": g[:, k].numpy() for k in range(spec.dim)})
    values.update({f"{'a' if spec.normalize else 't'}{i}": a[:, i].numpy() for i in range(3)})
    got = {}
    for which in codegen.PASSES:
        program = codegen.sh_program(spec, which)
        result = program.evaluate({n: values[n] for n in program.inputs})
        got[which] = torch.from_numpy(np.stack([result[n] for n in
                                                codegen.sh_stored(spec, which)], 1).copy())
    assert rel_norm_error(got["forward"], reference.sh_forward(spec, v)) <= TOL["forward"]
    assert rel_norm_error(got["backward"], reference.sh_backward(spec, v, g)) <= TOL["backward"]
    dv, dg = reference.sh_double_backward(spec, v, g, a)
    assert rel_norm_error(got["double_backward"][:, :3], dv) <= TOL["double_backward"]
    assert rel_norm_error(got["double_backward"][:, 3:], dg) <= TOL["double_backward"]


@pytest.mark.parametrize("name", [p.name for p in unique_radial(select())])
def test_generated_radial_maths_matches_reference(name):
    spec = CATALOG[name].radial_spec()
    r = edge_lengths(spec.r_max, seed=14)
    g = randn_like(torch.empty(r.shape[0], spec.num_basis, dtype=F64), 15)
    gc = None if spec.apply_cutoff else randn_like(r, 16)
    a = randn_like(r, 17)
    rn = r.numpy()[:, 0]
    r0 = None if spec.transform is None else pair_r0_values(spec, r.shape[0], seed=18)
    base = {"s": rn / spec.r_max, "m": (rn < spec.r_max).astype(np.float64), "rb": rn}
    for order in range(3):  # the envelope program of each kernel (order = pass)
        program = symbolic.envelope_program(spec, order)
        base.update(program.evaluate({**base, **symbolic.radial_constants(spec)}))
    if r0 is not None:  # the Bessel functions take x = T(r, r0)
        program = symbolic.transform_program(spec, 2)
        base.update(program.evaluate({"r": rn, "r0": r0.numpy()[:, 0],
                                      **symbolic.transform_constants(spec)}))
        base["rb"] = base["X"]
    base["ri"] = 1.0 / base["rb"]
    cols = {which: [] for which in codegen.PASSES}
    for b in range(spec.num_basis):
        consts = symbolic.radial_constants(spec, b)
        angle = np.pi * (spec.frequencies[b] / np.pi) * base["rb"]  # sinpi(w / pi * x)
        values = {**base, **consts, "S": np.sin(angle), "Cw": np.cos(angle)}
        for which in codegen.PASSES:
            program = symbolic.radial_basis_program(spec, which)
            cols[which].append(program.evaluate({n: values[n] for n in program.inputs}))
    feats = np.stack([c["F"] for c in cols["forward"]], 1)
    d1 = np.stack([c["dF"] for c in cols["backward"]], 1)
    d2 = np.stack([c["d2F"] for c in cols["double_backward"]], 1)
    gn, an = g.numpy(), a.numpy()[:, 0]
    grad_r = (gn * d1).sum(1) + (0 if gc is None else gc.numpy()[:, 0] * base["dC"])
    hess_r = ((gn * d2).sum(1) + (0 if gc is None else gc.numpy()[:, 0] * base["d2C"])) * an
    want_feats, want_cutoff = reference.radial_forward(spec, r, r0)
    want_r, want_g, want_c = reference.radial_double_backward(spec, r, g, gc, a, r0)

    def err(x, y):
        return rel_norm_error(torch.from_numpy(np.array(x, dtype=np.float64, copy=True)), y)

    assert err(feats, want_feats) <= TOL["forward"]
    assert np.all(feats[rn >= spec.r_max] == 0) or not spec.apply_cutoff
    if not spec.apply_cutoff:
        assert err(base["C"], want_cutoff[:, 0]) <= TOL["forward"]
        assert err(base["dC"] * an, want_c[:, 0]) <= TOL["double_backward"]
    assert err(grad_r, reference.radial_backward(spec, r, g, gc, r0)[:, 0]) <= TOL["backward"]
    assert err(hess_r, want_r[:, 0]) <= TOL["double_backward"]
    assert err(d1 * an[:, None], want_g) <= TOL["double_backward"]


def pair_r0_values(spec, n: int, seed: int) -> torch.Tensor:
    """``[n, 1]`` float64: the transform's r0 of random pairs of the spec's elements."""
    gen = torch.Generator().manual_seed(seed)
    k = len(spec.transform.radii)
    a, b = torch.randint(0, k, (2, n), generator=gen).tolist()
    return torch.tensor([spec.transform.r0(i, j) for i, j in zip(a, b)],
                        dtype=torch.float64).unsqueeze(-1)


@pytest.mark.parametrize("transform", ["Agnesi", "Soft"])
def test_radial_op_with_a_transform_matches_mace_autograd(transform):
    """The op with each edge's r0 (reference backend: what the CPU runs) against mace's
    ``RadialEmbeddingBlock`` with the transform, through double backward."""
    module = mace_radial(6.0, 10, 5, apply_cutoff=False, distance_transform=transform)
    numbers = (1, 29)
    spec = radial_spec_from_module(module, numbers)[0]
    key = ops.register_radial(spec)
    n = 300
    gen = torch.Generator().manual_seed(3)
    attrs = torch.nn.functional.one_hot(torch.randint(0, 2, (40,), generator=gen), 2).double()
    edge_index = torch.randint(0, 40, (2, n), generator=gen)
    r = edge_lengths(spec.r_max, n=n, seed=8)
    elements = attrs.argmax(1)
    r0 = reference.pair_r0(spec.transform, torch.tensor(spec.transform.radii,
                                                        dtype=torch.float64), elements, edge_index)

    def fused(x):
        feats, cutoff = ops.radial_embedding(key, x, "reference", r0)
        return feats, cutoff

    def mace(x):
        return module(x, attrs, edge_index, torch.tensor(numbers))

    got = _first_and_second(fused, r)
    want = _first_and_second(mace, r)
    for a, b in zip(got[0], want[0]):
        assert rel_norm_error(a, b) <= TOL["forward"]
    assert rel_norm_error(got[1], want[1]) <= TOL["backward"]
    for a, b in zip(got[2], want[2]):
        assert rel_norm_error(a, b) <= TOL["double_backward"]


def test_printer_prints_exact_literals_and_integer_powers():
    import sympy

    x, y, c = sympy.symbols("x y C")
    text = codegen.c_expr(sympy.sqrt(3) * x**3 - x / 7 + c + x / y**2, {"C": 0.1})
    assert "((real)0x1.bb67ae8584caap+0)" in text  # sqrt(3), correctly rounded
    assert f"((real){(1 / 7).hex()})" in text and f"((real){(0.1).hex()})" in text
    assert "(x * x * x)" in text and "x / ((y * y))" in text
    with pytest.raises(ValueError, match="cannot print"):
        codegen.c_expr(sympy.sin(x), {})


def test_catalog_sources_names_and_kernels():
    from mace_accel.ops.sources import PIN_LIMITS

    sources = dict(codegen.catalog_sources(PIN_LIMITS))
    assert all(name.startswith("edge_features/") for name in sources)
    n_sh, n_radial = len(unique_sh(select())), len(unique_radial(select()))
    assert len(sources) == 2 * 3 * (n_sh + n_radial)
    mp = {k: v for k, v in sources.items() if k.startswith("edge_features/mp-float32-")}
    assert "mace_edge_sh_dbwd" in mp["edge_features/mp-float32-sh-dbwd"]
    assert "typedef float real;" in mp["edge_features/mp-float32-radial-fwd"]
    assert all("#define THREADS 128" in src for src in sources.values())
    assert {"model", "edge", "cpu"} <= set().union(*(p.tags for p in select()))


def test_plan_stages_rows_in_shared_memory_that_fits():
    plan = plan_for(SHSpec(4), "float64")
    assert plan.threads == 128 and plan.pitch == 25 and plan.tile_bytes <= 48 * 1024
    assert plan.blocks(10**9) == plan.max_blocks and plan.blocks(1) == 1
    wide = plan_for(make_radial_spec(5.0, 128, 5), "float64")  # 129 doubles a row
    assert wide.pitch == 129 and wide.threads == 32 and wide.tile_bytes <= 48 * 1024
    assert plan_edges("float32", 16).pitch == 17  # odd pitch: conflict-free row writes
    with pytest.raises(KernelError, match="dtype"):
        plan_edges("float16", 16)


# ----- surgery ------------------------------------------------------------------------------------
def _batch(model, seed: int = 3):
    info = model_info(model)
    atoms = random_structure(info.atomic_numbers, n_atoms=7, r_max=info.r_max, seed=seed)
    return atoms_to_batch(atoms, info)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_state(a, b) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])
                                      for k in a)


SURGERY_CASES = [  # (max_ell, apply_cutoff: True / False / None = attribute missing, dtype)
    (1, True, F64), (2, False, F64), (3, None, F64), (3, True, F32),
]


@pytest.mark.parametrize("case", SURGERY_CASES, ids=lambda c: f"l{c[0]}-{c[1]}-{c[2]}")
def test_patch_matches_unpatched_model_and_reverts(case, tiny_model):
    max_ell, apply_cutoff, dtype = case
    model = tiny_model("RealAgnosticResidualInteractionBlock", max_ell=max_ell, dtype=dtype)
    if apply_cutoff is None:
        del model.radial_embedding.apply_cutoff
    else:
        model.radial_embedding.apply_cutoff = apply_cutoff
    batch = _batch(model)
    before, state_before = evaluate(model, batch, True), _state(model)
    originals = (model.spherical_harmonics, model.radial_embedding)
    patch = EdgeFeaturesPatch()
    assert patch.applies_to(model) and not patch.applies_to(model.interactions[0])

    record = patch.apply("", model, REF)
    assert record.patched and record.kind == "edge_features"
    assert isinstance(model.spherical_harmonics, FusedSphericalHarmonics)
    assert isinstance(model.radial_embedding, FusedRadialEmbedding)
    assert f"lmax={max_ell}" in record.parts[0].detail
    assert model.radial_embedding.spec.apply_cutoff is (apply_cutoff is not False)
    after = evaluate(model, batch, True)
    for key in before:
        assert rel_norm_error(after[key], before[key]) <= MODEL_TOL[dtype], key
    assert _same_state(_state(model), state_before)
    assert patch.apply("", model, REF).skipped_reason == "already accelerated"

    loaded = save_and_load(model)
    assert isinstance(loaded.radial_embedding, FusedRadialEmbedding)
    reloaded = evaluate(loaded, batch, True)
    assert all(torch.equal(reloaded[k], after[k]) for k in after)

    patch.revert(model)
    assert (model.spherical_harmonics, model.radial_embedding) == originals
    assert model.spherical_harmonics is originals[0] and model.radial_embedding is originals[1]
    assert not patch.is_applied(model)
    assert _same_state(_state(model), state_before)
    assert all(torch.equal(v, before[k]) for k, v in evaluate(model, batch, True).items())


def test_accelerate_fuses_edge_features_with_the_interaction_blocks(tiny_model):
    model = tiny_model("RealAgnosticResidualInteractionBlock", max_ell=2)
    report = accelerate(model, backend="reference", verify=True)
    record = next(r for r in report.records if r.kind == "edge_features")
    assert record.path == "" and record.patched and record.backend == "reference"
    assert all(v <= MODEL_TOL[F64] for v in report.verification.values())
    assert "edge_features" in str(report)
    assert revert(model) == len(report.records)
    assert not isinstance(model.radial_embedding, FusedRadialEmbedding)


def test_constants_follow_load_state_dict_and_dtype_changes(tiny_model):
    model = tiny_model("RealAgnosticResidualInteractionBlock", max_ell=2)
    batch = _batch(model)
    EdgeFeaturesPatch().apply("", model, REF)
    evaluate(model, batch, True)
    state = model.state_dict()
    key = "radial_embedding.bessel_fn.bessel_weights"
    state[key] = state[key] * 1.1  # a buffer in the state dict: loading changes the basis
    model.load_state_dict(state)
    assert model.radial_embedding.spec.frequencies != tuple(state[key].tolist())
    got = evaluate(model, batch, True)
    assert model.radial_embedding.spec.frequencies == tuple(state[key].tolist())
    EdgeFeaturesPatch().revert(model)
    want = evaluate(model, batch, True)
    assert all(rel_norm_error(got[k], want[k]) <= MODEL_TOL[F64] for k in want)


def test_unsupported_modules_are_left_with_a_reason(tiny_model):
    model = tiny_model("RealAgnosticResidualInteractionBlock", max_ell=2)
    patch = EdgeFeaturesPatch()
    original_sh = model.spherical_harmonics
    model.spherical_harmonics = e3nn_sh(5)  # plans only: the model is not run
    record = patch.describe("", model, REF)
    assert record.parts[0].fused
    assert "spherical_harmonics left: lmax 5" in record.parts[0].detail
    assert "radial_embedding: RadialSpec" in record.parts[0].detail
    patch.apply("", model, REF)
    assert model.spherical_harmonics.__class__.__name__ == "SphericalHarmonics"
    assert isinstance(model.radial_embedding, FusedRadialEmbedding)
    patch.revert(model)

    model.spherical_harmonics = original_sh
    model.radial_embedding = mace_radial(4.0, 4, 5, radial_type="gaussian")
    record = patch.apply("", model, REF)
    assert isinstance(model.spherical_harmonics, FusedSphericalHarmonics)
    assert "radial_embedding left: radial basis GaussianBasis" in record.parts[0].detail
    patch.revert(model)

    model.spherical_harmonics = e3nn_sh(5)
    record = patch.apply("", model, REF)
    assert not record.patched and "lmax 5" in record.skipped and "GaussianBasis" in record.skipped
    assert not patch.is_applied(model)

    record = patch.describe("", model, REF.replace(parts=("conv",)))
    assert not record.patched and "not asked for" in record.skipped
