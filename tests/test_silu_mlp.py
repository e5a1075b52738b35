"""The fused SiLU MLP without a GPU: packing and the op's reference path with every gradient
(the kernels' plans and data flow: test_silu_mlp_dmma.py; the CUDA kernels are checked against
the reference in test_gpu_silu_mlp.py)."""

from __future__ import annotations

import pytest
import torch

from mace_accel.errors import UnsupportedModelError
from mace_accel.ops.radial import mlp as radial_mlp
from mace_accel.ops.radial.silu_mlp import autograd
from mace_accel.ops.radial.silu_mlp.catalog import CATALOG
from mace_accel.ops.radial.silu_mlp.spec import SiluMLPSpec, pack_weights, unpack_weights


FAST_ATOL = 1e-9  # float64 central differences are good to ~1e-10 here


def _weights(spec, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(a, b, generator=gen, dtype=dtype) / a ** 0.5
            for a, b in zip(spec.widths[:-1], spec.widths[1:])]


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_packing_round_trips_and_leaves_a_zero_gap(name):
    spec = CATALOG[name]
    weights = _weights(spec)
    packed = pack_weights(spec, weights)
    assert packed.shape == (spec.packed_numel,) and packed.is_contiguous()
    for w, back in zip(weights, unpack_weights(spec, packed)):
        assert torch.equal(w, back)
    plain = sum(w.numel() for w in weights)
    assert spec.fragment_start % 64 == 0 and spec.fragment_start - plain < 64
    assert not packed[plain:spec.fragment_start].any()


def test_bad_specs_and_weights_are_refused():
    with pytest.raises(UnsupportedModelError, match="at least one layer"):
        SiluMLPSpec((8,))
    with pytest.raises(UnsupportedModelError, match="up to"):
        SiluMLPSpec((8, 1024))
    spec = CATALOG["mace"]
    with pytest.raises(UnsupportedModelError, match="3 layers, got 2"):
        pack_weights(spec, _weights(spec)[:2])
    bad = _weights(spec)
    bad[1] = bad[1][:, :10]
    with pytest.raises(UnsupportedModelError, match="layer 1 .* expected \\(64, 64\\)"):
        pack_weights(spec, bad)


def _op_inputs(spec, n=37, dtype=torch.float64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, spec.widths[0], generator=gen, dtype=dtype)
    return x, pack_weights(spec, _weights(spec, dtype, seed))


@pytest.mark.parametrize("name", ["mace", "odd", "one_layer"])
def test_reference_op_equals_the_radial_mlp_with_every_gradient(name):
    spec = CATALOG[name]
    key = autograd.register_spec(spec)
    x, w = _op_inputs(spec)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = autograd.silu_mlp(key, x, w, "reference")
    weights = [t.detach().clone().requires_grad_(True) for t in unpack_weights(spec, w)]
    x2 = x.detach().clone().requires_grad_(True)
    want = radial_mlp.reference(x2, weights, last_act=True)
    assert torch.allclose(out, want, rtol=1e-14, atol=1e-14)
    g = torch.randn_like(want)
    gx, gw = torch.autograd.grad(out, (x, w), g)
    gx2, *gws = torch.autograd.grad(want, (x2, *weights), g)
    assert torch.allclose(gx, gx2, rtol=1e-12, atol=1e-13)
    for want_w, got_w in zip(gws, unpack_weights(spec, gw)):
        assert torch.allclose(got_w, want_w, rtol=1e-12, atol=1e-13)
    assert not gw[spec.fragment_start:].any()  # the kernels' copies take no gradient


def test_the_backward_asks_torch_for_the_gradients_wanted(monkeypatch):
    """The op's backward is the torch path, asked for exactly the gradients wanted: d x alone
    (forces), d w alone, or both (training)."""
    spec = CATALOG["mace"]
    key = autograd.register_spec(spec)
    x, w = _op_inputs(spec)
    calls = []
    real = autograd._vjp
    monkeypatch.setattr(autograd, "_vjp", lambda *a: calls.append(a[-2:]) or real(*a))
    x.requires_grad_(True)
    torch.autograd.grad(autograd.silu_mlp(key, x, w, "reference").sum(), x)
    assert calls == [(True, False)]
    w.requires_grad_(True)
    torch.autograd.grad(autograd.silu_mlp(key, x, w, "reference").sum(), (x, w))
    assert calls[-1] == (True, True)
    torch.autograd.grad(autograd.silu_mlp(key, x.detach(), w, "reference").sum(), w)
    assert calls[-1] == (False, True) and len(calls) == 3


def test_gradcheck_and_double_backward():
    spec = CATALOG["odd"]
    key = autograd.register_spec(spec)
    x, w = _op_inputs(spec, n=5)
    x.requires_grad_(True)
    w.requires_grad_(True)
    f = lambda a, b: autograd.silu_mlp(key, a, b, "reference")  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, w), fast_mode=True, atol=FAST_ATOL)
    assert torch.autograd.gradgradcheck(f, (x, w), fast_mode=True, atol=FAST_ATOL)
    # frozen weights, double backward in x alone (a Hessian-vector product)
    x2 = x.detach().clone().requires_grad_(True)
    wf = w.detach()
    assert torch.autograd.gradgradcheck(lambda a: autograd.silu_mlp(key, a, wf, "reference"),
                                        (x2,))


def test_the_fast_gradcheck_catches_a_wrong_backward(monkeypatch):
    """The check above uses gradcheck's fast mode (a random projection of the Jacobian, as the
    full one takes seconds per weight) with a tight absolute tolerance (the projection is
    ~1e-3, so the default 1e-5 would pass a 1% error): it fails a backward 1% off."""
    from torch.autograd.gradcheck import GradcheckError

    spec = CATALOG["odd"]
    key = autograd.register_spec(spec)
    x, w = _op_inputs(spec, n=5)
    x.requires_grad_(True)
    w.requires_grad_(True)
    exact = autograd._vjp

    def wrong(*args, **kwargs):
        return tuple(None if t is None else 1.01 * t for t in exact(*args, **kwargs))

    monkeypatch.setattr(autograd, "_vjp", wrong)
    with pytest.raises(GradcheckError):
        torch.autograd.gradcheck(lambda a, b: autograd.silu_mlp(key, a, b, "reference"),
                                 (x, w), fast_mode=True, atol=FAST_ATOL)


def test_fake_implementations_give_the_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = CATALOG["odd"]
    key = autograd.register_spec(spec)
    with FakeTensorMode():
        x = torch.empty(11, spec.widths[0])
        w = torch.empty(spec.packed_numel)
        out = autograd.silu_mlp_op(x, w, key, "cuda")
    assert out.shape == (11, spec.widths[-1])
