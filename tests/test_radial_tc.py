"""The whole-radial-MLP kernel on the CPU: specs, packing, plans and sources, and the radial
MLP's autograd and the model around it with the kernels stood in for by torch (forward, ``d x``
on the 3xTF32 layer kernels, double backward; the conv taking the full TP weights)."""

from __future__ import annotations

import pytest
import torch

from mace_accel.errors import UnsupportedModelError
from mace_accel.ops.radial import mlp as radial_mlp
from mace_accel.ops.radial.tc import apply, codegen
from mace_accel.ops.radial.tc.spec import RadialSpec, pack_weights, unpack_weights, \
    unsupported_reason
from mace_accel.ops.tf32x3_gemm import autograd as tf32x3
from mace_accel.options import AccelOptions
from mace_accel.tolerances import MODEL_TOL, rel_norm_error


class _TorchKernel:
    """The radial_tc kernels as torch computes them (any dtype and device); ``has_backward``:
    the input gradient has its kernel (the wgmma layout) or not (the mma one)."""

    def __init__(self, spec: RadialSpec, calls: list, has_backward: bool = False) -> None:
        self.spec, self.calls, self.has_backward = spec, calls, has_backward

    def backward(self, grad, z, w, sm_share=None):
        self.calls.append("backward")
        weights = unpack_weights(self.spec, w)
        pre = [z[i, :, :h] for i, h in enumerate(self.spec.widths[1:-1])]
        no_w = [False] * len(weights)
        return radial_mlp.vjp(None, weights, pre, grad, False, True, no_w)[0]

    def forward(self, x, w, sm_share=None):
        self.calls.append("forward")
        pre, out = radial_mlp.pre_activations(x, unpack_weights(self.spec, w))
        z = x.new_zeros((len(pre), x.shape[0], self.spec.hidden_width))
        for i, p in enumerate(pre):
            z[i, :, :p.shape[1]] = p
        return out, z


@pytest.fixture(params=[False, True], ids=["layer-backward", "kernel-backward"])
def torch_kernels(monkeypatch, request):
    """Both kernel families stood in for by torch, the whole-net backward with its kernel or
    without; the 3xTF32 path taken for any tensor."""
    calls = []
    monkeypatch.setattr(apply, "_kernel", lambda key, device: _TorchKernel(
        apply.registry.lookup(key), calls, request.param))

    def gemm(a, b, k, n, layout):
        calls.append(("gemm", k, n, layout))
        return a @ (b.t() if layout == "nk" else b)

    def mm_t_silu_grad(g, w, z):
        calls.append("silu_grad")
        s = torch.sigmoid(z)
        return (g @ w.t()) * s * (1 + z * (1 - s))

    def mm_silu(h, w):
        calls.append("silu")
        z = h @ w
        return z, torch.nn.functional.silu(z)

    monkeypatch.setattr(tf32x3, "runs_on", lambda t, k, n: True)
    monkeypatch.setattr(tf32x3, "mm_silu", mm_silu)
    monkeypatch.setattr(tf32x3, "_gemm", gemm)
    monkeypatch.setattr(tf32x3, "mm_t_silu_grad", mm_t_silu_grad)
    return calls


def _weights(widths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(widths[i], widths[i + 1], generator=gen, dtype=torch.float64)
            / widths[i] ** 0.5 for i in range(len(widths) - 1)]


def test_unsupported_widths_are_named():
    assert unsupported_reason((10, 64, 64, 64, 1280)) is None
    assert "hidden layer" in unsupported_reason((10, 1280))
    assert "up to 64" in unsupported_reason((10, 128, 1280))
    assert "multiple of 4" in unsupported_reason((10, 64, 1281))
    with pytest.raises(UnsupportedModelError):
        RadialSpec((10, 96, 64))


@pytest.mark.parametrize("widths", [(10, 64, 64, 64, 1280), (5, 20, 36, 300)])
def test_packing_round_trips_with_zero_padding(widths):
    spec = RadialSpec(widths)
    weights = _weights(widths)
    packed = pack_weights(spec, weights)
    assert packed.shape == (spec.packed_numel,) and packed.is_contiguous()
    assert all(torch.equal(a, b) for a, b in zip(unpack_weights(spec, packed), weights))
    assert float(packed.abs().sum()) == pytest.approx(sum(float(w.abs().sum()) for w in weights))
    with pytest.raises(UnsupportedModelError):
        pack_weights(spec, weights[:-1])


