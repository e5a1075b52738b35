"""The edge-vector kernels on the GPU equal mace's torch ops: vectors, lengths, the gradients of
positions and shifts (zero-length edges, isolated atoms, no edges), float32 and float64,
bit-identical repeats, a CUDA-graph replay, and the differentiable backward (create_graph)."""

from __future__ import annotations

import pytest
import torch

from mace_accel.bench.timing import capture_graph
from mace_accel.errors import KernelError
from mace_accel.ops.edge_vectors import autograd as ops
from mace_accel.ops.graph import forget_cached_graph

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 2e-6, torch.float64: 1e-13}


def _problem(n_nodes: int, n_edges: int, dtype, seed: int = 0, zero_length: bool = True):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randn(n_nodes, 3, generator=gen, dtype=torch.float64) * 3
    # the last node is isolated
    edge_index = torch.randint(0, max(1, n_nodes - 1), (2, n_edges), generator=gen)
    shifts = torch.randn(n_edges, 3, generator=gen, dtype=torch.float64).round()
    self_edges = edge_index[0] == edge_index[1]
    shifts[self_edges] = torch.tensor([5.0, 0.0, 0.0], dtype=torch.float64)  # a periodic image
    if n_edges > 2 and zero_length:
        edge_index[:, 0] = torch.tensor([0, 0])
        shifts[0] = 0  # a self edge without a shift: zero length
    g_vec = torch.randn(n_edges, 3, generator=gen, dtype=torch.float64)
    g_len = torch.randn(n_edges, 1, generator=gen, dtype=torch.float64)
    cast = lambda t: t.to("cuda", dtype)  # noqa: E731
    return (cast(positions), edge_index.cuda(), cast(shifts), cast(g_vec), cast(g_len))


def _run(backend, positions, edge_index, shifts, g_vec, g_len, create_graph=False):
    p = positions.clone().requires_grad_(True)
    s = shifts.clone().requires_grad_(True)
    forget_cached_graph()
    vec, length = ops.edge_vectors(p, edge_index, s, backend)
    gp, gs = torch.autograd.grad((vec, length), (p, s), (g_vec, g_len),
                                 create_graph=create_graph)
    return vec, length, gp, gs, p, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_nodes,n_edges", [(1, 0), (7, 30), (300, 20000)])
def test_kernels_equal_mace_ops(dtype, n_nodes, n_edges):
    problem = _problem(n_nodes, n_edges, dtype)
    fused = _run("cuda", *problem)[:4]
    plain = _run("reference", *problem)[:4]
    for name, a, b in zip(("vectors", "lengths", "d positions", "d shifts"), fused, plain):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert (a - b).norm() <= TOL[dtype] * max(1.0, float(b.norm())), name
    if n_edges > 2:
        assert fused[1][0, 0] == 0


def test_backward_is_bit_identical_between_calls():
    problem = _problem(300, 20000, torch.float32, seed=1)
    first = _run("cuda", *problem)[2]
    for _ in range(3):
        assert torch.equal(_run("cuda", *problem)[2], first)


def test_graph_replay_equals_the_eager_call():
    positions, edge_index, shifts, g_vec, g_len = _problem(300, 20000, torch.float64, seed=2)
    p = positions.clone().requires_grad_(True)

    def call():
        forget_cached_graph()
        vec, length = ops.edge_vectors(p, edge_index, shifts, "cuda")
        return torch.autograd.grad((vec, length), p, (g_vec, g_len))[0]

    eager = call()
    graph, static = capture_graph(call)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_double_backward_equals_mace_ops(dtype):
    # no zero-length edge: torch's norm has no second derivative there (NaN), ours gives 0
    problem = _problem(40, 600, dtype, seed=3, zero_length=False)
    results = {}
    for backend in ("cuda", "reference"):
        vec, length, gp, gs, p, s = _run(backend, *problem, create_graph=True)
        results[backend] = torch.autograd.grad((gp * gp).sum() + (gs * gs).sum(), (p, s))
    for a, b in zip(results["cuda"], results["reference"]):
        assert (a - b).norm() <= TOL[dtype] * 10 * max(1.0, float(b.norm()))


def test_kernels_check_their_inputs():
    positions, edge_index, shifts, _, _ = _problem(7, 30, torch.float32)
    with pytest.raises(KernelError, match="shifts"):
        ops.edge_vectors(positions, edge_index, shifts.double(), "cuda")
