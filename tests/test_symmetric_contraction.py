"""The symmetric contraction on the CPU: spec and reference vs mace's own module, the custom ops'
autograd (backward, weight gradients, double backward) vs autograd of mace's module, finite
differences, the fused module's checks, and the catalog's generated sources.

Everything runs the ``reference`` backend (plain torch); the CUDA kernels are checked against
the same reference on the GPU (tests/test_gpu_symmetric_contraction.py).
"""

from __future__ import annotations

import pickle

import pytest
import torch

from mace_accel.errors import InputError, KernelError
from mace_accel.ops.symmetric_contraction import autograd as ops
from mace_accel.ops.symmetric_contraction import codegen
from mace_accel.ops.symmetric_contraction.catalog import build, select
from mace_accel.options import AccelOptions
from mace_accel.patches.product_blocks import FusedSymmetricContraction
from mace_accel.tolerances import PASS_TOL

F64 = torch.float64
CPU_NAMES = [p.name for p in select("cpu")] + [p.name for p in select("edge")]
TOL = PASS_TOL[F64]


def _inputs(spec, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, spec.num_features, spec.num_components, generator=gen, dtype=F64)
    elem = torch.randint(0, spec.num_elements, (n,), generator=gen)
    y = torch.nn.functional.one_hot(elem, spec.num_elements).to(F64)
    return x, y


def _fused(module, spec, **options):
    return FusedSymmetricContraction(module, spec, AccelOptions(backend="reference", **options))


def _oracle(module, spec, x, y):
    """mace's module; where it cannot run (mace 0.3.16's ``out.view`` fails on the
    non-contiguous output of a correlation-1 contraction with L > 0 outputs), the reference
    polynomial differentiated by plain autograd."""
    from mace_accel.ops.symmetric_contraction import reference

    try:
        module(x, y)
        return module
    except RuntimeError:
        def plain(xs, ys):
            return reference.symmetric_contraction(spec, xs, ys.argmax(-1), [
                w for c in module.contractions for w in (c.weights_max, *c.weights)])
        return plain


@pytest.mark.parametrize("name", CPU_NAMES)
def test_every_pass_matches_mace(name):
    """Forward, forces-style backward, double backward (to x and the weights) and the weight
    gradients of the fused module vs mace's own module, fp64."""
    module, spec = build(name)
    fused = _fused(module, spec)
    x, y = _inputs(spec, 9)
    weights = list(module.parameters())
    results = []
    for m in (_oracle(module, spec, x, y), fused):
        xs = x.clone().requires_grad_(True)
        out = m(xs, y)
        g = torch.linspace(-1, 1, out.numel(), dtype=F64).reshape(out.shape)
        (gx,) = torch.autograd.grad(out, xs, g, create_graph=True)
        v = torch.cos(torch.arange(x.numel(), dtype=F64)).reshape(x.shape)
        inputs = [xs, *weights]
        second = [torch.zeros_like(t) if d is None else d for t, d in zip(
            inputs, torch.autograd.grad((gx * v).sum(), inputs, allow_unused=True))]
        first_w = torch.autograd.grad(m(xs, y), weights, g)
        results.append({"forward": [out], "backward": [gx, *first_w],
                        "double_backward": list(second)})
    for which, tensors in results[1].items():
        for i, (a, b) in enumerate(zip(tensors, results[0][which])):
            # relative to the norm, floored at 1 (a linear contraction's second derivative is 0)
            err = (a - b).norm().item() / max(b.norm().item(), 1.0)
            assert err < TOL[which], (which, i, err)


def test_finite_differences_and_second_order():
    """gradcheck of the custom ops to x and the weights, gradgradcheck to x."""
    _, spec = build("small-l2-corr3")
    key = ops.register_spec(spec)
    x, y = _inputs(spec, 3, seed=1)
    elem = y.argmax(-1).to(torch.int32)
    weights = [torch.randn(s, dtype=F64) * 0.5 for s in spec.weight_shapes]
    x.requires_grad_(True)
    for w in weights:
        w.requires_grad_(True)

    def f(x, *ws):
        return ops.symmetric_contraction(key, x, elem, ws, backend="reference")

    assert torch.autograd.gradcheck(f, (x, *weights), fast_mode=True)
    # second order in x (forces, and their derivatives in training); the weights' second
    # derivatives are checked against mace in test_every_pass_matches_mace
    fixed = [w.detach() for w in weights]
    assert torch.autograd.gradgradcheck(lambda x: f(x, *fixed), (x,), fast_mode=True)


