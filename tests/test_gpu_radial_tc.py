"""The whole-radial-MLP kernels on the GPU: every catalog spec against float64 (output and
pre-activations; through the radial MLP, ``d x``: on sm_90 the wgmma backward kernel, elsewhere
the 3xTF32 layer kernels), as accurate as the layer-by-layer float32 path; weight gradients
(training) on the layer kernels; bit-identical repeats; capture in a CUDA graph;
the checks before launch. Whole models on it: tests/test_gpu_model.py (float32 takes this path
by default)."""

from __future__ import annotations

import pytest
import torch

from mace_accel.bench.timing import capture_graph
from mace_accel.errors import KernelError
from mace_accel.ops.radial import mlp as radial_mlp
from mace_accel.ops.radial.tc import apply, codegen, wgmma, wgmma_backward
from mace_accel.ops.radial.tc.cuda import CudaRadialMLP
from mace_accel.tolerances import PASS_TOL, rel_linf_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _problem(name: str, rows: int, seed: int = 0):
    spec = codegen.CATALOG[name]
    gen = torch.Generator().manual_seed(seed)
    w = spec.widths
    weights = [torch.randn(w[i], w[i + 1], generator=gen, dtype=torch.float64) / w[i] ** 0.5
               for i in range(len(w) - 1)]
    x = torch.randn(rows, w[0], generator=gen, dtype=torch.float64)
    g = torch.randn(rows, w[-1], generator=gen, dtype=torch.float64)
    return spec, weights, x, g


def _whole(spec, weights):
    w32 = [w.float().cuda() for w in weights]
    key = apply.register_spec(spec)
    return w32, radial_mlp.WholeNet(key, apply.pack_weights(key, w32))


@pytest.mark.parametrize("rows", [1, 37, 20000])
@pytest.mark.parametrize("name", sorted(codegen.CATALOG))
def test_forward_and_backward_against_float64(name, rows):
    spec, weights, x, g = _problem(name, rows)
    x64 = x.clone().requires_grad_(True)
    pre64, ref = radial_mlp.pre_activations(x64, weights)
    (gref,) = torch.autograd.grad(ref, x64, g)
    w32, whole = _whole(spec, weights)
    out, z = apply.forward(whole.key, x.float().cuda(), whole.packed)
    pre = apply.pre_views(whole.key, z)
    assert len(pre) == len(pre64)
    for z, z64 in zip(pre, pre64):
        assert rel_linf_error(z.cpu(), z64) < PASS_TOL[torch.float32]["forward"]
    xc = x.float().cuda().requires_grad_(True)
    ours = radial_mlp.radial_mlp(xc, w32, tf32x3=True, whole=whole)
    assert torch.equal(ours.detach(), out)
    (gx,) = torch.autograd.grad(ours, xc, g.float().cuda())
    # the float32 GEMM path on the same inputs, as the bar
    xl = x.float().cuda().requires_grad_(True)
    lay = radial_mlp.radial_mlp(xl, w32)
    (gl,) = torch.autograd.grad(lay, xl, g.float().cuda())
    for a, bar, exact, pass_ in ((out, lay, ref, "forward"), (gx, gl, gref, "backward")):
        err, bar_err = rel_linf_error(a.cpu(), exact), rel_linf_error(bar.cpu(), exact)
        assert err < max(16 * bar_err, 1e-6) and err < PASS_TOL[torch.float32][pass_], \
            (pass_, err, bar_err)


@pytest.mark.parametrize("variant", [("mma", None), ("wgmma", None)]
                         + [("wgmma", v) for v in wgmma.TESTED_VARIANTS])
@pytest.mark.parametrize("rows", [1, 100, 20000])
@pytest.mark.parametrize("name", sorted(codegen.CATALOG))
def test_both_kernel_designs_against_float64(name, rows, variant):
    """The mma.sync kernel (every sm_80+ GPU) and the wgmma kernel (sm_90: the one that runs
    here) in each of their variants, output and pre-activations, against float64."""
    if variant[0] == "wgmma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs sm_90")
    spec, weights, x, _ = _problem(name, rows, seed=2)
    kernel = CudaRadialMLP(spec, torch.device("cuda"), layout=variant[0], variant=variant[1])
    out, z = kernel.forward(x.float().cuda(), kernel.pack(weights))
    pre64, ref = radial_mlp.pre_activations(x, weights)
    assert rel_linf_error(out.cpu(), ref) < 2e-6
    for i, p in enumerate(pre64):
        assert rel_linf_error(z[i, :, :p.shape[1]].cpu(), p) < 2e-6


def _needs_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs sm_90")


@pytest.mark.parametrize("variant",
                         [wgmma_backward.DEFAULT_VARIANT, *wgmma_backward.TESTED_VARIANTS])
