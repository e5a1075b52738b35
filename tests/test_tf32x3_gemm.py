"""The 3xTF32 GEMM family on the CPU: specs, tile plans, sources, and the autograd of its two
ops with the kernel stood in for by torch (gradcheck, double backward), as the radial MLP and
the folded convolution call them."""

from __future__ import annotations

import pytest
import torch

from mace_accel.ops.tf32x3_gemm import autograd, codegen
from mace_accel.ops.tf32x3_gemm.spec import GemmSpec, unsupported_reason
from mace_accel.options import AccelOptions


@pytest.fixture
def torch_kernels(monkeypatch):
    """The kernels replaced by the product they compute (any dtype and device)."""
    calls = []

    def gemm(a, b, k, n, layout):
        calls.append((k, n, layout))
        assert a.shape[1] == k and b.is_contiguous() and a.is_contiguous()
        return a @ (b.t() if layout == "nk" else b)

    def mm_silu(h, w):
        calls.append("silu")
        z = h @ w
        return z, torch.nn.functional.silu(z)

    def mm_t_silu_grad(g, w, z):
        calls.append("silu_grad")
        s = torch.sigmoid(z)
        return (g @ w.t()) * s * (1 + z * (1 - s))

    monkeypatch.setattr(autograd, "_gemm", gemm)
    monkeypatch.setattr(autograd, "mm_silu", mm_silu)
    monkeypatch.setattr(autograd, "mm_t_silu_grad", mm_t_silu_grad)
    return calls


def test_spec_needs_widths_in_whole_16_byte_chunks():
    assert GemmSpec(64, 1280, "nk").key() == "k64_n1280_nk"
    with pytest.raises(ValueError, match="multiples of 4"):
        GemmSpec(62, 1280, "nk")
    with pytest.raises(ValueError, match="b_layout"):
        GemmSpec(64, 1280, "kk")
    assert unsupported_reason(64, 30) is not None and unsupported_reason(8, 4) is None


@pytest.mark.parametrize("name", sorted(codegen.CATALOG))
def test_plans_tile_into_warps_and_fit_static_shared_memory(name):
    spec = codegen.CATALOG[name]
    plan = codegen.plan_kernel(spec)
    assert plan.bm == 16 * plan.mi * plan.warps_m and plan.bn == 8 * plan.ni * plan.warps_n
    assert plan.shared_bytes <= codegen.STATIC_SHARED
    assert plan.threads == 32 * plan.warps_m * plan.warps_n
    assert (plan.bn == 128) == (spec.n >= codegen.WIDE_FROM)
    rows, cols = plan.grid(20001)
    assert (rows - 1) * plan.bm < 20001 <= rows * plan.bm and cols * plan.bn >= spec.n
    src = codegen.render_kernel(plan)
    assert codegen.kernel_name(plan) in src and f"gemm_tile<{spec.k}, {spec.n}>" in src
    assert ("Bs[s][kk + t][c]" in src) == (spec.b_layout == "kn")
    assert ("expf" in src) == (spec.epilogue != "none")


def test_geometry_that_does_not_fit_is_refused():
    spec = GemmSpec(64, 1280, "nk")
    with pytest.raises(ValueError, match="shared memory"):
        codegen.plan_kernel(spec, geometry=(128, 128, 32, 4, 4, 3))
    with pytest.raises(ValueError, match="warps"):
        codegen.plan_kernel(spec, geometry=(48, 128, 16, 2, 4, 3))


def test_ops_and_their_gradients(torch_kernels):
    h = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 12, dtype=torch.float64).t().contiguous().t().requires_grad_(True)
    assert torch.allclose(autograd.linear(h, w), h @ w)
    assert torch.autograd.gradcheck(autograd.linear, (h, w))
    assert torch.autograd.gradgradcheck(autograd.linear, (h, w))
    assert (8, 12, "nk") in torch_kernels and (12, 8, "kn") in torch_kernels
    g = torch.randn(7, 12, dtype=torch.float64)
    assert torch.allclose(autograd.mm(h.detach(), w.detach()), h @ w)
    assert torch.allclose(autograd.mm_t(g, w.detach()), g @ w.t())


def test_inference_backward_keeps_no_activation(torch_kernels):
    """With the weight frozen, the backward needs only the weight: ``h`` is not saved."""
    h = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 4, dtype=torch.float64)
    out = autograd.linear(h, w)
    saved = [t for t in out.grad_fn.saved_tensors if t is not None]
    assert len(saved) == 1 and saved[0].shape == (4, 8)


def test_runs_on_needs_cuda_float32_and_supported_widths():
    assert not autograd.runs_on(torch.zeros(1), 64, 1280)  # CPU


def test_radial_mlp_last_layer_through_the_ops(torch_kernels, monkeypatch):
    """The radial MLP's last layer on the (stood-in) kernels equals e3nn's net, with the input
    gradient and double backward; cuBLAS is named in the report where the kernels are off."""
    from test_radial_mlp import _net

    from mace_accel.patches.radial import mlp as patch
    from mace_accel.patches.radial.mlp import FusedRadialMLP, spec_or_reason

    monkeypatch.setattr(autograd, "runs_on", lambda t, k, n: True)
    net = _net(hs=(8, 16, 16, 12))
    spec, _ = spec_or_reason(net)
    fused = FusedRadialMLP(net, spec, AccelOptions(backend="cuda", verify=False))
    assert "3xTF32" in fused.describe()
    x = torch.randn(30, 8, dtype=torch.float64, requires_grad=True)
    ref, out = net(x), fused(x)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ref)
    # inference (no create_graph): the hidden layers' backward on the fused kernels too
    (gx_first,) = torch.autograd.grad(fused(x), x, g)
    assert torch.allclose(gx_first, torch.autograd.grad(net(x), x, g)[0], rtol=1e-11,
                          atol=1e-12)
    assert torch_kernels.count("silu") >= 2 and "silu_grad" in torch_kernels
    assert (16, 12, "nk") in torch_kernels  # the last layer
    (gx_ref,) = torch.autograd.grad(ref, x, g, create_graph=True)
    (gx,) = torch.autograd.grad(out, x, g, create_graph=True)
    assert torch.allclose(gx, gx_ref, rtol=1e-11, atol=1e-12)
    params = list(net.parameters())
    dd_ref = torch.autograd.grad(gx_ref.square().sum(), params)
    dd = torch.autograd.grad(gx.square().sum(), list(fused.parameters()))
    for a, b in zip(dd, dd_ref):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    monkeypatch.setattr(patch, "_TF32X3", False)
    assert "cuBLAS" in fused.describe() and "3xTF32" not in fused.describe()


def test_opcheck_schema_fake_and_autograd_registration(torch_kernels):
    h = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    wt = torch.randn(12, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(6, 12, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(autograd.mm_op.op, (h, wt, True))
    torch.library.opcheck(autograd.mm_op.op, (g, wt, False))
