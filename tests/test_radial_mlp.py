"""The folded radial MLP (:mod:`mace_accel.ops.radial.mlp`, :class:`FusedRadialMLP`): equal to
e3nn's FullyConnectedNet, its gradients (input and weights) and double backward exact, the
folded weights cached only while nothing can change them."""

from __future__ import annotations

import pytest
import torch

from mace_accel.ops.radial import mlp as radial_mlp
from mace_accel.options import AccelOptions
from mace_accel.patches.radial.mlp import FusedRadialMLP, spec_or_reason


def _net(hs=(8, 16, 16, 12), act=torch.nn.functional.silu, **kwargs):
    from mace_accel._e3nn_compat import o3

    o3()  # e3nn's constants load under torch >= 2.6
    from e3nn import nn

    torch.manual_seed(0)
    return nn.FullyConnectedNet(list(hs), act, **kwargs).double()


def _fused(net):
    spec, reason = spec_or_reason(net)
    assert reason is None
    return FusedRadialMLP(net, spec, AccelOptions(backend="reference", verify=False))


@pytest.mark.parametrize("kwargs", [{}, {"variance_in": 2.0, "variance_out": 0.5}])
def test_equals_e3nn_and_its_gradients(kwargs):
    net = _net(**kwargs)
    fused = _fused(net)
    x = torch.randn(50, 8, dtype=torch.float64, requires_grad=True)
    ref = net(x)
    out = fused(x)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, [x, *net.parameters()], g)
    out_grads = torch.autograd.grad(out, [x, *fused.parameters()], g)
    for a, b in zip(out_grads, ref_grads):
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-12)


def test_double_backward_matches_e3nn():
    """Training on forces: d/dW of <v, d out/dx> as e3nn's."""
    net = _net()
    fused = _fused(net)
    x = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(20, 8, dtype=torch.float64)
    results = []
    for module in (net, fused):
        out = module(x)
        (gx,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
        results.append(torch.autograd.grad((gx * v).sum(), [x, *module.parameters()]))
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_gradcheck_of_the_op():
    torch.manual_seed(1)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(3, 5, dtype=torch.float64, requires_grad=True),
          torch.randn(5, 4, dtype=torch.float64, requires_grad=True)]
    assert torch.autograd.gradcheck(lambda x, *w: radial_mlp.radial_mlp(x, w), (x, *ws))
    assert torch.autograd.gradgradcheck(lambda x, *w: radial_mlp.radial_mlp(x, w), (x, *ws))


def test_folded_weights_are_cached_until_a_parameter_changes():
    net = _net()
    for p in net.parameters():
        p.requires_grad_(False)
    fused = _fused(net)
    x = torch.randn(5, 8, dtype=torch.float64)
    first = fused(x)
    cached = fused._kernels["weights"][1]
    fused(x)
    assert fused._kernels["weights"][1] is cached
    with torch.no_grad():
        net.layer0.weight.mul_(2.0)  # an in-place update bumps the version
    again = fused(x)
    assert fused._kernels["weights"][1] is not cached
    assert torch.allclose(again, net(x), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(again, first)


def test_weights_that_need_grad_are_never_cached():
    net = _net()
    fused = _fused(net)
    fused(torch.randn(5, 8, dtype=torch.float64))
    assert "weights" not in fused._kernels


@pytest.mark.parametrize("make, why", [
    (lambda: _net(act=torch.tanh), "not SiLU"),
    (lambda: _net(out_act=True), "out_act"),
    (lambda: torch.nn.Linear(3, 4), "not e3nn's FullyConnectedNet"),
])
def test_other_nets_are_left_with_a_reason(make, why):
    spec, reason = spec_or_reason(make())
    assert spec is None and why in reason


def test_bad_input_shape_is_a_clear_error():
    from mace_accel.errors import InputError

    with pytest.raises(InputError, match=r"edge_feats must have shape \[n_edges, 8\]"):
        _fused(_net())(torch.randn(4, 7, dtype=torch.float64))


@pytest.mark.parametrize("fold_last", [False, True])
def test_without_tables_the_layers_run_and_the_route_tells_the_conv_what_it_gets(fold_last):
    """Off the tables (here: a CPU input) the layers run one by one; the route says whether
    the conv recomputes the TP weights and whether it is handed them or, with the last layer
    folded in, the hidden activations (no GPU needed to route)."""
    x = torch.randn(5, 8, dtype=torch.float64)
    net = _net()
    spec, _ = spec_or_reason(net)
    for recompute in ("never", "always"):
        options = AccelOptions(backend="cuda", verify=False, recompute_tp_weights=recompute)
        with torch.no_grad():
            route = FusedRadialMLP(net, spec, options, fold_last=fold_last).route(x)
        assert route.path == "layers" and route.recompute == (recompute == "always")
        assert route.full_output == (not fold_last)
