"""The float64 tensor-core GEMM kernel on the GPU (sm_90): equal to a float64 product to
rounding for every catalog shape, ragged row counts and another geometry, gradients and double
backward through the op, bit-identical repeats, CUDA-graph capture, checks before launch, and
the folded conv on it."""

from __future__ import annotations

import pytest
import torch

from mace_accel.bench.timing import capture_graph
from mace_accel.errors import KernelError
from mace_accel.ops.radial.dmma_gemm import autograd, codegen
from mace_accel.ops.radial.dmma_gemm.cuda import CudaDmmaGemm
from mace_accel.ops.radial.dmma_gemm.spec import pack

pytestmark = pytest.mark.gpu


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="the DMMA GEMM kernel is sm_90's")


def _operands(spec, m, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.nn.functional.silu(torch.randn(m, spec.narrow, generator=gen,
                                             dtype=torch.float64) * 2)
    w = torch.randn(spec.narrow, spec.wide, generator=gen, dtype=torch.float64) / spec.narrow ** 0.5
    return h.cuda(), w.cuda()


def _close(a, b, scale):
    # float64 products of K <= 1792 terms: rounding ~1e-15 relative; a wrong fragment is O(1)
    assert a.shape == b.shape
    assert float((a - b).abs().max()) <= 1e-12 * scale, float((a - b).abs().max())


@needs_sm90
@pytest.mark.parametrize("name", sorted(codegen.CATALOG))
@pytest.mark.parametrize("m", [1, 37, 300, 70001])
def test_forward_equals_float64_products(name, m):
    spec = codegen.CATALOG[name]
    h, w = _operands(spec, m)
    kernels = CudaDmmaGemm(spec, h.device)
    packed = pack(spec, w)
    _close(kernels.forward(h, packed), h @ w, 1.0)


@needs_sm90
@pytest.mark.parametrize("name", ["mp_l2", "ragged"])
def test_another_geometry_gives_the_same_bits(name):
    spec = codegen.CATALOG[name]
    h, w = _operands(spec, 5003, seed=1)
    packed = pack(spec, w)
    default = CudaDmmaGemm(spec, h.device)
    other = CudaDmmaGemm(spec, h.device, codegen.TESTED_GEOMETRY)
    assert torch.equal(default.forward(h, packed), other.forward(h, packed))


@needs_sm90
def test_repeats_are_bit_identical_and_graphs_capture():
    spec = codegen.CATALOG["mp_l1"]
    h, w = _operands(spec, 20000, seed=2)
    packed = autograd.pack_weight(w)
    first = autograd.mm(h, packed, w)
    assert torch.equal(first, autograd.mm(h, packed, w))
    graph, fwd = capture_graph(lambda: autograd.mm(h, packed, w))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(fwd, first)


@needs_sm90
def test_gradients_and_double_backward():
    spec = codegen.CATALOG["ragged"]
    h, w = _operands(spec, 400, seed=3)
    packed = autograd.pack_weight(w)
    x = h.clone().requires_grad_()
    ref = h.clone().requires_grad_()
    grads = []
    for t, f in ((x, lambda t: autograd.linear(t, packed, w)),
                 (ref, lambda t: t @ w)):
        out = f(t)
        v = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device)
        (gt,) = torch.autograd.grad((out ** 2 * v.view(out.shape)).sum(), t, create_graph=True)
        (ggt,) = torch.autograd.grad((gt * torch.cos(t)).sum(), t)  # through the backward op
        grads.append((gt.detach(), ggt))
    for a, b in zip(*grads):
        _close(a, b, float(b.abs().max()) + 1.0)
    assert torch.autograd.gradcheck(
        lambda t: autograd.linear(t, packed, w),
        (h[:20].clone().requires_grad_(),), eps=1e-6, atol=1e-8)


@needs_sm90
def test_bad_inputs_are_refused_before_launch():
    spec = codegen.CATALOG["small"]
    h, w = _operands(spec, 64)
    kernels = CudaDmmaGemm(spec, h.device)
    packed = pack(spec, w)
    with pytest.raises(KernelError, match="float64"):
        kernels.forward(h.float(), packed)
    with pytest.raises(KernelError, match="shape"):
        kernels.forward(h[:, :-1].contiguous(), packed)
    with pytest.raises(KernelError, match="contiguous"):
        kernels.forward(torch.randn(spec.narrow, 64, dtype=torch.float64, device="cuda").t(),
                        packed)
    with pytest.raises(KernelError, match="16-byte"):
        kernels.forward(torch.zeros(64 * spec.narrow + 1, dtype=torch.float64,
                                    device="cuda")[1:].view(64, spec.narrow), packed)
    with pytest.raises(KernelError, match="shape"):
        kernels.forward(h, packed[:-2])
    assert kernels.forward(h[:0], packed).shape == (0, spec.wide)


@needs_sm90
def test_folded_conv_on_the_kernels_matches_cublas():
    from gpu_helpers import random_problem

    from mace_accel.ops.conv_tp import autograd as conv_autograd
    from mace_accel.ops.conv_tp.catalog import CATALOG
    from mace_accel.ops.conv_tp.folded import folded_conv_tp
    from mace_accel.ops.conv_tp.spec import make_e3nn_conv_tp, spec_from_e3nn

    spec = spec_from_e3nn(make_e3nn_conv_tp(*CATALOG["mp-medium-l2"].irreps))
    graph, x, y, _ = random_problem(spec, 64, 1500, torch.float64, "cuda", seed=2)
    gen = torch.Generator(device="cuda").manual_seed(3)
    h = torch.randn(1500, 64, generator=gen, device="cuda", dtype=torch.float64)
    w = torch.randn(64, spec.weight_numel, generator=gen, device="cuda", dtype=torch.float64)
    key = conv_autograd.register_spec(spec)
    results = []
    for gemm in ("cublas", "dmma"):
        inputs = [t.clone().requires_grad_() for t in (x, y, h)]
        out = folded_conv_tp(key, graph, *inputs, w, max_edges=97, gemm=gemm)
        grads = torch.autograd.grad(out.sum(), inputs)
        results.append((out, *grads))
    for a, b in zip(*results):
        _close(a, b, float(b.abs().max()) + 1.0)
