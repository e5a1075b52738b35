"""Generated symmetric-contraction kernels vs the reference path, over the catalog (GPU only).

Every pass (forward, backward to x, weight gradients, double backward to x and g, directional
weight gradients) of the CUDA backend is compared with the plain-torch reference on the same
inputs: float64 as relative norm, float32 as relative L-inf against the float64 reference (the
tolerance table). Inputs are random, never zeros; repeats must be bit-identical.
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import pass_error

from mace_accel.ops.symmetric_contraction import autograd as ops
from mace_accel.ops.symmetric_contraction import reference
from mace_accel.ops.symmetric_contraction.catalog import build, select
from mace_accel.tolerances import PASS_TOL, rel_norm_error

pytestmark = pytest.mark.gpu
F32, F64 = torch.float32, torch.float64
NAMES = [p.name for p in select()]
N_NODES = 300


def _inputs(spec, n: int, seed: int = 0):
    """float64 CPU ``(x, v, elem, weights, g)``; every element occurs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, spec.num_features, spec.num_components, generator=gen, dtype=F64)
    v = torch.randn(x.shape, generator=gen, dtype=F64)
    elem = torch.randint(0, spec.num_elements, (n,), generator=gen)
    elem[: min(n, spec.num_elements)] = torch.arange(min(n, spec.num_elements))
    weights = [torch.randn(s, generator=gen, dtype=F64) for s in spec.weight_shapes]
    g = torch.randn(n, spec.dim_out, generator=gen, dtype=F64)
    return x, v, elem, weights, g


def _passes(spec, x, v, elem, weights, g, backend: str):
    key = ops.register_spec(spec)
    e32 = elem.to(torch.int32)
    out = ops.sc_op(x, e32, weights, key, backend)
    gx = ops.sc_backward_op(x, e32, weights, g, key, backend)
    gw = ops.sc_weight_grad_op(x, x.new_empty(0), e32, weights, g, key, backend)
    dx, dg = ops.sc_double_backward_op(x, v, e32, weights, g, key, backend, True, True)
    dw = ops.sc_weight_grad_op(x, v, e32, weights, g, key, backend)
    return {"forward": [out], "backward": [gx, *gw], "double_backward": [dx, dg, *dw]}


@pytest.mark.parametrize("dtype", (F32, F64), ids=("fp32", "fp64"))
@pytest.mark.parametrize("name", NAMES)
def test_every_pass_matches_reference(name, dtype):
    _, spec = build(name)
    cpu = _inputs(spec, N_NODES)
    ref = _passes(spec, *[t.cuda() if isinstance(t, torch.Tensor) else [w.cuda() for w in t]
                          for t in cpu], backend="reference")
    cast = [t.to("cuda", dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
            else (t.cuda() if isinstance(t, torch.Tensor) else [w.to("cuda", dtype) for w in t])
            for t in cpu]
    got = _passes(spec, *cast, backend="cuda")
    err = pass_error(dtype)
    for which, tensors in got.items():
        tol = PASS_TOL[dtype][which]
        for i, (a, b) in enumerate(zip(tensors, ref[which])):
            assert a.dtype == dtype and a.shape == b.shape
            e = err(a, b)
            assert e < tol, f"{name} {dtype} {which}[{i}]: error {e:.2e} > {tol:.0e}"


@pytest.mark.parametrize("name", ["mp-medium-p1", "small-l3-corr2"])
def test_repeats_are_bit_identical(name):
    _, spec = build(name)
    x, v, elem, weights, g = _inputs(spec, 257, seed=3)
    args = [x.cuda().float(), v.cuda().float(), elem.cuda(),
            [w.cuda().float() for w in weights], g.cuda().float()]
    first = _passes(spec, *args, backend="cuda")
    second = _passes(spec, *args, backend="cuda")
    for which in first:
        for a, b in zip(first[which], second[which]):
            assert torch.equal(a, b), which


def test_module_autograd_matches_mace_on_gpu():
    """The fused module in a model-like use: forward, forces-like grad, double backward to the
    weights, against mace's own module (float64)."""
    from mace_accel.options import AccelOptions
    from mace_accel.patches.product_blocks import FusedSymmetricContraction

    module, spec = build("mp-medium-p1")
    module = module.cuda()
    x, _, elem, _, _ = _inputs(spec, 64, seed=5)
    x = x.cuda().requires_grad_(True)
    y = torch.nn.functional.one_hot(elem, spec.num_elements).to("cuda", F64)
    fused = FusedSymmetricContraction(module, spec, AccelOptions(backend="cuda"))
    results = []
    for m in (module, fused):
        out = m(x, y)
        energy = (out ** 2).sum()
        (gx,) = torch.autograd.grad(energy, x, create_graph=True)
        loss = (gx ** 2).sum()
        grads = torch.autograd.grad(loss, [x, *module.parameters()], allow_unused=True)
        results.append([out, gx, *[g for g in grads if g is not None]])
    for a, b in zip(results[1], results[0]):
        assert rel_norm_error(a, b) < 1e-10


def test_zero_nodes():
    _, spec = build("small-corr1")
    key = ops.register_spec(spec)
    x = torch.empty(0, spec.num_features, spec.num_components, device="cuda", dtype=F64)
    weights = [torch.randn(s, device="cuda", dtype=F64) for s in spec.weight_shapes]
    out = ops.sc_op(x, torch.empty(0, dtype=torch.int32, device="cuda"), weights, key, "cuda")
    assert out.shape == (0, spec.dim_out)
    assert reference.symmetric_contraction(spec, x.cpu(), torch.empty(0, dtype=torch.long),
                                           [w.cpu() for w in weights]).shape == out.shape
