"""The autograd composition of the conv custom ops (what the CUDA backend runs) on the reference.

``ops.conv_tp(key, graph, ..., backend="reference")`` differentiates through the explicit
backward op and composes double backward from it; plain autograd through ``reference.conv_tp``
(einsum + index_add) is the independent oracle.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd.gradcheck import GradcheckError

from mace_accel.ops.conv_tp import autograd as ops
from mace_accel.ops.conv_tp import reference
from mace_accel.ops.conv_tp.catalog import CATALOG, select
from mace_accel.ops.conv_tp.spec import make_spec
from mace_accel.ops.graph import graph_from_edge_index
from mace_accel.tolerances import PASS_TOL, rel_norm_error

F64 = torch.float64
TOL = PASS_TOL[F64]

CASES = ("small-mace-l2", "small-mixed-parity-l3")
_SPECS: dict = {}


def spec_of(case: str):
    if case not in _SPECS:
        _SPECS[case] = make_spec(*CATALOG[case].irreps)
    return _SPECS[case]


def problem(spec, n_nodes: int = 6, n_edges: int = 17, seed: int = 0):
    """Inputs ``(x, y, w)``, an upstream gradient and the graph; node 0 sends nothing."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_nodes, spec.dim_in1, generator=g, dtype=F64)
    y = torch.randn(n_edges, spec.dim_in2, generator=g, dtype=F64)
    w = torch.randn(n_edges, spec.weight_numel, generator=g, dtype=F64)
    edge_index = torch.stack([torch.randint(1, n_nodes, (n_edges,), generator=g),
                              torch.randint(0, n_nodes, (n_edges,), generator=g)])
    grad_out = torch.randn(n_nodes, spec.dim_out, generator=g, dtype=F64)
    return x, y, w, grad_out, edge_index


def fused(spec, graph):
    key = ops.register_spec(spec)
    return lambda x, y, w: ops.conv_tp(key, graph, x, y, w, backend="reference")


def plain(spec, graph):
    return lambda x, y, w: reference.conv_tp(spec, x, y, w, graph.sender, graph.receiver,
                                             graph.n_nodes)


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("case", sorted(p.name for p in select("cpu")))  # every small problem
def test_forward_and_backward_match_plain_autograd(case):
    spec = spec_of(case)
    x, y, w, grad_out, edge_index = problem(spec)
    graph = graph_from_edge_index(edge_index, x.shape[0])
    results = {}
    for name, conv in (("fused", fused(spec, graph)), ("plain", plain(spec, graph))):
        inputs = leaves(x, y, w)
        out = conv(*inputs)
        results[name] = (out.detach(), torch.autograd.grad(out, inputs, grad_out))
    (out_f, grads_f), (out_p, grads_p) = results["fused"], results["plain"]
    assert out_p.norm() > 0
    assert rel_norm_error(out_f, out_p) <= TOL["forward"]
    for what, a, b in zip(("node_feats", "edge_attrs", "tp_weights"), grads_f, grads_p):
        assert b.norm() > 0, what
        assert rel_norm_error(a, b) <= TOL["backward"], what
    assert torch.all(grads_f[0][0] == 0)  # node 0 sends nothing: no gradient


@pytest.mark.parametrize("case", sorted(CASES))
def test_backward_of_a_subset_of_inputs(case):
    spec = spec_of(case)
    x, y, w, grad_out, edge_index = problem(spec, seed=1)
    graph = graph_from_edge_index(edge_index, x.shape[0])
    for mask in ((True, False, False), (False, True, True), (False, False, True)):
        ins_f = [t.detach().clone().requires_grad_(m) for t, m in zip((x, y, w), mask)]
        ins_p = [t.detach().clone().requires_grad_(m) for t, m in zip((x, y, w), mask)]
        want_f = [t for t in ins_f if t.requires_grad]
        want_p = [t for t in ins_p if t.requires_grad]
        got = torch.autograd.grad(fused(spec, graph)(*ins_f), want_f, grad_out)
        expected = torch.autograd.grad(plain(spec, graph)(*ins_p), want_p, grad_out)
        for a, b in zip(got, expected):
            assert rel_norm_error(a, b) <= TOL["backward"], mask


