"""The radial MLP's last layer folded into the convolution (:mod:`mace_accel.ops.conv_tp.folded`,
:mod:`mace_accel.patches.fold`): the chunked op equals ``conv(x, y, h @ W)`` with every
gradient and double backward, the fold is proved from the block's source, and whole models with
the per-edge weights recomputed equal the unpatched ones (CPU, reference backend)."""

from __future__ import annotations


import pytest
import torch
from helpers import save_and_load

from mace_accel.errors import ConfigError
from mace_accel.ops.conv_tp import autograd
from mace_accel.ops.conv_tp.folded import folded_conv_tp, recompute_weights
from mace_accel.ops.conv_tp.spec import make_spec
from mace_accel.ops.graph import graph_from_edge_index, receiver_chunks
from mace_accel.options import AccelOptions
from mace_accel.patches.conv_tp import FusedConvTP
from mace_accel.patches.fold import fold_reason
from mace_accel.patches.interaction_blocks import INTERACTION_BLOCK_CLASSES
from mace_accel.patches.radial.mlp import FusedRadialMLP
from mace_accel.surgery import accelerate, revert
from mace_accel.tolerances import MODEL_TOL, rel_norm_error

F64 = torch.float64


def _problem(n_nodes=7, n_edges=40, hidden=5, seed=0):
    torch.manual_seed(seed)
    spec = make_spec("4x0e+4x1o", "1x0e+1x1o+1x2e", "4x0e+4x1o+4x2e")
    key = autograd.register_spec(spec)
    x = torch.randn(n_nodes, spec.dim_in1, dtype=F64, requires_grad=True)
    y = torch.randn(n_edges, spec.dim_in2, dtype=F64, requires_grad=True)
    h = torch.randn(n_edges, hidden, dtype=F64, requires_grad=True)
    w = torch.randn(hidden, spec.weight_numel, dtype=F64, requires_grad=True)
    # node 0 receives nothing, so some chunks are empty
    edge_index = torch.stack([torch.randint(0, n_nodes, (n_edges,)),
                              torch.randint(1, n_nodes, (n_edges,))])
    return key, graph_from_edge_index(edge_index, n_nodes), (x, y, h, w)


def test_receiver_chunks_cover_every_edge_once_in_order():
    ptr = torch.tensor([0, 3, 3, 10, 12, 20])
    assert receiver_chunks(ptr, 5, 20, 100) == [(0, 5, 0, 20)]
    chunks = receiver_chunks(ptr, 5, 20, 5)
    assert [c.n0 for c in chunks] == [0, 2, 3, 4] and chunks[-1].n1 == 5
    assert all(a.n1 == b.n0 and a.e1 == b.e0 for a, b in zip(chunks, chunks[1:]))
    assert all(c.e1 - c.e0 <= 5 or c.n1 - c.n0 == 1 for c in chunks)  # one node may exceed
    # the host copy of the CSR is read once per tensor (one synchronisation per call) ...
    from mace_accel.ops import graph as graph_module

    host = graph_module._HOST_PTR[2]
    receiver_chunks(ptr, 5, 20, 7)
    assert graph_module._HOST_PTR[2] is host
    ptr[1] = 2  # ... and again once the tensor changed
    assert receiver_chunks(ptr, 5, 20, 2)[0] == (0, 1, 0, 2)
    assert graph_module._HOST_PTR[2] is not host


@pytest.mark.parametrize("max_edges", [1, 3, 11, 1000])
def test_chunked_fold_equals_conv_of_the_weights_with_all_gradients(max_edges):
    key, graph, (x, y, h, w) = _problem()
    ref = autograd.conv_tp(key, graph, x, y, h @ w, backend="reference")
    out = folded_conv_tp(key, graph, x, y, h, w, backend="reference", max_edges=max_edges)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (x, y, h, w), g),
                    torch.autograd.grad(ref, (x, y, h, w), g)):
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-12)


