"""The folded convolution's CUDA path (``w_sorted`` kernels over chunks of receivers) vs the
reference, fp32/fp64, deterministic repeats, and whole models with the TP weights recomputed."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import pass_error, random_problem

from mace_accel.bench.timing import capture_graph
from mace_accel.ops.conv_tp import autograd
from mace_accel.ops.conv_tp.catalog import CATALOG
from mace_accel.ops.conv_tp.folded import folded_conv_tp
from mace_accel.ops.conv_tp.spec import make_e3nn_conv_tp, spec_from_e3nn
from mace_accel.tolerances import PASS_TOL, rel_linf_error

pytestmark = pytest.mark.gpu
HIDDEN = 16


def _inputs(name, dtype, n_nodes=64, n_edges=1500):
    spec = spec_from_e3nn(make_e3nn_conv_tp(*CATALOG[name].irreps))
    graph, x, y, _ = random_problem(spec, n_nodes, n_edges, dtype, "cuda", seed=2)
    gen = torch.Generator(device="cuda").manual_seed(3)
    h = torch.randn(n_edges, HIDDEN, generator=gen, device="cuda", dtype=dtype)
    w = torch.randn(spec.weight_numel, HIDDEN, generator=gen, device="cuda", dtype=dtype).t()
    return autograd.register_spec(spec), graph, [t.requires_grad_() for t in (x, y, h, w)]


def _run(key, graph, inputs, backend, max_edges, deterministic=True):
    out = folded_conv_tp(key, graph, *inputs, backend=backend, max_edges=max_edges,
                         deterministic=deterministic)
    g = torch.ones_like(out) + torch.arange(out.numel(), device=out.device,
                                            dtype=out.dtype).reshape(out.shape) % 3
    return [out, *torch.autograd.grad(out, inputs, g)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["mp-medium-l2", "odd-mul", "l3-feats", "mp-large-l2"])
@pytest.mark.parametrize("max_edges", [97, 100000])
def test_cuda_fold_matches_reference(name, dtype, max_edges):
    key, graph, inputs = _inputs(name, dtype)
    got = _run(key, graph, inputs, "cuda", max_edges)
    want = _run(key, graph, [t.detach().double().requires_grad_() for t in inputs],
                "reference", 100000)
    err = pass_error(dtype)
    tols = [PASS_TOL[dtype]["forward"]] + [PASS_TOL[dtype]["backward"]] * 4
    for what, a, b, tol in zip(("out", "x", "y", "h", "w"), got, want, tols):
        assert err(a.double(), b) < tol, what
    # deterministic: bit-identical repeats; the atomic variant agrees to rounding
    again = _run(key, graph, inputs, "cuda", max_edges)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    atomic = _run(key, graph, inputs, "cuda", max_edges, deterministic=False)
    for a, b, tol in zip(atomic, want, tols):
        assert err(a.double(), b) < tol


def test_captured_in_a_cuda_graph_it_runs_as_one_chunk():
    """A CUDA graph cannot read the CSR on the host: inside a capture the op makes one chunk,
    and the replay equals the eager (chunked) call."""
    key, graph, inputs = _inputs("mp-medium-l2", torch.float32)
    x, y, h, w = (t.detach() for t in inputs)

    def call():
        return folded_conv_tp(key, graph, x, y, h, w, backend="cuda", max_edges=97)

    eager = call()
    captured, out = capture_graph(call)  # warm-up off the capture: kernels compiled, CSRs built
    captured.replay()
    torch.cuda.synchronize()
    assert rel_linf_error(out.double(), eager.double()) < PASS_TOL[torch.float32]["forward"]
