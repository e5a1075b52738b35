"""The fused ops as torch sees them: torch.library's opcheck (schema, fake tensors, autograd
registration) and torch.compile with ``fullgraph=True`` (no graph break at our ops); output and
gradient (forces-style) equal to eager, fp64, reference backend on the CPU.

The whole accelerated model through torch.compile (after mace's ``simplify``, which dynamo needs
for e3nn's ``Irrep``) is tested in tests/test_compile.py.
"""

from __future__ import annotations

import pytest
import torch

from mace_accel.ops.conv_tp import autograd as conv_ops
from mace_accel.ops.conv_tp.catalog import CATALOG as CONV_CATALOG
from mace_accel.ops.conv_tp.spec import make_e3nn_conv_tp, spec_from_e3nn
from mace_accel.ops.graph import ConvGraph
from mace_accel.ops.symmetric_contraction import autograd as sc_ops
from mace_accel.ops.symmetric_contraction.catalog import build

F64 = torch.float64


def _sc_inputs(name: str = "small-l2-corr3", n: int = 5):
    _, spec = build(name)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, spec.num_features, spec.num_components, generator=gen, dtype=F64)
    elem = torch.randint(0, spec.num_elements, (n,), generator=gen).to(torch.int32)
    weights = [torch.randn(s, generator=gen, dtype=F64) for s in spec.weight_shapes]
    return spec, sc_ops.register_spec(spec), x, elem, weights


def test_symmetric_contraction_ops_pass_opcheck():
    spec, key, x, elem, weights = _sc_inputs()
    g = torch.randn(x.shape[0], spec.dim_out, dtype=F64)
    checks = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(sc_ops.sc_op.op, (x.requires_grad_(), elem, weights, key, "reference"),
                          test_utils=checks)
    torch.library.opcheck(sc_ops.sc_backward_op.op, (x, elem, weights, g, key, "reference"),
                          test_utils=checks)


def _forces_like(op_call, x):
    """An energy-like sum of an op's output and its gradient to ``x`` (as forces are)."""
    x = x.detach().requires_grad_(True)
    out = op_call(x)
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    return out.detach(), gx


@pytest.mark.parametrize("family", ["symmetric_contraction", "conv_tp"])
def test_compiled_fullgraph_matches_eager(family):
    torch._dynamo.reset()
    if family == "symmetric_contraction":
        _, key, x, elem, weights = _sc_inputs()

        def call(x):
            return sc_ops.symmetric_contraction(key, x, elem, weights, backend="reference")
    else:
        tp = make_e3nn_conv_tp(*CONV_CATALOG["tiny-gradcheck"].irreps).to(F64)
        spec = spec_from_e3nn(tp)
        key = conv_ops.register_spec(spec)
        gen = torch.Generator().manual_seed(1)
        n, e = 6, 20
        graph = ConvGraph(sender=torch.randint(0, n, (e,), generator=gen),
                          receiver=torch.randint(0, n, (e,), generator=gen), n_nodes=n)
        x = torch.randn(n, spec.dim_in1, generator=gen, dtype=F64)
        y = torch.randn(e, spec.dim_in2, generator=gen, dtype=F64)
        w = torch.randn(e, spec.weight_numel, generator=gen, dtype=F64)

        def call(x):
            return conv_ops.conv_tp(key, graph, x, y, w, backend="reference")

    want = _forces_like(call, x)
    # the forward compiled as one graph (our op inside, no break); its backward, our registered
    # backward op, runs through AOTAutograd's compiled backward
    got = _forces_like(torch.compile(call, backend="aot_eager", fullgraph=True), x)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
