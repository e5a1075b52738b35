"""``FusedReshapeIrreps`` is mace's ``reshape_irreps`` exactly (values, gradients, double
backward), takes its place in every interaction block, and reverts."""

from __future__ import annotations


import pytest
import torch
from helpers import save_and_load

from mace_accel._e3nn_compat import import_mace, o3
from mace_accel.errors import InputError
from mace_accel.options import AccelOptions
from mace_accel.patches.layout import FusedReshapeIrreps, column_permutation, reshape_reason

import_mace()
from mace.modules.irreps_tools import reshape_irreps  # noqa: E402

IRREPS = ["128x0e+128x1o+128x2e+128x3o", "16x0e+16x1o", "5x1e+5x0e+5x2o", "3x0e"]


@pytest.mark.parametrize("irreps", IRREPS)
def test_equals_mace_bitwise_with_gradients(irreps):
    mace_module = reshape_irreps(o3().Irreps(irreps))
    ours = FusedReshapeIrreps(mace_module, AccelOptions(backend="reference"))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, o3().Irreps(irreps).dim, generator=gen, dtype=torch.float64,
                    requires_grad=True)
    want, got = mace_module(x), ours(x)
    assert got.shape == want.shape and torch.equal(got, want)
    g = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    (gw,) = torch.autograd.grad(want, x, g)
    (gg,) = torch.autograd.grad(got, x, g)
    assert torch.equal(gg, gw)


def test_double_backward_and_permutation():
    mace_module = reshape_irreps(o3().Irreps("3x0e+3x1o+3x2e"))
    ours = FusedReshapeIrreps(mace_module, AccelOptions(backend="reference"))
    x = torch.randn(4, 27, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ours, (x,))
    assert torch.autograd.gradgradcheck(ours, (x,))
    perm = column_permutation([2, 2], [1, 3])  # 2x0e+2x1o: [a0 a1 | b0(3) b1(3)]
    assert perm == [0, 2, 3, 4, 1, 5, 6, 7]


def test_what_is_refused_and_bad_input():
    assert reshape_reason(reshape_irreps(o3().Irreps("8x0e+4x1o"))).startswith(
        "irreps of different multiplicities")
    assert "not mace's reshape_irreps" in reshape_reason(torch.nn.Identity())
    assert reshape_reason(reshape_irreps(o3().Irreps("8x0e+8x1o"))) is None
    ours = FusedReshapeIrreps(reshape_irreps(o3().Irreps("8x0e+8x1o")), AccelOptions())
    with pytest.raises(InputError, match=r"shape \[n_nodes, 32\]"):
        ours(torch.zeros(3, 31))


def test_in_every_interaction_block_reverted_and_pickled(tiny_model):
    from mace_accel.surgery import accelerate, revert

    model = tiny_model("RealAgnosticResidualInteractionBlock", "8x0e+8x1o")
    report = accelerate(model, backend="reference", verify=True)
    blocks = [r for r in report.patched if r.kind == "interaction_block"]
    assert blocks and all("reshape: to [N, 8, 9] by one gather" in r.part("linears").detail
                          for r in blocks)  # the message's 0e+1o+2e
    assert all(isinstance(b.reshape, FusedReshapeIrreps) for b in model.interactions)
    loaded = save_and_load(model)
    assert all(not b.reshape._perm for b in loaded.interactions)
    revert(model)
    assert all(type(b.reshape).__name__ == "reshape_irreps" for b in model.interactions)
