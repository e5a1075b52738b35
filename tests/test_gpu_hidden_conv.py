"""The conv forward that applies the radial MLP's last layer on the float64 tensor cores
(:mod:`mace_accel.ops.conv_tp.hidden`) on the GPU: against the reference ``conv(x, y, h @ W)``,
the kept weights against ``h @ W``, bit-identical repeats, every gradient through the op, the
recomputing fold with it, and whole models patched vs unpatched."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import random_problem

import mace_accel
from mace_accel.ops.conv_tp import autograd, hidden, reference
from mace_accel.ops.conv_tp.catalog import CATALOG
from mace_accel.ops.conv_tp.folded import folded_conv_tp
from mace_accel.ops.conv_tp.folded import forward_hidden
from mace_accel.ops.conv_tp.hidden_op import hidden_conv_tp
from mace_accel.ops.conv_tp.spec import make_e3nn_conv_tp, spec_from_e3nn
from mace_accel.tolerances import PASS_TOL, rel_norm_error

pytestmark = pytest.mark.gpu
F64 = torch.float64
NAMES = ["mp-medium-l2", "mp-small-l1", "odd-mul", "l3-feats", "mp-large-l2",
         "small-mixed-parity-l3"]


def _inputs(name, hidden_width, n_nodes=64, n_edges=1500, dtype=F64):
    spec = spec_from_e3nn(make_e3nn_conv_tp(*CATALOG[name].irreps))
    graph, x, y, _ = random_problem(spec, n_nodes, n_edges, dtype, "cuda", seed=2)
    gen = torch.Generator(device="cuda").manual_seed(3)
    h = torch.randn(n_edges, hidden_width, generator=gen, device="cuda", dtype=dtype)
    w = torch.randn(spec.weight_numel, hidden_width, generator=gen, device="cuda",
                    dtype=dtype).t()  # column-major, as the radial MLP keeps it
    key = autograd.register_spec(spec)
    prims = autograd._cuda(key, x, True)
    frag = hidden.pack(w, prims.fragment_index(hidden_width))
    return key, spec, graph, x, y, h, w, frag


def _skip_unless_supported(key, x, hidden_width):
    why = autograd._cuda(key, x, True).hidden_unsupported(hidden_width)
    if why is not None:
        pytest.skip(why)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("hidden_width", [64, 13])
@pytest.mark.parametrize("name", NAMES)
def test_forward_matches_reference_and_keeps_the_weights(name, hidden_width, dtype):
    key, spec, graph, x, y, h, w, frag = _inputs(name, hidden_width, dtype=dtype)
    _skip_unless_supported(key, x, hidden_width)
    tensors = graph.tensors("cuda")
    out, kept = forward_hidden(x, y, h, frag, tensors, graph.n_nodes, key, True, True)
    want_w = h.double() @ w.double()
    want = reference.conv_tp_forward(spec, x.double(), y.double(), want_w, graph.sender,
                                     graph.receiver, graph.n_nodes)
    assert rel_norm_error(out.double(), want) < PASS_TOL[dtype]["forward"]
    # float64: the DMMA sums; float32: 3xTF32, float32 accuracy
    assert rel_norm_error(kept.double(), want_w) < (1e-14 if dtype == F64 else 2e-6)
    again, none = forward_hidden(x, y, h, frag, tensors, graph.n_nodes, key, True, False)
    assert none is None and torch.equal(again, out)  # deterministic, with or without w kept


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("name", ["mp-medium-l2", "odd-mul"])
def test_every_gradient_matches_the_composed_reference(name, dtype):
    key, spec, graph, x, y, h, w, frag = _inputs(name, 64, dtype=dtype)
    _skip_unless_supported(key, x, 64)
    inputs = [t.detach().requires_grad_() for t in (x, y, h, w)]
    # the backward's d w W^T on the kernels that take this width, as the patch picks them
    from mace_accel.ops.dmma_gemm import autograd as dmma
    from mace_accel.ops.tf32x3_gemm import autograd as tf32x3

    gemm = ("dmma" if dmma.runs_on(h, 64, spec.weight_numel) else
            "tf32x3" if tf32x3.runs_on(h, 64, spec.weight_numel) else "cublas")
    out = hidden_conv_tp(key, graph, *inputs, frag, gemm=gemm)
    g = torch.randn_like(out)
    got = [out, *torch.autograd.grad(out, inputs, g)]
    ref = [t.detach().double().requires_grad_() for t in (x, y, h, w)]
    out_ref = reference.conv_tp(spec, ref[0], ref[1], ref[2] @ ref[3], graph.sender,
                                        graph.receiver, graph.n_nodes)
    want = [out_ref, *torch.autograd.grad(out_ref, ref, g.double())]
    for what, a, b in zip(("out", "x", "y", "h", "w"), got, want):
        tol = PASS_TOL[dtype]["forward" if what == "out" else "backward"]
        assert rel_norm_error(a.double(), b) < tol, what


def test_double_backward_composes():
    """create_graph through the op (training on forces): second derivatives as the reference."""
    key, spec, graph, x, y, h, w, frag = _inputs("tiny-gradcheck", 8, n_nodes=9, n_edges=60)
    _skip_unless_supported(key, x, 8)

    def second(run):
        xs = [t.detach().requires_grad_() for t in (x, y, h, w)]
        out = run(xs)
        gx, = torch.autograd.grad(out.square().sum(), xs[0], create_graph=True)
        return torch.autograd.grad(gx.square().sum(), xs[1:])

    got = second(lambda xs: hidden_conv_tp(key, graph, *xs, frag, gemm="dmma"))
    want = second(lambda xs: reference.conv_tp(spec, xs[0], xs[1], xs[2] @ xs[3],
                                                       graph.sender, graph.receiver,
                                                       graph.n_nodes))
    for a, b in zip(got, want):
        assert rel_norm_error(a, b) < 1e-12


def test_recomputing_fold_uses_it_in_the_forward():
    key, spec, graph, x, y, h, w, frag = _inputs("mp-medium-l2", 64)
    _skip_unless_supported(key, x, 64)
    inputs = [t.detach().requires_grad_() for t in (x, y, h, w)]
    out = folded_conv_tp(key, graph, *inputs, max_edges=97, gemm="dmma", frag=frag)
    plain = folded_conv_tp(key, graph, *inputs, max_edges=97, gemm="dmma")
    assert rel_norm_error(out, plain) < 1e-14
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, g)
    want = torch.autograd.grad(plain, inputs, g)
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # the same backward


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("recompute", ["never", "always"])
def test_model_with_the_last_layer_in_the_conv_matches_unpatched(recompute, dtype, monkeypatch):
    from test_gpu_model import _assert_matches_unpatched

    from mace_accel.models.architectures import build_architecture
    from mace_accel.patches import conv_tp as conv_patch

    from mace_accel.ops.conv_tp.cuda import CudaConvPrimitives

    monkeypatch.setattr(conv_patch, "HIDDEN_FORWARD_MIN_EDGES", 0)
    calls = []
    real = CudaConvPrimitives.forward_hidden

    def counted(self, *args):
        calls.append(args[-1])  # write_w
        return real(self, *args)

    monkeypatch.setattr(CudaConvPrimitives, "forward_hidden", counted)
    model = build_architecture("mp-medium", dtype=dtype, device="cuda")
    for p in model.parameters():  # inference: no weight gradients
        p.requires_grad_(False)
    mace_accel.accelerate(model, backend="cuda", verify=False,
                          options=mace_accel.AccelOptions(recompute_tp_weights=recompute,
                                                          last_layer_kernel=True))
    _assert_matches_unpatched(model, dtype)
    # both interaction blocks, the weights kept only where they are not recomputed
    assert calls == [recompute == "never"] * 2