@pytest.mark.parametrize("name", sorted(codegen.CATALOG))
def test_plans_fit_shared_memory_and_sources_name_their_kernels(name):
    plan = codegen.plan_kernel(codegen.CATALOG[name])
    assert 0 < plan.fwd_shared_bytes <= codegen.OPTIN_SHARED
    assert plan.fwd_min_blocks == 2  # two blocks per SM for every catalog net
    assert f"{codegen.kernel_name(plan)}(" in codegen.render_kernel(plan)


@pytest.mark.parametrize("widths", [(10, 16, 16, 12), (5, 20, 36, 300)])
def test_radial_mlp_on_the_kernels_equals_the_reference(torch_kernels, widths):
    spec = RadialSpec(widths)
    weights = _weights(widths)
    whole = radial_mlp.WholeNet(apply.register_spec(spec), pack_weights(spec, weights))
    x = torch.randn(23, widths[0], dtype=torch.float64, requires_grad=True)
    ref = radial_mlp.reference(x, weights)
    g = torch.randn_like(ref)
    (gref,) = torch.autograd.grad(ref, x, g, create_graph=True)
    out = radial_mlp.radial_mlp(x, weights, tf32x3=True, whole=whole)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-13)
    # inference: the backward in its kernel, or on the 3xTF32 layer kernels, from the forward
    # kernel's pre-activations
    (gx,) = torch.autograd.grad(radial_mlp.radial_mlp(x, weights, tf32x3=True, whole=whole),
                                x, g)
    assert torch.allclose(gx, gref, rtol=1e-11, atol=1e-13)
    assert torch_kernels.count("forward") == 2
    kernel_backward = "backward" in torch_kernels
    assert torch_kernels.count("silu_grad") == (0 if kernel_backward else len(widths) - 2)
    # a weight gradient (training) takes the layer kernels either way
    wg = [w.clone().requires_grad_(True) for w in weights]
    grads = torch.autograd.grad(radial_mlp.radial_mlp(x, wg, tf32x3=True, whole=whole),
                                [x, *wg], g)
    refs = torch.autograd.grad(radial_mlp.reference(x, wg), [x, *wg], g)
    assert all(torch.allclose(a, b, rtol=1e-11, atol=1e-13) for a, b in zip(grads, refs))
    assert torch_kernels.count("backward") == (1 if kernel_backward else 0)
    calls = len(torch_kernels)
    # double backward (training on forces): the differentiable torch path
    (gx2,) = torch.autograd.grad(out, x, g, create_graph=True)
    assert torch.allclose(gx2, gref, rtol=1e-11, atol=1e-13)
    dd, dd_ref = (torch.autograd.grad(v.square().sum(), x)[0] for v in (gx2, gref))
    assert torch.allclose(dd, dd_ref, rtol=1e-10, atol=1e-12)
    assert "backward" not in torch_kernels[calls:] and "silu_grad" not in torch_kernels[calls:]


def test_the_whole_net_ends_with_its_linear_layer():
    spec = RadialSpec((3, 8, 8))
    with pytest.raises(ValueError, match="last_act"):
        radial_mlp.radial_mlp(torch.randn(2, 3), _weights(spec.widths), last_act=True,
                              whole=radial_mlp.WholeNet(apply.register_spec(spec),
                                                        torch.zeros(0)))


def _fused_mlp(hs=(8, 16, 16, 12), **options):
    from test_radial_mlp import _net

    from mace_accel.patches.radial.mlp import FusedRadialMLP, spec_or_reason

    net = _net(hs=hs)
    spec, _ = spec_or_reason(net)
    return FusedRadialMLP(net, spec, AccelOptions(backend="cuda", verify=False, **options))


def test_when_the_whole_net_runs(monkeypatch):
    from mace_accel.patches.radial import mlp as patch

    x = torch.randn(5, 8, dtype=torch.float64)
    assert _fused_mlp().route(x).path == "layers"  # not a float32 CUDA tensor
    monkeypatch.setattr(patch, "_cuda_float32", lambda t: True)
    fused = _fused_mlp()
    with torch.no_grad():
        assert fused.route(x).path == "whole" and fused.route(x).full_output
    with torch.no_grad(), monkeypatch.context() as m:
        m.setattr(patch, "_TF32X3", False)
        assert fused.route(x).path == "layers"  # the 3xTF32 kernels switched off
    assert _fused_mlp(hs=(8, 128, 12)).route(x).path == "layers"  # too wide
    for p in fused.parameters():
        p.requires_grad_(True)
    assert fused.route(x).path == "layers"  # training: weight gradients
    with torch.no_grad():
        assert fused.route(x).path == "whole"
    folded = _fused_mlp(recompute_tp_weights="always")
    folded.fold_last = True
    with torch.no_grad():  # the conv recomputes the TP weights itself: it takes the hidden
        route = folded.route(x)
        assert route.path == "layers" and not route.full_output and route.recompute
    folded = _fused_mlp(recompute_tp_weights="never")
    folded.fold_last = True
    with torch.no_grad():
        route = folded.route(x)
        assert route.path == "whole" and route.full_output and not route.recompute
    assert "one tensor-core kernel" in fused.describe()


