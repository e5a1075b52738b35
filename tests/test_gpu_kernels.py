"""Generated CUDA kernels vs the reference path and e3nn, over the kernel catalog (GPU only)."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import pass_error, random_problem

from mace_accel.bench.timing import capture_graph
from mace_accel.errors import KernelError
from mace_accel.ops.conv_tp import autograd as ops
from mace_accel.ops.conv_tp import reference
from mace_accel.ops.conv_tp.catalog import CATALOG
from mace_accel.ops.conv_tp.spec import make_e3nn_conv_tp, spec_from_e3nn
from mace_accel.ops.graph import KernelGraph
from mace_accel.options import AccelOptions
from mace_accel.tolerances import PASS_TOL, rel_norm_error

pytestmark = pytest.mark.gpu
DTYPES = (torch.float32, torch.float64)
N_NODES, N_EDGES = 64, 1500


@pytest.fixture(scope="module")
def specs():
    return {name: spec_from_e3nn(make_e3nn_conv_tp(*p.irreps)) for name, p in CATALOG.items()}


class _Cuda:
    """The CUDA primitives of one spec and dtype, called with a ConvGraph."""

    def __init__(self, spec, dtype, deterministic: bool = True):
        from mace_accel.ops.conv_tp.cuda import CudaConvPrimitives

        self.prims = CudaConvPrimitives(spec, dtype, torch.device("cuda"),
                                        deterministic=deterministic)

    def forward(self, graph, x, y, w):
        return self.prims.forward(graph.n_nodes, KernelGraph(*graph.tensors("cuda")), x, y, w)

    def backward(self, graph, x, y, w, g, needs):
        return self.prims.backward(graph.n_nodes, KernelGraph(*graph.tensors("cuda")), x, y, w,
                                   g, needs)


class _Reference:
    """The reference primitives of one spec, called like :class:`_Cuda`."""

    def __init__(self, spec):
        self.spec = spec

    def forward(self, graph, x, y, w):
        return reference.conv_tp_forward(self.spec, x, y, w, graph.sender, graph.receiver,
                                         graph.n_nodes)

    def backward(self, graph, x, y, w, g, needs):
        return reference.conv_tp_backward(self.spec, x, y, w, g, graph.sender, graph.receiver,
                                          needs)


def _prims(spec, dtype):
    return _Cuda(spec, dtype)


def _upcast(*ts):
    return [t.double() for t in ts]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CATALOG))
def test_forward_backward_vs_reference(specs, name, dtype):
    spec = specs[name]
    graph, x, y, w = random_problem(spec, N_NODES, N_EDGES, dtype, "cuda", seed=1)
    cuda, ref = _prims(spec, dtype), _Reference(spec)
    err, tol = pass_error(dtype), PASS_TOL[dtype]
    out = cuda.forward(graph, x, y, w)
    out_ref = ref.forward(graph, *_upcast(x, y, w))
    assert err(out, out_ref) < tol["forward"], err(out, out_ref)
    g = torch.randn_like(out)
    got = cuda.backward(graph, x, y, w, g, (True, True, True))
    want = ref.backward(graph, *_upcast(x, y, w, g), (True, True, True))
    for label, a, b in zip(("node_feats", "edge_attrs", "tp_weights"), got, want):
        assert err(a, b) < tol["backward"], (label, err(a, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["mp-medium-l2", "mp-large-l2", "odd-mul", "off-large-l2",
                                  "mixed-parity"])
def test_double_backward_vs_reference(specs, name, dtype):
    """Second derivatives through ops (CUDA primitives) vs autograd of the reference."""
    spec = specs[name]
    graph, x, y, w = random_problem(spec, N_NODES, N_EDGES, dtype, "cuda", seed=2)
    r = torch.randn(N_NODES, spec.dim_out, dtype=dtype, device="cuda")

    key = ops.register_spec(spec)

    def second(backend, x, y, w, r):
        x, y, w = (t.detach().clone().requires_grad_(True) for t in (x, y, w))
        out = ops.conv_tp(key, graph, x, y, w, backend=backend)
        gx, gy, gw = torch.autograd.grad((out * r).sum(), (x, y, w), create_graph=True)
        scalar = (gx.square().sum() + (gy * gy.detach().sin()).sum() + gw.pow(3).sum())
        return torch.autograd.grad(scalar, (x, y, w))

    got = second("cuda", x, y, w, r)
    want = second("reference", *_upcast(x, y, w, r))
    for label, a, b in zip(("node_feats", "edge_attrs", "tp_weights"), got, want):
        err = pass_error(dtype)(a, b)
        assert err < PASS_TOL[dtype]["double_backward"], (label, err)


@pytest.mark.parametrize("name", ["mp-medium-l2", "l3-feats", "odd-mul"])
def test_forward_vs_e3nn(name):
    tp = make_e3nn_conv_tp(*CATALOG[name].irreps).to("cuda", torch.float64)
    spec = spec_from_e3nn(tp)
    graph, x, y, w = random_problem(spec, N_NODES, N_EDGES, torch.float64, "cuda", seed=3)
    out = _prims(spec, torch.float64).forward(graph, x, y, w)
    want = torch.zeros_like(out).index_add_(0, graph.receiver, tp(x[graph.sender], y, w))
    assert rel_norm_error(out, want) < PASS_TOL[torch.float64]["forward"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_over_repeats(specs, dtype):
    spec = specs["mp-large-l2"]
    graph, x, y, w = random_problem(spec, 256, 8000, dtype, "cuda", seed=4)
    prims = _prims(spec, dtype)
    g = torch.randn(256, spec.dim_out, dtype=dtype, device="cuda")
    first = [prims.forward(graph, x, y, w), *prims.backward(graph, x, y, w, g, (True, True, True))]
    for _ in range(10):
        again = [prims.forward(graph, x, y, w), *prims.backward(graph, x, y, w, g, (True,) * 3)]
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["mp-medium-l2", "odd-mul"])
def test_backward_edge_chunks_bit_identical(specs, name, dtype, monkeypatch):
    """A receiver's edges shared out to several blocks (small systems) give the very bits of
    one block per receiver: every backward output is per edge, summed in the same order."""
    import mace_accel.ops.conv_tp.cuda as conv_cuda
    from mace_accel.ops.conv_tp.schedule import edge_chunks

    spec = specs[name]
    graph, x, y, w = random_problem(spec, N_NODES, N_EDGES, dtype, "cuda", seed=5)
    g = torch.randn(N_NODES, spec.dim_out, dtype=dtype, device="cuda")
    prims = _prims(spec, dtype)
    limits = prims.prims.limits
    assert edge_chunks(N_NODES, 256, limits.multiprocessors, limits.threads_per_sm) > 1
    chunked = prims.backward(graph, x, y, w, g, (True, True, True))
    monkeypatch.setattr(conv_cuda, "edge_chunks", lambda *args: 1)
    whole = prims.backward(graph, x, y, w, g, (True, True, True))
    for label, a, b in zip(("node_feats", "edge_attrs", "tp_weights"), chunked, whole):
        assert torch.equal(a, b), label


def test_unsorted_edges_and_int32_and_noncontiguous(specs):
    from mace_accel.patches.conv_tp import FusedConvTP

    tp = make_e3nn_conv_tp(*CATALOG["mp-medium-l2"].irreps).to("cuda", torch.float64)
    fused = FusedConvTP(tp, spec_from_e3nn(tp), AccelOptions(backend="cuda"))
    ref = FusedConvTP(tp, spec_from_e3nn(tp), AccelOptions(backend="reference"))
    graph, x, y, w = random_problem(fused.spec, N_NODES, N_EDGES, torch.float64, "cuda",
                                    seed=5, sorted_by_sender=False)
    edge_index = torch.stack([graph.sender, graph.receiver]).to(torch.int32)
    wide = torch.randn(N_NODES, 2 * fused.spec.dim_in1, dtype=torch.float64, device="cuda")
    x_nc = wide[:, ::2]  # non-contiguous view
    assert not x_nc.is_contiguous()
    out = fused(x_nc, y, w, edge_index)
    want = ref(x_nc.contiguous(), y, w, edge_index.long())
    assert rel_norm_error(out, want) < 1e-12


def test_empty_edges(specs):
    spec = specs["mp-medium-l2"]
    graph, x, y, w = random_problem(spec, 10, 0, torch.float64, "cuda")
    prims = _prims(spec, torch.float64)
    out = prims.forward(graph, x, y, w)
    assert out.shape == (10, spec.dim_out) and torch.count_nonzero(out) == 0
    gx, gy, gw = prims.backward(graph, x, y, w, torch.randn_like(out), (True, True, True))
    assert torch.count_nonzero(gx) == 0 and gy.shape == (0, spec.dim_in2) and gw.numel() == 0


def test_prelaunch_checks(specs):
    spec = specs["mp-medium-l2"]
    graph, x, y, w = random_problem(spec, 16, 100, torch.float64, "cuda")
    prims = _prims(spec, torch.float64)
    with pytest.raises(KernelError, match="expected torch.float64"):
        prims.forward(graph, x.float(), y, w)
    with pytest.raises(KernelError, match="expected shape"):
        prims.forward(graph, x[:, :-1].contiguous(), y, w)
    with pytest.raises(KernelError, match="device"):
        prims.forward(graph, x.cpu(), y, w)
    with pytest.raises(KernelError, match="contiguous"):
        prims.forward(graph, x, y.t().contiguous().t(), w)


def test_cuda_graph_capture(specs):
    spec = specs["mp-medium-l2"]
    graph, x, y, w = random_problem(spec, N_NODES, N_EDGES, torch.float32, "cuda", seed=6)
    prims = _prims(spec, torch.float32)
    g = torch.randn(N_NODES, spec.dim_out, device="cuda")
    graph.csr("receiver"), graph.csr("sender"), graph.index32("sender"), graph.index32("receiver")

    def run():
        return [prims.forward(graph, x, y, w), *prims.backward(graph, x, y, w, g, (True,) * 3)]
    eager = run()
    cg, captured = capture_graph(run)
    x.mul_(2.0)
    cg.replay()
    torch.cuda.synchronize()
    assert torch.allclose(captured[0], 2 * eager[0], rtol=1e-5, atol=1e-5)
    assert torch.allclose(captured[3], 2 * eager[3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["mp-medium-l2", "off-large-l2", "odd-mul"])
def test_atomic_backward_matches_reference(specs, name, dtype):
    """deterministic=False: d(node_feats) through float atomics, same numbers within tolerance."""
    spec = specs[name]
    graph, x, y, w = random_problem(spec, N_NODES, N_EDGES, dtype, "cuda", seed=7,
                                    sorted_by_sender=False)
    prims = _Cuda(spec, dtype, deterministic=False)
    g = torch.randn(N_NODES, spec.dim_out, dtype=dtype, device="cuda")
    got = prims.backward(graph, x, y, w, g, (True, True, True))
    want = _Reference(spec).backward(graph, *_upcast(x, y, w, g), (True,) * 3)
    for label, a, b in zip(("node_feats", "edge_attrs", "tp_weights"), got, want):
        err = pass_error(dtype)(a, b)
        assert err < PASS_TOL[dtype]["backward"], (label, err)