def _double_backward(conv, x, y, w, upstream, probes):
    """Gradients of ``s = <probes, first gradients> + |gx|^2 * |gw|`` w.r.t. x, y, w, upstream.

    The product term mixes the derivatives (second derivatives across different inputs and
    the upstream gradient), so every branch of the double backward contributes.
    """
    x, y, w, upstream = leaves(x, y, w, upstream)
    out = conv(x, y, w)
    gx, gy, gw = torch.autograd.grad(out, (x, y, w), upstream, create_graph=True)
    px, py, pw = probes
    s = (gx * px).sum() + (gy * py).sum() + (gw * pw).sum() + gx.pow(2).sum() * gw.norm()
    return torch.autograd.grad(s, (x, y, w, upstream))


@pytest.mark.parametrize("case", sorted(CASES))
def test_double_backward_matches_plain_autograd(case):
    spec = spec_of(case)
    x, y, w, grad_out, edge_index = problem(spec, seed=2)
    graph = graph_from_edge_index(edge_index, x.shape[0])
    g = torch.Generator().manual_seed(3)
    probes = [torch.randn(t.shape, generator=g, dtype=F64) for t in (x, y, w)]
    got = _double_backward(fused(spec, graph), x, y, w, grad_out, probes)
    expected = _double_backward(plain(spec, graph), x, y, w, grad_out, probes)
    for what, a, b in zip(("node_feats", "edge_attrs", "tp_weights", "grad_out"), got, expected):
        assert b.norm() > 0, what
        assert rel_norm_error(a, b) <= TOL["double_backward"], what


def test_forces_style_double_backward():
    """MACE's pattern: forces = -dE/dpositions with create_graph, then a loss on the forces.

    Here edge_attrs play the positions' role: d/dw of |dE/dy|^2 is what training differentiates.
    """
    spec = spec_of("small-mace-l2")
    x, y, w, _, edge_index = problem(spec, seed=4)
    graph = graph_from_edge_index(edge_index, x.shape[0])
    readout = torch.randn(spec.dim_out, dtype=F64, generator=torch.Generator().manual_seed(5))
    grads = {}
    for name, conv in (("fused", fused(spec, graph)), ("plain", plain(spec, graph))):
        xl, yl, wl = leaves(x, y, w)
        energy = (torch.tanh(conv(xl, yl, wl)) @ readout).sum()
        (force,) = torch.autograd.grad(energy, yl, create_graph=True)
        grads[name] = torch.autograd.grad(force.pow(2).sum(), (xl, wl))
    for a, b in zip(grads["fused"], grads["plain"]):
        assert b.norm() > 0
        assert rel_norm_error(a, b) <= TOL["double_backward"]


def test_gradcheck_and_gradgradcheck():
    spec = spec_of("tiny-gradcheck")
    x, y, w, _, edge_index = problem(spec, n_nodes=3, n_edges=5, seed=6)
    graph = graph_from_edge_index(edge_index, x.shape[0])
    conv = fused(spec, graph)
    inputs = tuple(leaves(x, y, w))
    assert torch.autograd.gradcheck(conv, inputs, eps=1e-6, atol=1e-8, rtol=1e-6,
                                    fast_mode=True)
    assert torch.autograd.gradgradcheck(conv, inputs, eps=1e-6, atol=1e-8, rtol=1e-6,
                                        fast_mode=True)


def test_gradcheck_catches_a_wrong_backward(monkeypatch):
    """The oracle has teeth: a backward primitive off by a factor fails gradcheck (in the fast
    mode the check above uses: a random projection of the Jacobian)."""
    spec = spec_of("tiny-gradcheck")
    x, y, w, _, edge_index = problem(spec, n_nodes=3, n_edges=5, seed=6)
    graph = graph_from_edge_index(edge_index, x.shape[0])
    exact = reference.conv_tp_backward

    def broken(*args, **kwargs):
        gx, gy, gw = exact(*args, **kwargs)
        return gx, (None if gy is None else 1.01 * gy), gw

    monkeypatch.setattr(reference, "conv_tp_backward", broken)
    with pytest.raises(GradcheckError):
        torch.autograd.gradcheck(fused(spec, graph), tuple(leaves(x, y, w)), eps=1e-6,
                                 atol=1e-8, rtol=1e-6, fast_mode=True)