def test_only_the_gradients_asked_for():
    key, graph, (x, y, h, w) = _problem()
    out = folded_conv_tp(key, graph, x.detach(), y, h, w.detach(), backend="reference",
                         max_edges=4)
    gy, gh = torch.autograd.grad(out.square().sum(), (y, h))
    ref = autograd.conv_tp(key, graph, x.detach(), y, h @ w.detach(), backend="reference")
    ry, rh = torch.autograd.grad(ref.square().sum(), (y, h))
    assert torch.allclose(gy, ry, atol=1e-11) and torch.allclose(gh, rh, atol=1e-11)


def test_gradcheck_and_double_backward():
    # chunks of 4 edges: nodes 0-1 (node 0 receives nothing), node 2 alone (5 edges), node 3
    key, graph, inputs = _problem(n_nodes=4, n_edges=10, hidden=2)
    # torch.einsum without opt_einsum's search for a contraction order: on tensors this small
    # the search, run at every call of the reference's einsums, is most of gradcheck's time
    with torch.backends.opt_einsum.flags(enabled=False):
        assert torch.autograd.gradcheck(
            lambda *t: folded_conv_tp(key, graph, *t, backend="reference", max_edges=4), inputs)
    x, y, h, w = inputs
    results = []
    for fold in (True, False):  # training on forces: d/d(x, h, W) of a function of d out/dy
        out = (folded_conv_tp(key, graph, x, y, h, w, backend="reference", max_edges=4) if fold
               else autograd.conv_tp(key, graph, x, y, h @ w, backend="reference"))
        (gy,) = torch.autograd.grad(out.sum(), y, create_graph=True)
        results.append(torch.autograd.grad(gy.square().sum(), (x, h, w)))
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-12)


def test_recompute_rule():
    cpu = torch.device("cpu")
    assert recompute_weights("always", 10, 1280, torch.float32, cpu)
    assert not recompute_weights("never", 10 ** 9, 1280, torch.float32, cpu)
    assert not recompute_weights("auto", 10 ** 9, 1280, torch.float32, cpu)  # no GPU memory
    with pytest.raises(ConfigError, match="recompute_tp_weights"):
        AccelOptions(recompute_tp_weights="sometimes")


def test_every_mace_block_class_allows_the_fold():
    import mace.modules.blocks as blocks

    for name in INTERACTION_BLOCK_CLASSES:
        cls = getattr(blocks, name)
        assert fold_reason(cls.__new__(cls)) is None, name


class _Squashes(torch.nn.Module):
    def forward(self, edge_feats, edge_attrs, node_feats, edge_index):
        tp_weights = self.conv_tp_weights(edge_feats)
        tp_weights = torch.tanh(tp_weights)
        return self.conv_tp(node_feats, edge_attrs, tp_weights, edge_index)


class _Shifts(torch.nn.Module):
    def forward(self, edge_feats, edge_attrs, node_feats, edge_index):
        tp_weights = self.conv_tp_weights(edge_feats) + 1.0
        return self.conv_tp(node_feats, edge_attrs, tp_weights, edge_index)


class _Scales(torch.nn.Module):
    def forward(self, edge_feats, edge_attrs, node_feats, edge_index, cutoff):
        tp_weights = self.conv_tp_weights(edge_feats)
        tp_weights = cutoff * tp_weights
        return self.conv_tp(node_feats, edge_attrs, tp_weights, edge_index)


def test_a_block_that_transforms_the_weights_is_not_folded():
    assert "torch.tanh(tp_weights)" in fold_reason(_Squashes())
    assert "cannot prove" in fold_reason(_Shifts())
    assert fold_reason(_Scales()) is None


