"""The float64 tensor-core SiLU MLP without a GPU: the fragment packing and the kernels' data
flow, emulated lane by lane with the m16n8k8 fragment layout of the PTX ISA, equal the plain
MLP (forward and d x); plans, shared memory, sources, and where the kernels do not run.
test_gpu_silu_mlp.py runs the kernels themselves against the reference."""

from __future__ import annotations

import pytest
import torch

from mace_accel.ops.radial import mlp as radial_mlp
from mace_accel.errors import UnsupportedModelError
from mace_accel.ops.radial.silu_mlp import dmma
from mace_accel.ops.radial.silu_mlp.catalog import CATALOG
from mace_accel.ops.radial.silu_mlp.spec import SiluMLPSpec, fragments, pack_weights

from dmma_emulation import load as _load, product as _product, store as _store

TC_SPECS = sorted(n for n, s in CATALOG.items() if dmma.unsupported_reason(s, "sm_90") is None)


def _weights(spec, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(a, b, generator=gen, dtype=torch.float64) / a ** 0.5
            for a, b in zip(spec.widths[:-1], spec.widths[1:])]


def _emulate(spec, packed, x, g):
    """The DMMA kernels' forward (keeping each layer's slope) and backward from the kept
    slopes on one warp's 16 rows, from the packed buffer."""
    plan = dmma.plan_kernels(spec)
    base = plan.src
    frag = lambda off, layer: packed[base + 2 * off:][:64 * layer["kt"] * layer["nt"]]  # noqa
    silu_grad = lambda z: torch.sigmoid(z) * (1 + z * (1 - torch.sigmoid(z)))  # noqa: E731
    h, slopes = _load(x, plan.tiles[0]), []
    for layer in plan.layers:
        z = _product(h, frag(layer["fwd"], layer), layer["kt"], layer["nt"])
        slopes.append(silu_grad(z))
        h = z * torch.sigmoid(z)
    out = _store(h, spec.widths[-1])
    d = _load(g, plan.tiles[-1]) * slopes[-1]
    for i in range(spec.n_layers - 1, -1, -1):
        layer = plan.layers[i]
        d = _product(d, frag(layer["bwd"], dict(kt=layer["nt"], nt=layer["kt"])),
                     layer["nt"], layer["kt"])
        if i:
            d = d * slopes[i - 1]
    return out, _store(d, spec.widths[0])


@pytest.mark.parametrize("name", TC_SPECS)
def test_emulated_kernels_equal_the_mlp(name):
    spec = CATALOG[name]
    weights = _weights(spec)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, spec.widths[0], generator=gen, dtype=torch.float64).requires_grad_(True)
    g = torch.randn(16, spec.widths[-1], generator=gen, dtype=torch.float64)
    want = radial_mlp.reference(x, weights, last_act=True)
    (want_gx,) = torch.autograd.grad(want, x, g)
    out, gx = _emulate(spec, pack_weights(spec, weights), x.detach(), g)
    assert torch.allclose(out, want, rtol=1e-13, atol=1e-14)
    assert torch.allclose(gx, want_gx, rtol=1e-12, atol=1e-13)


def test_fragments_hold_the_permuted_pairs():
    b = torch.arange(16 * 24, dtype=torch.float64).view(16, 24)
    f = fragments(b).view(2, 3, 32, 2)
    for kt in range(2):
        for nt in range(3):
            for lane in (0, 5, 31):
                g, t = divmod(lane, 4)
                assert f[kt, nt, lane, 0] == b[8 * kt + 2 * t, 8 * nt + g]
                assert f[kt, nt, lane, 1] == b[8 * kt + 2 * t + 1, 8 * nt + g]


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_packed_sections_line_up(name):
    spec = CATALOG[name]
    packed = pack_weights(spec, _weights(spec))
    assert packed.numel() == spec.packed_numel
    f = spec.fragment_widths
    offsets = spec.fragment_offsets()
    assert offsets[0][0] == spec.fragment_start
    for i, (fwd, bwd) in enumerate(offsets):
        assert fwd % 64 == 0 and bwd % 64 == 0  # 16-byte aligned double2 tiles
        assert bwd - fwd == sum(f[j] * f[j + 1] for j in range(spec.n_layers))
    last = offsets[-1][1] + f[-2] * f[-1]
    assert last == spec.packed_numel