def test_the_conv_follows_the_route_of_the_mlps_call():
    """The folded conv reads the route of the call whose output it is handed (scaled, say),
    and makes the same decision itself for a call its MLP did not route."""
    folded = _fused_mlp(recompute_tp_weights="always")
    folded.fold_last = True
    x = torch.randn(7, 8, dtype=torch.float64)
    with torch.no_grad():
        hidden = folded(x)
    assert hidden.shape == (7, 16)
    route = folded.route_for(hidden * 0.5)
    assert route is folded._kernels["route"] and not route.full_output and route.recompute
    other = folded.route_for(torch.zeros(3, 16, dtype=torch.float64))  # another call's size
    assert other is not route and other == folded.route(torch.zeros(3, 8, dtype=torch.float64))


@pytest.mark.parametrize("recompute", ["never", "always"])
def test_model_on_the_kernels_matches_unpatched(recompute, tiny_model, torch_kernels,
                                                monkeypatch):
    """The folded blocks take the full TP weights from the whole-net kernel (or, recomputing
    them, the hidden activations as before); energies, forces, stress as unpatched."""
    from mace_accel import accelerate
    from mace_accel.models.batch import atoms_to_batch, model_info, random_structure
    from mace_accel.patches.radial import mlp as patch
    from mace_accel.surgery import evaluate

    model = tiny_model("RealAgnosticResidualInteractionBlock", hidden_irreps="8x0e+8x1o",
                       dtype=torch.float64, seed=1)
    info = model_info(model)
    batch = atoms_to_batch(random_structure(info.atomic_numbers, n_atoms=9, r_max=info.r_max,
                                            seed=2), info)
    before = evaluate(model, batch, compute_stress=True)
    accelerate(model, options=AccelOptions(backend="reference", recompute_tp_weights=recompute))
    monkeypatch.setattr(patch, "_cuda_float32", lambda t: True)
    monkeypatch.setattr(patch.FusedRadialMLP, "_tf32x3", lambda self: True)
    for p in model.parameters():
        p.requires_grad_(False)
    after = evaluate(model, batch, compute_stress=True)
    for key in ("energy", "forces", "stress"):
        assert rel_norm_error(after[key], before[key]) <= MODEL_TOL[torch.float64], key
    assert ("forward" in torch_kernels) == (recompute == "never")


