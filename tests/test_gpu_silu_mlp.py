"""The fused SiLU MLP kernels (float64, tensor cores, Hopper) on the GPU equal the plain-torch
reference: forward and d x (from the slopes the forward keeps), every catalog net, partial and
empty tiles; bit-identical repeats and block geometries; a CUDA graph replay; the kernels' input
checks."""

from __future__ import annotations

import pytest
import torch

from mace_accel.errors import KernelError
from mace_accel.ops.radial.silu_mlp import autograd
from mace_accel.ops.radial.silu_mlp.catalog import CATALOG
from mace_accel.ops.radial.silu_mlp.cuda import CudaSiluMLP
from mace_accel.ops.radial.silu_mlp.spec import pack_weights
from mace_accel.tolerances import PASS_TOL, rel_norm_error

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper():
    from gpu_helpers import skip_without_silu_mlp_kernels

    skip_without_silu_mlp_kernels()


def _inputs(spec, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, spec.widths[0], generator=gen, dtype=torch.float64) * 2
    weights = [torch.randn(a, b, generator=gen, dtype=torch.float64) * (2.0 / a) ** 0.5
               for a, b in zip(spec.widths[:-1], spec.widths[1:])]
    g = torch.randn(n, spec.widths[-1], generator=gen, dtype=torch.float64)
    return x, pack_weights(spec, weights), g


def _backward(cuda, x, w, g):
    """``d x`` by the kernels: the forward keeping the slopes, the backward from them."""
    return cuda.backward_kept(cuda.forward(x, w, keep_slopes=True)[1], w, g)


def _run(key, x, w, g, backend, device, dtype):
    xd = x.to(device, dtype).requires_grad_(True)
    out = autograd.silu_mlp(key, xd, w.to(device, dtype), backend)
    (gx,) = torch.autograd.grad(out, xd, g.to(device, dtype))
    return out.detach(), gx


@pytest.mark.parametrize("name", sorted(CATALOG))
@pytest.mark.parametrize("n", [1, 63, 2049])
def test_kernels_equal_reference(name, n):
    dtype = torch.float64
    spec = CATALOG[name]
    key = autograd.register_spec(spec)
    x, w, g = _inputs(spec, n)
    want_out, want_gx = _run(key, x, w, g, "reference", "cpu", torch.float64)
    out, gx = _run(key, x, w, g, "cuda", "cuda", dtype)
    tol = PASS_TOL[dtype]
    assert rel_norm_error(out.cpu(), want_out) < tol["forward"]
    assert rel_norm_error(gx.cpu(), want_gx) < tol["backward"]


def test_repeats_are_bit_identical_and_a_graph_replays_them():
    spec = CATALOG["mace"]
    key = autograd.register_spec(spec)
    x, w, g = (t.cuda() for t in _inputs(spec, 5000, seed=3))
    cuda = autograd._cuda(key, x)
    out, gx = cuda.forward(x, w), _backward(cuda, x, w, g)
    for _ in range(3):
        assert torch.equal(cuda.forward(x, w), out) and torch.equal(_backward(cuda, x, w, g), gx)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, gx_g = cuda.forward(x, w), _backward(cuda, x, w, g)
    x.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_g, cuda.forward(x, w)) and torch.equal(gx_g, _backward(cuda, x, w, g))


def test_empty_input_and_bad_inputs():
    spec = CATALOG["mace"]
    key = autograd.register_spec(spec)
    x, w, g = _inputs(spec, 10)
    x, w, g = x.cuda(), w.cuda(), g.cuda()
    cuda = autograd._cuda(key, x)
    assert cuda.forward(x[:0], w).shape == (0, 64)
    assert _backward(cuda, x[:0], w, g[:0]).shape == (0, 8)
    with pytest.raises(KernelError, match="expected torch.float64"):
        cuda.forward(x.float(), w)
    with pytest.raises(KernelError, match="float64, got float32"):
        CudaSiluMLP(spec, torch.float32, x.device)
    with pytest.raises(KernelError, match="contiguous"):
        cuda.forward(torch.cat([x, x], 1)[:, ::2], w)
    with pytest.raises(KernelError, match="shape"):
        cuda.forward(x, w[1:])
    with pytest.raises(KernelError, match="16-byte"):
        cuda.forward(x, torch.cat([w[:1], w])[1:])
    slopes = cuda.forward(x, w, keep_slopes=True)[1]
    with pytest.raises(KernelError, match="grad"):
        cuda.backward_kept(slopes, w, g[:, :10].contiguous())
    with pytest.raises(KernelError, match="slopes"):
        cuda.backward_kept(slopes[1:], w, g)


def test_block_geometries_are_bit_identical_and_a_misaligned_start_is_copied():
    for name in ("mace", "odd", "deep"):
        spec = CATALOG[name]
        key = autograd.register_spec(spec)
        x, w, g = (t.cuda() for t in _inputs(spec, 3001, seed=5))
        cuda = autograd._cuda(key, x)
        out, gx = cuda.forward(x, w), _backward(cuda, x, w, g)
        # another block geometry computes every row the same way: bit-identical
        four = CudaSiluMLP(spec, torch.float64, x.device,
                           variant={"warps": 4, "forward_warps": 12, "unroll": 1})
        assert torch.equal(four.forward(x, w), out) and torch.equal(_backward(four, x, w, g), gx)
        # a start that is not 16-byte aligned is copied, not misread
        xs = torch.cat([x.new_zeros(1), x.reshape(-1)])[1:].view_as(x)
        assert xs.data_ptr() % 16 and torch.equal(cuda.forward(xs, w), out)


def test_the_forward_keeping_slopes_and_the_backward_from_them():
    """The kernels called directly (autograd's keep op takes them as test_kernels_equal_reference
    checks): keeping the slopes leaves the output as it is, d x equals the reference's."""
    for name in ("mace", "odd", "deep", "one_layer"):
        spec = CATALOG[name]
        key = autograd.register_spec(spec)
        cuda = CudaSiluMLP(spec, torch.float64, torch.device("cuda"))
        for n in (1, 17, 4099):
            x, w, g = _inputs(spec, n, seed=n)
            want_gx = _run(key, x, w, g, "reference", "cpu", torch.float64)[1]
            x, w, g = x.cuda(), w.cuda(), g.cuda()
            out, slopes = cuda.forward(x, w, keep_slopes=True)
            assert torch.equal(out, cuda.forward(x, w))
            gx = cuda.backward_kept(slopes, w, g)
            assert rel_norm_error(gx.cpu(), want_gx) < PASS_TOL[torch.float64]["backward"]