@pytest.mark.parametrize("rows", [1, 100, 20000])
@pytest.mark.parametrize("name", sorted(codegen.CATALOG))
def test_backward_kernel_against_float64(name, rows, variant):
    """The wgmma backward kernel's ``d x`` in each variant against float64, as accurate as
    float32 GEMMs (cuBLAS, no TF32) on the same inputs; a share of the GPU changes no bit."""
    _needs_sm90()
    spec, weights, x, g = _problem(name, rows, seed=3)
    kernel = CudaRadialMLP(spec, torch.device("cuda"), layout="wgmma", backward_variant=variant)
    packed = kernel.pack(weights)
    _, z = kernel.forward(x.float().cuda(), packed)
    dx = kernel.backward(g.float().cuda(), z, packed)
    x64 = x.clone().requires_grad_(True)
    (gref,) = torch.autograd.grad(radial_mlp.reference(x64, weights), x64, g)
    xl = x.float().cuda().requires_grad_(True)
    (gl,) = torch.autograd.grad(radial_mlp.reference(xl, [w.float().cuda() for w in weights]),
                                xl, g.float().cuda())
    err, bar = rel_linf_error(dx.cpu(), gref), rel_linf_error(gl.cpu(), gref)
    assert err < max(4 * bar, 2e-6), (err, bar)
    assert torch.equal(kernel.backward(g.float().cuda(), z, packed, sm_share=0.1), dx)


def test_weight_gradients_take_the_layer_kernels():
    """With a weight gradient asked for (training), the whole-net forward's backward runs on
    the layer kernels and gives every gradient, as the plain float32 path does."""
    spec, weights, x, g = _problem("mp_l1", 300, seed=4)
    w32, whole = _whole(spec, weights)
    ws = [w.clone().requires_grad_(True) for w in w32]
    xc = x.float().cuda().requires_grad_(True)
    ours = torch.autograd.grad(radial_mlp.radial_mlp(xc, ws, tf32x3=True, whole=whole),
                               [xc, *ws], g.float().cuda())
    xr = x.float().cuda().requires_grad_(True)
    wr = [w.clone().requires_grad_(True) for w in w32]
    ref = torch.autograd.grad(radial_mlp.reference(xr, wr), [xr, *wr], g.float().cuda())
    for a, b in zip(ours, ref):
        assert rel_linf_error(a.cpu(), b.cpu().double()) < 1e-5


def test_backward_checks_before_launch():
    _needs_sm90()
    spec, weights, x, g = _problem("ragged", 8)
    kernel = CudaRadialMLP(spec, torch.device("cuda"), layout="wgmma")
    packed = kernel.pack(weights)
    _, z = kernel.forward(x.float().cuda(), packed)
    gc = g.float().cuda()
    with pytest.raises(KernelError):
        kernel.backward(g.cuda(), z, packed)  # float64 gradient
    with pytest.raises(KernelError):
        kernel.backward(gc[:4], z, packed)  # rows differ from z's
    with pytest.raises(KernelError):
        kernel.backward(gc, z, packed[:-4])  # wrong packed size
    mma = CudaRadialMLP(spec, torch.device("cuda"), layout="mma")
    assert not mma.has_backward
    with pytest.raises(KernelError, match="no backward kernel"):
        mma.backward(gc, z, mma.pack(weights))


def test_repeats_are_bit_identical_and_capture_in_a_graph():
    spec, weights, x, g = _problem("mp_l2", 5000, seed=1)
    w32, whole = _whole(spec, weights)
    xc, gc = x.float().cuda(), g.float().cuda()

    def call():
        xr = xc.clone().requires_grad_(True)
        out = radial_mlp.radial_mlp(xr, w32, tf32x3=True, whole=whole)
        return out.detach(), torch.autograd.grad(out, xr, gc)[0]

    first, second = call(), call()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    graph, out = capture_graph(call)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, first))


def test_checks_before_launch():
    spec, weights, x, _ = _problem("ragged", 8)
    _, whole = _whole(spec, weights)
    key, packed = whole.key, whole.packed
    with pytest.raises(KernelError):
        apply.forward(key, x.cuda(), packed)  # float64 input
    with pytest.raises(KernelError):
        apply.forward(key, x.float().cuda(), packed[:-4])  # wrong packed size


def test_rows_past_the_int32_offset_of_the_widest_output():
    """So many edges that the TP weights' offsets pass 2^31 (MACE-MP-large at 6,912 atoms has
    539k edges of 1,792): the kernels index rows in int32 and offsets in 64 bits. The rows
    before, around and after that offset, forward and ``d x`` (3xTF32 GEMMs), against float64."""
    from mace_accel.ops.runtime import INT32_MAX

    if torch.cuda.mem_get_info()[0] < 40 * 2**30:
        pytest.skip("needs 40 GiB of free GPU memory")
    spec, weights, _, _ = _problem("mp_l2", 1)
    width = spec.widths[-1]
    edge = INT32_MAX // width  # the first row whose offset passes 2^31
    rows = edge + 4096
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, spec.widths[0], device="cuda", generator=gen)
    g = torch.randn(rows, width, device="cuda", generator=gen)
    w32, whole = _whole(spec, weights)
    xc = x.clone().requires_grad_(True)
    out = radial_mlp.radial_mlp(xc, w32, tf32x3=True, whole=whole)
    (gx,) = torch.autograd.grad(out, xc, g)
    pick = torch.cat([torch.arange(64), torch.arange(edge - 64, edge + 64),
                      torch.arange(rows - 64, rows)]).cuda()
    x64 = x[pick].double().cpu().requires_grad_(True)
    _, ref = radial_mlp.pre_activations(x64, weights)
    (gref,) = torch.autograd.grad(ref, x64, g[pick].double().cpu())
    assert rel_linf_error(out[pick].detach().cpu(), ref) < PASS_TOL[torch.float32]["forward"]
    assert rel_linf_error(gx[pick].cpu(), gref) < PASS_TOL[torch.float32]["backward"]
