"""The fused SiLU MLP without a GPU: packing, kernel plans and sources, and the op's reference
path with every gradient (the CUDA kernels are checked against it in test_gpu_silu_mlp.py)."""

from __future__ import annotations

import pytest
import torch

from mace_accel.errors import UnsupportedModelError
from mace_accel.ops.radial import mlp as radial_mlp
from mace_accel.ops.radial.silu_mlp import autograd, codegen
from mace_accel.ops.radial.silu_mlp.catalog import CATALOG
from mace_accel.ops.radial.silu_mlp.spec import SiluMLPSpec, pack_weights, unpack_weights


def _weights(spec, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(a, b, generator=gen, dtype=dtype) / a ** 0.5
            for a, b in zip(spec.widths[:-1], spec.widths[1:])]


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_packing_pads_with_zeros_and_round_trips(name):
    spec = CATALOG[name]
    weights = _weights(spec)
    packed = pack_weights(spec, weights)
    assert packed.shape == (spec.packed_numel,) and packed.is_contiguous()
    for w, back in zip(weights, unpack_weights(spec, packed)):
        assert torch.equal(w, back)
    p = spec.padded_widths
    for i, (off, off_t) in enumerate(spec.offsets()):
        full = packed[off:off + p[i] * p[i + 1]].reshape(p[i], p[i + 1])
        full_t = packed[off_t:off_t + p[i] * p[i + 1]].reshape(p[i + 1], p[i])
        assert torch.equal(full_t, full.t())
        assert not full[spec.widths[i]:].any() and not full[:, spec.widths[i + 1]:].any()
        assert off % 4 == 0 and off_t % 4 == 0  # 16-byte vector loads stay aligned


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


@pytest.mark.parametrize("name", sorted(CATALOG))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_plans_fit_shared_memory_and_cover_every_output(name, dtype):
    spec = CATALOG[name]
    plan = codegen.plan_kernels(spec, dtype)
    assert plan.shared_bytes <= codegen.SHARED_BUDGET
    assert plan.tile_edges % plan.me == 0 and plan.ld % 2 == 0
    for layer in plan.layers:  # every micro-tile of every layer's output has a thread
        tiles = (plan.tile_edges // plan.me) * (layer["n"] // plan.mn)
        assert layer["reps"] * plan.threads >= tiles > (layer["reps"] - 1) * plan.threads
    assert plan.grid(0) == 1 and plan.grid(10 ** 9) == 132 * 16
    fwd, bwd = codegen.render_forward(plan), codegen.render_backward(plan)
    names = codegen.kernel_names(plan)
    assert names[0] in fwd and names[1] in bwd and names[0] != names[1]
    assert f"#define H0 {spec.widths[0]}" in fwd and f"#define HL {spec.widths[-1]}" in bwd


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
    for i, (_, off_t) in enumerate(spec.offsets()):  # the transposed copies are not read
        size = spec.padded_widths[i] * spec.padded_widths[i + 1]
        assert not gw[off_t:off_t + size].any()


def test_only_the_input_gradient_takes_the_backward_op(monkeypatch):
    """d x alone (forces) goes through mace_accel::silu_mlp_backward; asking for d w does not."""
    spec = CATALOG["mace"]
    key = autograd.register_spec(spec)
    x, w = _op_inputs(spec)
    calls = []
    real = autograd._vjp
    monkeypatch.setattr(autograd, "_vjp", lambda *a: calls.append(a[-2:]) or real(*a))
    x.requires_grad_(True)
    torch.autograd.grad(autograd.silu_mlp(key, x, w, "reference").sum(), x)
    assert calls == [(True, False)]  # once, inside the backward op's reference
    w.requires_grad_(True)
    torch.autograd.grad(autograd.silu_mlp(key, x, w, "reference").sum(), (x, w))
    assert calls[-1] == (True, True)


def test_gradcheck_and_double_backward():
    spec = CATALOG["odd"]
    key = autograd.register_spec(spec)
    x, w = _op_inputs(spec, n=5)
    x.requires_grad_(True)
    w.requires_grad_(True)
    f = lambda a, b: autograd.silu_mlp(key, a, b, "reference")  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, w), fast_mode=True)
    assert torch.autograd.gradgradcheck(f, (x, w), fast_mode=True)
    # frozen weights, double backward in x alone (a Hessian-vector product)
    x2 = x.detach().clone().requires_grad_(True)
    wf = w.detach()
    assert torch.autograd.gradgradcheck(lambda a: autograd.silu_mlp(key, a, wf, "reference"),
                                        (x2,))


def test_the_fast_gradcheck_catches_a_wrong_backward(monkeypatch):
    """The check above uses gradcheck's fast mode (a random projection of the Jacobian, as the
    full one takes seconds per weight): it still fails a backward 1% off."""
    from torch.autograd.gradcheck import GradcheckError

    spec = CATALOG["odd"]
    key = autograd.register_spec(spec)
    x, w = _op_inputs(spec, n=5)
    x.requires_grad_(True)
    w.requires_grad_(True)
    exact = autograd._vjp

    def wrong(*args, **kwargs):
        gx, gw = exact(*args, **kwargs)
        return (None if gx is None else 1.01 * gx), gw

    monkeypatch.setattr(autograd, "_vjp", wrong)
    with pytest.raises(GradcheckError):
        torch.autograd.gradcheck(lambda a, b: autograd.silu_mlp(key, a, b, "reference"),
                                 (x, w), fast_mode=True)


def test_fake_implementations_give_the_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = CATALOG["odd"]
    key = autograd.register_spec(spec)
    with FakeTensorMode():
        x = torch.empty(11, spec.widths[0])
        w = torch.empty(spec.packed_numel)
        out = autograd.silu_mlp_op(x, w, key, "cuda")
        gx = autograd.silu_mlp_backward_op(x, w, out, key, "cuda")
    assert out.shape == (11, spec.widths[-1]) and gx.shape == (11, spec.widths[0])