# (first block, second block, hidden irreps): every class whose radial MLP is e3nn's (the
# non-linear block's LayerNorm MLP is not fused, so not folded), fp64 and fp32
CASES = [("RealAgnosticInteractionBlock", "RealAgnosticResidualInteractionBlock", "8x0e+8x1o",
          torch.float64),
         ("RealAgnosticDensityInteractionBlock", "RealAgnosticAttResidualInteractionBlock",
          "8x0e+8x1o+8x2e", torch.float64),
         ("RealAgnosticDensityResidualInteractionBlock", "RealAgnosticResidualInteractionBlock",
          "8x0e+8x1o", torch.float32)]


@pytest.mark.parametrize("recompute", ["always", "never"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0][13:] + "-" + c[1][13:] + "-" + str(c[3]))
def test_folded_models_match_unpatched(case, recompute, tiny_model):
    from mace_accel.models.batch import atoms_to_batch, model_info, random_structure
    from mace_accel.surgery import evaluate

    first, second, irreps, dtype = case
    model = tiny_model(second, hidden_irreps=irreps, dtype=dtype, interaction_first=first,
                       seed=1)
    info = model_info(model)
    batch = atoms_to_batch(random_structure(info.atomic_numbers, n_atoms=9, r_max=info.r_max,
                                            seed=2), info)
    before = evaluate(model, batch, compute_stress=True)
    report = accelerate(model, options=AccelOptions(backend="reference",
                                                    recompute_tp_weights=recompute))
    for record in report.records:
        if record.kind == "interaction_block":
            assert "last layer folded in" in record.part("conv").detail
            assert "folded into the conv" in record.part("radial_mlp").detail
    for block in model.interactions:
        assert isinstance(block.conv_tp, FusedConvTP)
        assert block.conv_tp.radial is block.conv_tp_weights
        assert block.conv_tp_weights.fold_last
    after = evaluate(model, batch, compute_stress=True)
    for key in ("energy", "forces", "stress"):
        assert rel_norm_error(after[key], before[key]) <= MODEL_TOL[dtype], key
    # the sibling reference survives pickling; revert hands back the e3nn modules
    loaded = save_and_load(model)
    for block in loaded.interactions:
        assert block.conv_tp.radial is block.conv_tp_weights
    again = evaluate(loaded, batch, compute_stress=True)
    assert torch.equal(again["forces"], after["forces"])
    revert(model)
    assert not any(isinstance(m, (FusedConvTP, FusedRadialMLP)) for m in model.modules())
    assert torch.equal(evaluate(model, batch, compute_stress=True)["forces"], before["forces"])


def test_parts_without_the_radial_mlp_leave_the_weights_unfolded(tiny_model):
    model = tiny_model("RealAgnosticResidualInteractionBlock", dtype=torch.float64)
    accelerate(model, backend="reference", parts=("conv",))
    for block in model.interactions:
        assert block.conv_tp.radial is None
        assert not isinstance(block.conv_tp_weights, FusedRadialMLP)


def test_models_saved_before_the_fold_still_load(tiny_model):
    """An accelerated model pickled by a version without the fold (no ``radial`` on the conv,
    no ``fold_last`` on the MLP) loads and runs unfolded."""
    from mace_accel.models.batch import atoms_to_batch, model_info, random_structure
    from mace_accel.surgery import evaluate

    model = tiny_model("RealAgnosticResidualInteractionBlock", dtype=torch.float64)
    info = model_info(model)
    batch = atoms_to_batch(random_structure(info.atomic_numbers, n_atoms=8, r_max=info.r_max,
                                            seed=4), info)
    want = evaluate(model, batch, False)
    accelerate(model, backend="reference", parts=("conv", "radial_mlp"),
               options=AccelOptions(backend="reference"))
    for block in model.interactions:  # make them look like the older modules
        block.conv_tp.__dict__.pop("radial")
        block.conv_tp_weights.__dict__.pop("fold_last")
    loaded = save_and_load(model)
    for block in loaded.interactions:
        assert block.conv_tp.radial is None and block.conv_tp_weights.fold_last is False
    got = evaluate(loaded, batch, False)
    assert rel_norm_error(got["forces"], want["forces"]) <= MODEL_TOL[torch.float64]
