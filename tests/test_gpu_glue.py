"""The glue kernels (GPU): receiver sums, edge pairs and the division's backward against the
torch formulas they replace, nodes without edges, the same bits on a repeat and in a CUDA
graph, checks before launch."""

from __future__ import annotations

import pytest
import torch

from mace_accel.bench.timing import capture_graph
from mace_accel.errors import KernelError
from mace_accel.ops import glue, species
from mace_accel.ops.edge_features.reference import R0_SCALE, pair_r0
from mace_accel.ops.edge_features.spec import DistanceTransform
from mace_accel.ops.graph import graph_from_edge_index

pytestmark = pytest.mark.gpu


def _graph(n_nodes: int, n_edges: int, seed: int) -> torch.Tensor:
    """``[2, E]`` int64 random edges on the GPU; the last node receives none."""
    gen = torch.Generator().manual_seed(seed)
    sender = torch.randint(0, n_nodes, (n_edges,), generator=gen)
    receiver = torch.randint(0, max(1, n_nodes - 1), (n_edges,), generator=gen)
    return torch.stack([sender, receiver]).cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("n_nodes,n_edges,k", [(1, 0, 1), (37, 500, 1), (300, 25000, 3)])
def test_receiver_sums_match_float64_scatter(dtype, n_nodes, n_edges, k):
    edge_index = _graph(n_nodes, n_edges, seed=n_edges)
    values = torch.randn(n_edges, k, dtype=dtype, device="cuda")
    graph = graph_from_edge_index(edge_index, n_nodes)
    ops = glue.kernels(dtype, torch.device("cuda"))
    out = ops.receiver_sums(values, *graph.csr("receiver", torch.int32))
    want = torch.zeros(n_nodes, k, dtype=torch.float64, device="cuda").index_add_(
        0, edge_index[1], values.double())
    assert out.dtype == dtype and out.shape == (n_nodes, k)
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    # float32: the float64 sum rounded once; float64: both sums' own rounding, in any order
    tol = 2 * torch.finfo(torch.float32).eps if dtype == torch.float32 else 1e-13
    assert out.numel() == 0 or float((out.double() - want).abs().max()) <= tol * scale
    assert bool((out[-1] == 0).all()) or n_nodes == 1 and n_edges == 0
    again = torch.full_like(out, 7.0)
    graph_run, _ = capture_graph(lambda: again.copy_(
        ops.receiver_sums(values, *graph.csr("receiver", torch.int32))))
    graph_run.replay()
    torch.cuda.synchronize()
    assert torch.equal(again, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind", ["Agnesi", "Soft"])
def test_edge_pairs_equal_the_torch_gathers(dtype, kind):
    n_elements, n_nodes, n_edges = 5, 40, 3000
    edge_index = _graph(n_nodes, n_edges, seed=3)
    elements = torch.randint(0, n_elements, (n_nodes,), generator=torch.Generator()
                             .manual_seed(4)).cuda()
    radii = torch.rand(n_elements, dtype=dtype, generator=torch.Generator().manual_seed(5)
                       ).cuda() + 0.5
    slot_map = torch.randperm(n_elements * n_elements).to(torch.int32).cuda()
    graph = graph_from_edge_index(edge_index, n_nodes)
    ops = glue.kernels(dtype, torch.device("cuda"))
    sender, receiver = graph.index32("sender"), graph.index32("receiver")
    r0, slots = ops.edge_pairs(elements, sender, receiver, radii, R0_SCALE[kind], slot_map,
                               n_elements)
    transform = DistanceTransform(kind, (4.0, 2.0, 1.0) if kind == "Agnesi" else (20.0,),
                                  tuple(radii.tolist()))
    assert torch.equal(r0, pair_r0(transform, radii, elements, edge_index))
    assert torch.equal(slots, species.edge_slots(elements, edge_index, slot_map, n_elements))
    only_slots = ops.edge_pairs(elements, sender, receiver, None, 0.0, slot_map, n_elements)
    assert only_slots[0] is None and torch.equal(only_slots[1], slots)
    only_r0 = ops.edge_pairs(elements, sender, receiver, radii, R0_SCALE[kind], None,
                             n_elements)
    assert only_r0[1] is None and torch.equal(only_r0[0], r0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("n,k", [(0, 8), (1, 1), (256, 2048), (70, 9728)])
def test_divide_rows_backward_matches_autograd(dtype, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(n, k, dtype=dtype, device="cuda", generator=gen)
    d = 1 + torch.rand(n, 1, dtype=dtype, device="cuda", generator=gen) * 5
    g = torch.randn(n, k, dtype=dtype, device="cuda", generator=gen)
    ops = glue.kernels(dtype, torch.device("cuda"))
    out = x / d
    grad_x, grad_d = ops.divide_rows_backward(g, out, d)
    xr, dr = x.double().requires_grad_(), d.double().requires_grad_()
    want_x, want_d = torch.autograd.grad(xr / dr, (xr, dr), g.double())
    assert torch.equal(grad_x, g / d)  # the same division, element for element
    eps = torch.finfo(dtype).eps
    scale = float((g.double() * out.double()).abs().sum(1).max()) if n else 0.0
    assert grad_d.shape == (n, 1) and grad_d.dtype == dtype
    # the float64 dot rounded once, the division once, against float64 autograd on x and d
    assert n == 0 or float((grad_d.double() - want_d).abs().max()) <= 4 * eps * max(1.0, scale)
    only_d = ops.divide_rows_backward(g, out, d, want_x=False)
    assert only_d[0] is None and torch.equal(only_d[1], grad_d)
    again = torch.full_like(grad_d, 7.0)
    graph_run, _ = capture_graph(lambda: again.copy_(ops.divide_rows_backward(g, out, d)[1]))
    graph_run.replay()
    torch.cuda.synchronize()
    assert torch.equal(again, grad_d)


def test_divide_rows_takes_the_kernel_without_create_graph():
    from mace_accel.patches.nonlinear_block import divide_rows

    x = torch.randn(40, 96, device="cuda", requires_grad=True)
    d = (1 + torch.rand(40, 1, device="cuda")).requires_grad_()
    g = torch.randn(40, 96, device="cuda")
    fast = torch.autograd.grad(divide_rows(x, d), (x, d), g)
    graph = torch.autograd.grad(divide_rows(x, d), (x, d), g, create_graph=True)
    plain = torch.autograd.grad(x / d, (x, d), g)
    for a, b, c in zip(fast, graph, plain):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-5)
    assert graph[1].requires_grad  # the torch ops: a double backward follows
    ops = glue.kernels(torch.float32, torch.device("cuda"))
    assert torch.equal(fast[1], ops.divide_rows_backward(g, x.detach() / d.detach(),
                                                         d.detach())[1])


def test_checks_before_launch():
    ops = glue.kernels(torch.float32, torch.device("cuda"))
    edge_index = _graph(10, 50, seed=1)
    ptr, perm = graph_from_edge_index(edge_index, 10).csr("receiver", torch.int32)
    with pytest.raises(KernelError, match="float32"):
        ops.receiver_sums(torch.zeros(50, 1, dtype=torch.float64, device="cuda"), ptr, perm)
    with pytest.raises(KernelError, match="shape"):
        ops.receiver_sums(torch.zeros(49, 1, device="cuda"), ptr, perm)
    with pytest.raises(KernelError, match="int32"):
        ops.receiver_sums(torch.zeros(50, 1, device="cuda"), ptr.long(), perm)
    elements = torch.zeros(10, dtype=torch.int64, device="cuda")
    with pytest.raises(KernelError, match="int64"):
        ops.edge_pairs(elements.int(), perm, perm, None, 0.0, None, 1)
    rows = torch.zeros(10, 4, device="cuda")
    with pytest.raises(KernelError, match="shape"):
        ops.divide_rows_backward(rows, rows, torch.ones(10, device="cuda"))
    with pytest.raises(KernelError, match="contiguous"):
        ops.divide_rows_backward(rows.t().contiguous().t(), rows, torch.ones(10, 1, device="cuda"))
