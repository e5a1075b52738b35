"""The staged conv kernels (rows copied into shared memory ahead of use) against the plain
kernels (GPU only). The per-edge arithmetic is the same source; nvcc may contract it into
FMAs differently in the two kernels, so float32 results agree to rounding (float64 came out
bit-identical), and each is bit-reproducible."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import random_problem

from mace_accel.ops.conv_tp.catalog import CATALOG
from mace_accel.ops.conv_tp.codegen import all_backward_needs
from mace_accel.ops.conv_tp.cuda import CudaConvPrimitives
from mace_accel.ops.conv_tp.spec import make_spec
from mace_accel.ops.conv_tp.staged import Staging
from mace_accel.ops.graph import KernelGraph, ReceiverRows

pytestmark = pytest.mark.gpu
DTYPES = (torch.float32, torch.float64)
PLAIN = {"forward": None, "backward": None}


def _staging(edges: int, stages: int, by_segment: bool = False) -> dict:
    return {"forward": Staging(edges, stages, 0, by_segment),
            "backward": Staging(edges, stages, 0, by_segment)}


def _problem(name, dtype, n_nodes=64, n_edges=1500, seed=3):
    spec = make_spec(*CATALOG[name].irreps)
    graph, x, y, w = random_problem(spec, n_nodes, n_edges, dtype, "cuda", seed=seed)
    g = torch.randn(n_nodes, spec.dim_out, dtype=dtype, device="cuda",
                    generator=torch.Generator("cuda").manual_seed(seed))
    return spec, graph, KernelGraph(*graph.tensors("cuda")), x, y, w, g


def _prims(spec, dtype, staging, deterministic: bool = True) -> CudaConvPrimitives:
    """Primitives that stage as ``staging`` says on graphs of any size."""
    prims = CudaConvPrimitives(spec, dtype, torch.device("cuda"), deterministic=deterministic,
                               staging=staging)
    prims.staged_min_edges = 0
    return prims


def _run(prims, n, kg, x, y, w, g, needs_list):
    out = [prims.forward(n, kg, x, y, w)]
    for needs in needs_list:
        out += [t for t in prims.backward(n, kg, x, y, w, g, needs) if t is not None]
    return out


def _assert_identical(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {i}: max diff {(a - b).abs().max().item()}"


def _assert_close(got, want):
    """To rounding: relative to each output's largest value, 1e-6 (float32) / 1e-14."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        tol = 1e-6 if a.dtype == torch.float32 else 1e-14
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        assert err <= tol, f"output {i}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CATALOG))
def test_staged_matches_plain_over_catalog(name, dtype):
    """Every catalog problem: forward and the two backward selections MACE uses."""
    spec, graph, kg, x, y, w, g = _problem(name, dtype)
    needs = [(True, True, True), (False, True, True)]
    plain = _prims(spec, dtype, PLAIN)
    staged = _prims(spec, dtype, None)  # the defaults
    got = _run(staged, graph.n_nodes, kg, x, y, w, g, needs)
    _assert_close(got, _run(plain, graph.n_nodes, kg, x, y, w, g, needs))
    _assert_identical(_run(staged, graph.n_nodes, kg, x, y, w, g, needs), got)
    assert any("_st" in name for name in staged._kernels)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2, False), (2, 4, False), (8, 2, False), (4, 2, True)])
@pytest.mark.parametrize("name", ["mp-medium-l2", "odd-mul", "mixed-parity"])
def test_staged_shapes_and_long_rows(name, shape, dtype):
    """Other stage shapes, one input segment per launch, every gradient selection, and
    receivers with more edges than one refill of the index buffers (8 nodes, ~190 edges each).
    One segment per launch sums d(edge_attrs) launch by launch: the plain kernels it is
    checked against run the same launches."""
    spec, graph, kg, x, y, w, g = _problem(name, dtype, n_nodes=8, n_edges=1500)
    needs = all_backward_needs()
    plain = _prims(spec, dtype, PLAIN)
    if shape[2]:
        plain.plan = plain._segment_plan
    staged = _prims(spec, dtype, _staging(*shape))
    _assert_close(_run(staged, graph.n_nodes, kg, x, y, w, g, needs),
                  _run(plain, graph.n_nodes, kg, x, y, w, g, needs))


@pytest.mark.parametrize("dtype", DTYPES)
def test_staged_atomic_backward_close(dtype):
    spec, graph, kg, x, y, w, g = _problem("mp-medium-l2", dtype)
    plain = _prims(spec, dtype, PLAIN)
    staged = _prims(spec, dtype, None, deterministic=False)
    got = staged.backward(graph.n_nodes, kg, x, y, w, g, (True, True, True))
    want = plain.backward(graph.n_nodes, kg, x, y, w, g, (True, True, True))
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert float((got[0] - want[0]).abs().max() / want[0].abs().max()) < tol
    _assert_close(got[1:], want[1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_staged_receiver_rows(dtype):
    """The weights-in-receiver-order launches (a range of receivers, as the folded radial MLP
    runs them)."""
    spec, graph, kg, x, y, w, g = _problem("mp-medium-l2", dtype)
    n = graph.n_nodes
    ptr = kg.recv_ptr.cpu()
    rows = ReceiverRows(10, 40, int(ptr[10]), int(ptr[40]))
    w_rows = w[kg.recv_perm[rows.e0:rows.e1].long()].contiguous()
    results = []
    for staging in (PLAIN, None):
        prims = _prims(spec, dtype, staging)
        out = torch.zeros(n, spec.dim_out, dtype=dtype, device="cuda")
        prims.forward_rows(rows, kg, x, y, w_rows, out)
        acc = prims.backward_buffers(n, kg, (True, True, True))
        gw = prims.backward_rows(rows, kg, x, y, w_rows, g, acc)
        acc.gxm[kg.recv_perm[:rows.e0].long()] = 0  # messages of edges outside the rows
        acc.gxm[kg.recv_perm[rows.e1:].long()] = 0
        gx, _ = prims.finish_backward(n, kg, acc)
        results.append([out, gw, gx, acc.gy[kg.recv_perm[rows.e0:rows.e1].long()]])
        assert any("_st" in name for name in prims._kernels) == (staging is None)
    _assert_close(*results[::-1])


def test_misaligned_view_runs_the_plain_kernel():
    """A weight tensor that starts off the 16-byte copies' alignment (a view) is read by the
    plain kernel: the same bits, no error."""
    dtype = torch.float32
    spec, graph, kg, x, y, w, g = _problem("mp-medium-l2", dtype)
    storage = torch.empty(w.numel() + 1, dtype=dtype, device="cuda")
    shifted = storage[1:].view_as(w)
    shifted.copy_(w)
    assert shifted.data_ptr() % 16 != 0
    staged = _prims(spec, dtype, None)
    plain = _prims(spec, dtype, PLAIN)
    _assert_identical(_run(staged, graph.n_nodes, kg, x, y, shifted, g, [(True, True, True)]),
                      _run(plain, graph.n_nodes, kg, x, y, w, g, [(True, True, True)]))
    assert not any("_st" in name for name in staged._kernels)