def test_row_limit_counts_rows_not_the_output_width():
    """The radial and 3xTF32 kernels index rows in int32 and every global offset in 64 bits: a
    MACE-MP-large call (539,136 edges of 2,560 TP weights each, 1.4e9 floats) is in range; only
    the row count itself is bounded."""
    from mace_accel.errors import KernelError
    from mace_accel.ops.runtime import INT32_MAX, check_rows

    check_rows(539_136, codegen.BM, "the radial MLP kernel")
    check_rows(INT32_MAX // 64, codegen.BM, "the radial MLP kernel")
    with pytest.raises(KernelError, match="int32 row index"):
        check_rows(INT32_MAX - 10, codegen.BM, "the radial MLP kernel")


def _uncanonical(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return flat.reshape(rows // 8, cols // 4, 8, 4).permute(0, 2, 1, 3).reshape(rows, cols)


@pytest.mark.parametrize("name", sorted(codegen.CATALOG))
def test_wgmma_packing_holds_the_split_weights_in_the_canonical_layout(name):
    """Every layer's big + small parts, read back at the kernel's canonical offsets, are the
    float32 weight (exactly), big is TF32 (its low 13 bits clear) and the padding is zero."""
    from mace_accel.ops.radial.tc import wgmma

    spec = codegen.CATALOG[name]
    plan = wgmma.plan_kernel(spec, bn=40)  # 1280 and 1792 in whole tiles, 512 not
    weights = [w.float() for w in _weights(spec.widths)]
    packed = wgmma.pack_weights(plan, spec, weights)
    assert packed.numel() == plan.packed_numel and packed.dtype == torch.float32
    for layer, w in zip(plan.hidden, weights[:-1]):
        n, k = layer["n"], layer["k"]
        big = _uncanonical(packed[layer["big"]:layer["big"] + n * k], n, k)
        small = _uncanonical(packed[layer["small"]:layer["small"] + n * k], n, k)
        assert not (big.contiguous().view(torch.int32) & 0x1fff).any()
        assert torch.equal((big + small)[:w.shape[1], :w.shape[0]], w.t())
        assert not (big + small)[w.shape[1]:].any() and not (big + small)[:, w.shape[0]:].any()
    tiles = []
    for nt in range(plan.n_tiles):
        at = plan.hidden_floats + nt * plan.tile_floats
        half = plan.tile_floats // 2
        tiles.append(_uncanonical(packed[at:at + half], plan.bn, plan.kl)
                     + _uncanonical(packed[at + half:at + 2 * half], plan.bn, plan.kl))
    last = torch.cat(tiles)
    w = weights[-1]
    assert torch.equal(last[:w.shape[1], :w.shape[0]], w.t())
    assert not last[w.shape[1]:].any() and not last[:, w.shape[0]:].any()


def test_wgmma_backward_orders_match_the_register_fragments():
    """The K orders of the backward's packed weights are the columns the registers hold: a
    thread ``t`` of the last layer reads columns ``4t .. 4t + 3`` of each group of 16 and hands
    ``4t + 2u`` / ``4t + 2u + 1`` to k8 step ``2q + u`` as its columns ``t`` / ``t + 4``; a hidden
    layer's thread holds accumulator columns ``8j + 2t`` / ``8j + 2t + 1``, step ``j``'s ``t`` /
    ``t + 4``. Both orders are permutations."""
    from mace_accel.ops.radial.tc.wgmma_backward import CK, chunk_order, step_order

    chunk, step = chunk_order(CK), step_order(64)
    assert sorted(chunk) == list(range(CK)) and sorted(step) == list(range(64))
    for t in range(4):
        for q in range(CK // 16):
            for u in range(2):
                s = 2 * q + u
                assert chunk[8 * s + t] == 16 * q + 4 * t + 2 * u
                assert chunk[8 * s + t + 4] == 16 * q + 4 * t + 2 * u + 1
        for j in range(8):
            assert step[8 * j + t] == 8 * j + 2 * t and step[8 * j + t + 4] == 8 * j + 2 * t + 1


@pytest.mark.parametrize("name", sorted(codegen.CATALOG))
def test_wgmma_backward_packing_holds_the_split_weights_in_k_order(name):
    """Every GEMM of the backward, read back at the kernel's canonical offsets and its K order
    undone, is the float32 weight (exactly: big + small), big is TF32 and the padding is zero;
    the last layer's chunks cover its padded columns."""
    from mace_accel.ops.radial.tc import wgmma_backward as wb

    spec = codegen.CATALOG[name]
    plan = wb.plan_backward(spec)
    weights = [w.float() for w in _weights(spec.widths)]
    packed = wb.pack_backward(plan, spec, weights)
    assert packed.numel() == plan.packed_numel and packed.dtype == torch.float32

    def read(at: int, rows: int, cols: int, order) -> torch.Tensor:
        big = _uncanonical(packed[at:at + rows * cols], rows, cols)
        small = _uncanonical(packed[at + rows * cols:at + 2 * rows * cols], rows, cols)
        assert not (big.contiguous().view(torch.int32) & 0x1fff).any()
        out = torch.empty_like(big)
        out[:, torch.tensor(order)] = big + small
        return out

    n_hidden = len(spec.widths) - 2
    assert [layer["z"] for layer in plan.layers] == list(range(n_hidden - 2, -1, -1)) + [None]
    for layer, i in zip(plan.layers, range(n_hidden - 1, -1, -1)):
        m = read(layer["big"], layer["n"], layer["k"], wb.step_order(layer["k"]))
        w = weights[i]
        assert torch.equal(m[:w.shape[0], :w.shape[1]], w)
        assert not m[w.shape[0]:].any() and not m[:, w.shape[1]:].any()
    chunks = [read(plan.hidden_floats + c * plan.stage_floats, plan.kh, wb.CK,
                   wb.chunk_order(wb.CK)) for c in range(plan.n_chunks)]
    last, w = torch.cat(chunks, dim=1), weights[-1]
    assert last.shape[1] == plan.n_chunks * wb.CK >= w.shape[1]
    assert torch.equal(last[:w.shape[0], :w.shape[1]], w)
    assert not last[w.shape[0]:].any() and not last[:, w.shape[1]:].any()
