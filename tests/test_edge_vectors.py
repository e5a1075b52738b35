"""The fused edge vectors on the CPU: the autograd wiring of the op (its kernels stood in for by
torch ops with the same contract), the wrapper of mace's function and the model hooks that turn
it on only inside an accelerated model's call. The kernels themselves:
tests/test_gpu_edge_vectors.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import save_and_load

import mace.modules.models as mace_models
import mace.modules.utils as mace_utils
from mace_accel.models.batch import atoms_to_batch, model_info, random_structure
from mace_accel.ops.edge_vectors import autograd as ops
from mace_accel.ops.edge_vectors.codegen import kernel_name, render_kernels
from mace_accel.options import AccelOptions
from mace_accel.patches import edge_vectors as patch
from mace_accel.surgery import accelerate, evaluate, plan, revert, unpatched

F64 = torch.float64


class _TorchKernels:
    """Stands in for :class:`CudaEdgeVectors` on the CPU with torch ops of the same contract,
    so the op's autograd (which kernel gets which gradient, the create_graph path) is tested
    without a GPU."""

    calls = []

    def forward(self, positions, shifts, sender, receiver):
        self.calls.append("forward")
        vectors = positions[receiver.long()] - positions[sender.long()] + shifts
        return vectors, torch.linalg.norm(vectors, dim=-1, keepdim=True)

    def backward(self, g_vec, g_len, vectors, lengths, graph, n_nodes):
        self.calls.append("backward")
        g = ops.edge_gradient(g_vec, g_len, vectors, lengths)
        out = torch.zeros((n_nodes, 3), dtype=g.dtype)
        for node in range(n_nodes):  # the kernel's order: received edges, then sent ones
            lo, hi = int(graph.recv_ptr[node]), int(graph.recv_ptr[node + 1])
            for e in graph.recv_perm[lo:hi].tolist():
                out[node] += g[e]
            lo, hi = int(graph.send_ptr[node]), int(graph.send_ptr[node + 1])
            for e in graph.send_perm[lo:hi].tolist():
                out[node] -= g[e]
        return out


@pytest.fixture
def torch_kernels(monkeypatch):
    kernels = _TorchKernels()
    kernels.calls.clear()
    monkeypatch.setattr(ops, "_cuda", lambda t: kernels)
    return kernels


def _graph(n_nodes=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randn(n_nodes, 3, dtype=F64, generator=gen) * 2
    edge_index = torch.tensor([[0, 1, 2, 3, 1, 4, 0, 2], [1, 0, 3, 2, 4, 1, 2, 0]])
    shifts = torch.randn(edge_index.shape[1], 3, dtype=F64, generator=gen)
    shifts[-1] = 0  # with positions equal below: a zero-length edge
    positions[0] = positions[2]
    shifts[6] = 0
    return positions, edge_index, shifts


def _with_grads(positions, shifts):
    return positions.clone().requires_grad_(True), shifts.clone().requires_grad_(True)


def test_op_matches_mace_values_and_gradients(torch_kernels):
    positions, edge_index, shifts = _graph()
    gen = torch.Generator().manual_seed(1)
    g_vec = torch.randn(edge_index.shape[1], 3, dtype=F64, generator=gen)
    g_len = torch.randn(edge_index.shape[1], 1, dtype=F64, generator=gen)
    results = []
    for use_op in (False, True):
        p, s = _with_grads(positions, shifts)
        if use_op:
            vec, length = ops._EdgeVectors.apply(p, s, edge_index,
                                                 ops.graph_from_edge_index(edge_index, 6))
        else:
            vec, length = ops.reference(p, edge_index, s)
        grads = torch.autograd.grad((vec, length), (p, s), (g_vec, g_len))
        results.append((vec.detach(), length.detach()) + grads)
    assert torch_kernels.calls == ["forward", "backward"]
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-13, atol=1e-13)
    # the zero-length edge passes only its vector gradient on (torch's norm backward)
    assert results[0][1][6, 0] == 0


def test_op_gradients_pass_gradcheck_and_gradgradcheck(torch_kernels):
    positions, edge_index, shifts = _graph()
    positions[0] += 0.1  # no zero-length edge: finite differences need a smooth norm
    graph = ops.graph_from_edge_index(edge_index, 6)

    def fn(p, s):
        return ops._EdgeVectors.apply(p, s, edge_index, graph)

    p, s = _with_grads(positions, shifts)
    assert torch.autograd.gradcheck(fn, (p, s))
    assert torch.autograd.gradgradcheck(fn, (p, s))


def test_op_without_a_lengths_gradient(torch_kernels):
    positions, edge_index, shifts = _graph()
    p, s = _with_grads(positions, shifts)
    vec, _ = ops._EdgeVectors.apply(p, s, edge_index, ops.graph_from_edge_index(edge_index, 6))
    (gp,) = torch.autograd.grad(vec.sum(), p)
    p2, s2 = _with_grads(positions, shifts)
    (expected,) = torch.autograd.grad(ops.reference(p2, edge_index, s2)[0].sum(), p2)
    assert torch.allclose(gp, expected, rtol=1e-13, atol=1e-13)


def test_reference_backend_is_mace_ops():
    positions, edge_index, shifts = _graph()
    vec, length = ops.edge_vectors(positions, edge_index, shifts, "reference")
    v2, l2 = mace_utils.get_edge_vectors_and_lengths(positions=positions,
                                                     edge_index=edge_index, shifts=shifts)
    assert torch.equal(vec, v2) and torch.equal(length, l2)


def test_sources_name_both_kernels_for_each_dtype():
    for dtype, real in (("float32", "float"), ("float64", "double")):
        src = render_kernels(dtype)
        assert f"typedef {real} real;" in src
        assert kernel_name("forward", dtype) in src and kernel_name("backward", dtype) in src


# ----- the wrapper and the hooks ------------------------------------------------------------------
def _model_and_batch(tiny_model):
    model = tiny_model()
    info = model_info(model)
    atoms = random_structure(info.atomic_numbers, n_atoms=6, r_max=info.r_max, seed=4)
    return model, atoms_to_batch(atoms, info, dtype=F64, device="cpu")


def test_accelerate_hooks_the_model_and_revert_unhooks_it(tiny_model):
    model, batch = _model_and_batch(tiny_model)
    plain = evaluate(model, batch, False)
    accelerate(model, backend="reference")
    assert patch.is_installed(model)
    assert mace_utils.get_edge_vectors_and_lengths is patch.fused_edge_vectors_and_lengths
    assert getattr(mace_models, "get_edge_vectors_and_lengths",
                   patch.fused_edge_vectors_and_lengths) is patch.fused_edge_vectors_and_lengths
    with unpatched(model):
        assert not patch.is_installed(model)
    assert patch.is_installed(model)
    out = evaluate(model, batch, False)
    assert torch.allclose(out["forces"], plain["forces"], rtol=1e-12, atol=1e-12)
    revert(model)
    assert not patch.is_installed(model)
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_hooks_mark_only_the_accelerated_model_call(tiny_model):
    model, batch = _model_and_batch(tiny_model)
    accelerate(model, backend="reference")
    seen = []
    original = patch._ORIGINAL[0]

    def spy(**kwargs):
        seen.append(patch._ACTIVE.get())
        return original(**kwargs)

    patch._ORIGINAL[0] = spy
    try:
        evaluate(model, batch, False)
        other, other_batch = _model_and_batch(tiny_model)  # never accelerated
        evaluate(other, other_batch, False)
    finally:
        patch._ORIGINAL[0] = original
    assert len(seen) == 2
    assert seen[0] is not None and seen[0].options.backend == "reference" and seen[1] is None
    assert patch._ACTIVE.get() is None


def test_the_mark_is_undone_when_the_call_raises(tiny_model):
    model, batch = _model_and_batch(tiny_model)
    accelerate(model, backend="reference")
    broken = dict(batch)
    broken["edge_index"] = batch["edge_index"][:1]  # wrong shape: mace's forward raises
    with pytest.raises(Exception):
        model(broken, compute_force=True)
    assert patch._ACTIVE.get() is None
    assert not getattr(patch._TOKENS, "stack", [])


def test_hooks_survive_pickling(tiny_model):
    model, batch = _model_and_batch(tiny_model)
    accelerate(model, backend="reference")
    loaded = save_and_load(model)
    assert patch.is_installed(loaded)
    assert torch.equal(evaluate(loaded, batch, False)["forces"],
                       evaluate(model, batch, False)["forces"])
    revert(loaded)
    assert not patch.is_installed(loaded)


def test_plan_names_the_edge_vectors_for_the_cuda_backend(tiny_model):
    model, _ = _model_and_batch(tiny_model)
    records = plan(model, AccelOptions(backend="cuda"))
    details = [p.detail for r in records for p in r.parts if p.part == "edge_features"]
    assert any(patch.DETAIL in d for d in details)
    records = plan(model, AccelOptions(backend="reference"))
    details = [p.detail for r in records for p in r.parts if p.part == "edge_features"]
    assert details and not any(patch.DETAIL in d for d in details)


def test_stress_from_edges_takes_the_lengths_part(tiny_model, torch_kernels, monkeypatch, cu_atoms):
    """The calculator's stress sums v (x) dE/dv over edges; with the fused op the lengths are a
    second output beside the vectors, so dE/dv must take their part explicitly."""
    from mace_accel.models.outputs import evaluate as evaluate_model

    model = tiny_model()
    for p in model.parameters():
        p.requires_grad_(False)
    info = model_info(model)
    cu_atoms.numbers[:] = info.atomic_numbers[-1]
    batch = atoms_to_batch(cu_atoms, info, dtype=F64, device="cpu")
    want = model(dict(batch), training=False, compute_force=True, compute_stress=True)

    def fused(positions, edge_index, shifts, normalize=False, eps=1e-9):
        return ops._EdgeVectors.apply(positions.contiguous(), shifts.contiguous(), edge_index,
                                      ops.graph_from_edge_index(edge_index, positions.shape[0]))

    for namespace in (mace_utils, mace_models):
        monkeypatch.setattr(namespace, "get_edge_vectors_and_lengths", fused, raising=False)
    got = evaluate_model(model, dict(batch), True)
    assert "backward" in torch_kernels.calls
    for key in ("energy", "forces", "stress"):
        assert torch.allclose(got[key], want[key], rtol=1e-10, atol=1e-12), key


def test_element_index_once_per_call(tiny_model, monkeypatch):
    """Inside an accelerated call the blocks share one element index (one argmax per call, also
    in a captured graph); outside a call, and in the next call, it is computed afresh."""
    model, batch = _model_and_batch(tiny_model)
    accelerate(model, backend="reference")
    calls = []
    original = torch.Tensor.argmax

    def counting(self, *args, **kwargs):
        calls.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "argmax", counting)
    plain = evaluate(model, batch, False)
    attrs = tuple(batch["node_attrs"].shape)
    per_call = calls.count(attrs)
    assert per_call == 1
    evaluate(model, batch, False)
    assert calls.count(attrs) == 2
    y = torch.eye(3)[[0, 2, 1, 2]]
    assert patch.element_index(y).tolist() == [0, 2, 1, 2]
    assert patch.element_index(y).dtype == torch.int32
    assert torch.allclose(evaluate(model, batch, False)["forces"], plain["forces"])