@pytest.mark.parametrize("name", TC_SPECS)
def test_plans_fit_and_render(name):
    spec = CATALOG[name]
    plan = dmma.plan_kernels(spec)
    assert plan.kept_backward_shared_bytes <= dmma.SHARED_LIMIT
    assert plan.forward_shared_bytes <= dmma.SHARED_LIMIT
    assert plan.grid(0) == 1 and plan.grid(10 ** 9, 132) == 132 and plan.grid(17, 132) == 1
    fwd, bwd = dmma.render_forward(plan), dmma.render_backward_kept(plan)
    names = dmma.kernel_names(plan)
    assert len(names) == 2 and names[0] in fwd and names[1] in bwd and names[0] != names[1]
    assert fwd.count("product<") == spec.n_layers  # one per layer
    assert f"#define H0 {spec.widths[0]}" in fwd and "mma.sync.aligned.m16n8k8" in bwd
    assert bwd.count("product<") == spec.n_layers  # one per layer back
    assert bwd.count("times_slope<") == spec.n_layers  # g and every layer below the last
    # the slopes: a 16-edge tile's part holds every layer's output fragments, in order
    assert plan.slope_offsets[0] == 0 and plan.slope_d2 == 64 * sum(plan.tiles[1:])
    assert plan.slopes_numel(17) == 2 * 2 * plan.slope_d2


def test_fake_keep_op_gives_the_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mace_accel.ops.radial.silu_mlp import autograd

    spec = CATALOG["mace"]
    key = autograd.register_spec(spec)
    plan = dmma.plan_kernels(spec)
    with FakeTensorMode():
        x = torch.empty(33, 8, dtype=torch.float64)
        w = torch.empty(spec.packed_numel, dtype=torch.float64)
        out, slopes = autograd.silu_mlp_keep_op(x, w, key)
        gx = autograd.silu_mlp_kept_backward_op(slopes, w, out, key)
    assert out.shape == (33, 64) and slopes.shape == (plan.slopes_numel(33),)
    assert gx.shape == (33, 8)


def test_where_the_tensor_core_kernels_do_not_run():
    assert "sm_90" in dmma.unsupported_reason(CATALOG["mace"], "sm_80")
    with pytest.raises(UnsupportedModelError, match="up to 64"):
        SiluMLPSpec((8, 256, 256))  # a warp's row of each layer is held in registers
    assert dmma.unsupported_reason(SiluMLPSpec((8, 32, 32, 32, 32, 32)), "sm_90") is None
    # no kernel holds W and W^T at once: the forward's W of 4 layers and its 12 warps' SiLU
    # slabs fit (196 KB), of 5 layers not (228 KB)
    assert dmma.unsupported_reason(SiluMLPSpec((8, 64, 64, 64, 64)), "sm_90") is None
    deep = SiluMLPSpec((8, 64, 64, 64, 64, 64))
    assert dmma.plan_kernels(deep).forward_shared_bytes > dmma.SHARED_LIMIT
    assert "shared memory" in dmma.unsupported_reason(deep, "sm_90")


def test_catalog_sources_are_the_tensor_core_kernels():
    from mace_accel.ops.limits import DeviceLimits

    names = [n for n, _ in dmma.catalog_sources(DeviceLimits())]
    assert len(names) == 2 * len(TC_SPECS) and "silu_mlp/mace_dmma_bwd_kept_float64" in names
    assert sorted(names) == sorted(f"silu_mlp/{spec}_dmma_{kernel}_float64" for spec in TC_SPECS
                                   for kernel in ("fwd", "bwd_kept"))
    assert not list(dmma.catalog_sources(DeviceLimits(arch="sm_80")))