def test_weight_gradients_only_when_the_weights_want_them(monkeypatch):
    """Inference (frozen weights, forces only) runs no weight-gradient op, in the backward nor
    in the double backward; weights that require grad get theirs. (torch hands a list input's
    flags over as a list, and a list of False is truthy: this once ran the weight gradients on
    every forces call.)"""
    _, spec = build("small-l2-corr3")
    key = ops.register_spec(spec)
    x, y = _inputs(spec, 4, seed=2)
    elem = y.argmax(-1).to(torch.int32)
    weights = [torch.randn(s, dtype=F64) * 0.5 for s in spec.weight_shapes]
    calls = []
    real = ops.sc_weight_grad_op

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(ops, "sc_weight_grad_op", counting)
    xs = x.clone().requires_grad_(True)
    out = ops.symmetric_contraction(key, xs, elem, weights, backend="reference")
    (gx,) = torch.autograd.grad(out.sum(), xs, create_graph=True)
    torch.autograd.grad(gx.pow(2).sum(), xs)
    assert not calls
    trained = [w.clone().requires_grad_(True) for w in weights]
    out = ops.symmetric_contraction(key, xs, elem, trained, backend="reference")
    grads = torch.autograd.grad(out.sum(), trained)
    assert calls and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_third_derivative_says_what_to_do():
    module, spec = build("small-corr1")
    fused = _fused(module, spec)
    x, y = _inputs(spec, 4)
    x.requires_grad_(True)
    (gx,) = torch.autograd.grad(fused(x, y).pow(3).sum(), x, create_graph=True)
    (gxx,) = torch.autograd.grad(gx.pow(2).sum(), x, create_graph=True)
    with pytest.raises(KernelError, match="unpatched"):
        torch.autograd.grad(gxx.sum(), x)


def test_repeats_and_zero_nodes():
    module, spec = build("small-l3-corr2")
    fused = _fused(module, spec)
    x, y = _inputs(spec, 5)
    assert torch.equal(fused(x, y), fused(x, y))
    empty = fused(x[:0], y[:0])
    assert empty.shape == (0, spec.dim_out)


def test_bad_inputs_are_clear_errors():
    module, spec = build("small-l2-corr3")
    fused = _fused(module, spec, check_indices=True)
    x, y = _inputs(spec, 4)
    with pytest.raises(InputError, match="node_feats must have shape"):
        fused(x[:, :, :-1], y)
    with pytest.raises(InputError, match="node_attrs must have shape"):
        fused(x, y[:, :-1])
    with pytest.raises(InputError, match="not one-hot"):
        fused(x, y * 0.5)
    with pytest.raises(KernelError, match="backend"):
        ops.symmetric_contraction(ops.register_spec(spec), x, y.argmax(-1).int(),
                                  list(module.parameters()), backend="bogus")


def test_pickle_keeps_the_original_and_results():
    module, spec = build("small-corr1")
    fused = _fused(module, spec)
    x, y = _inputs(spec, 6)
    clone = pickle.loads(pickle.dumps(fused))
    assert torch.equal(clone(x, y), fused(x, y))
    assert set(clone.state_dict()) == set(module.state_dict())


def test_plans_and_sources_of_every_catalog_problem():
    """Every problem's kernels render (both dtypes) and the plan fits the block."""
    for name, spec in codegen_specs():
        for dtype in ("float32", "float64"):
            plan = codegen.plan_kernels(spec, dtype)
            assert plan.threads % 32 == 0 and plan.threads >= spec.num_features
            assert plan.blocks(0) == 1 and plan.blocks(10**9) == plan.max_blocks
            names = [k for k, _ in codegen.all_kernels(plan, spec)]
            assert len(names) == len(set(names)) == 7, name


def codegen_specs():
    return [(p.name, build(p.name)[1]) for p in select()]


def test_float64_accumulators_use_dynamic_shared_memory():
    """MACE-MH-1's 512 channels x 16 components of float64 accumulators (64 KB) exceed the
    48 KB of a static shared array: they are dynamic, and the launch gives exactly their size."""
    _, spec = build("mh1-p1")
    plan = codegen.plan_kernels(spec, "float64")
    assert plan.accumulator_bytes == spec.num_components * plan.threads * 8 == 64 * 1024
    sources = dict(codegen.all_kernels(plan, spec))
    with_accumulators = [n for n, src in sources.items() if "extern __shared__" in src]
    assert codegen.backward_name(plan) in with_accumulators
    static = [line for src in sources.values() for line in src.splitlines()
              if "__shared__" in line and "extern" not in line]
    assert not static, static
    assert codegen.plan_kernels(spec, "float32").accumulator_bytes == 0
