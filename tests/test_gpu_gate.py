"""The non-linear block's division, residual and gate in one kernel each way
(mace_accel.ops.gate) on the GPU: against the float64 torch reference forward and backward (all
three gradients), with the residual whole or its leading columns only (MH-1's linear_res feeds
2,048 and 3,584 of 9,728), the double backward through the reference, a repeat in a CUDA graph,
checks before launch."""

from __future__ import annotations

import pytest
import torch

from mace_accel.bench.timing import capture_graph
from mace_accel.errors import KernelError
from mace_accel.ops import gate as gate_ops

pytestmark = pytest.mark.gpu

SPEC = gate_ops.MH1_GATE
# gates in another order than their groups; gates without an activation
SMALL = gate_ops.GateSpec(8, 64, (gate_ops.GatedGroup(24, 4, 5, 16, 8),
                                  gate_ops.GatedGroup(44, 8, 1, 8, 28),
                                  gate_ops.GatedGroup(52, 4, 3, 20, 36)),
                          "silu", 1.7, "none", 1.0)


def _inputs(spec, n, dtype, seed=0, res_cols=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, spec.d_in, generator=gen, dtype=torch.float64)
    res = torch.randn(n, spec.d_in if res_cols is None else res_cols, generator=gen,
                      dtype=torch.float64)
    d = torch.rand(n, 1, generator=gen, dtype=torch.float64) * 20 + 0.5
    g = torch.randn(n, spec.d_out, generator=gen, dtype=torch.float64)
    return [t.to(dtype).cuda().requires_grad_(i < 3) for i, t in enumerate((x, d, res, g))]


def _err(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


# (spec, residual width): whole; MH-1's fed columns in its two blocks; a width that ends
# inside a gated group's channels, one that ends after the scalars, none
WIDTHS = [(SPEC, None), (SPEC, 2048), (SPEC, 3584), (SMALL, None), (SMALL, 30), (SMALL, 8),
          (SMALL, 0)]


@pytest.mark.parametrize("spec,res_cols", WIDTHS,
                         ids=[f"{'mh1' if s is SPEC else 'small'}-{w}" for s, w in WIDTHS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_and_gradients_match_the_reference(spec, res_cols, dtype):
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    x, d, res, g = _inputs(spec, 300, dtype, res_cols=res_cols)
    y = gate_ops.gate_residual(spec, x, d, res)
    grads = torch.autograd.grad(y, (x, d, res), g)
    x64, d64, res64 = (t.detach().double().requires_grad_() for t in (x, d, res))
    want = gate_ops.reference(spec, x64, d64, res64)
    want_grads = torch.autograd.grad(want, (x64, d64, res64), g.double())
    assert _err(y, want) < tol
    for got, ref in zip(grads, want_grads):
        assert got.shape == ref.shape
        assert ref.numel() == 0 or _err(got, ref) < tol


def test_double_backward_follows_the_reference():
    x, d, res, g = _inputs(SMALL, 40, torch.float64, seed=2, res_cols=30)
    y = gate_ops.gate_residual(SMALL, x, d, res)
    gx, gd, gres = torch.autograd.grad(y, (x, d, res), g, create_graph=True)
    hx = torch.autograd.grad((gx.square().sum() + gd.sum() + gres.sum()), x)[0]
    y2 = gate_ops.reference(SMALL, x, d, res)
    gx2, gd2, gres2 = torch.autograd.grad(y2, (x, d, res), g, create_graph=True)
    hx2 = torch.autograd.grad((gx2.square().sum() + gd2.sum() + gres2.sum()), x)[0]
    assert torch.allclose(hx, hx2, rtol=1e-10, atol=1e-12)


def test_same_bits_in_a_cuda_graph():
    x, d, res, _ = (t.detach() for t in _inputs(SPEC, 128, torch.float32, seed=3))
    kernels = gate_ops.kernels(SPEC, torch.float32, x.device)
    y, q = kernels.forward(x, d, res)
    g = torch.randn_like(y)
    grads = kernels.backward(g, q, res, d)
    outs = {}

    def step():
        outs["y"], outs["q"] = kernels.forward(x, d, res)
        outs["grads"] = kernels.backward(g, outs["q"], res, d)

    graph, _ = capture_graph(step)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(outs["y"], y) and all(torch.equal(a, b)
                                             for a, b in zip(outs["grads"], grads))


def test_kernels_refuse_wrong_shapes():
    x, d, res, _ = (t.detach() for t in _inputs(SMALL, 5, torch.float32))
    kernels = gate_ops.kernels(SMALL, torch.float32, x.device)
    with pytest.raises(KernelError, match="shape"):
        kernels.forward(x[:, :-1].contiguous(), d, res)
    with pytest.raises(KernelError, match="float32"):
        kernels.forward(x, d.double(), res)
    with pytest.raises(KernelError, match="r <= 64"):
        kernels.forward(x, d, torch.cat([res, res[:, :1]], dim=1))
    with pytest.raises(KernelError, match="shape"):
        kernels.forward(x, d, res[1:].contiguous())
