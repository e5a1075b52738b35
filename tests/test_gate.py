"""The one-split forward of mace's gated non-linearity (mace_accel.patches.gate) equals mace's
own bit for bit, forward, backward and double backward; it is installed with the non-linear
block's fused forward, reported as fused and removed by revert; other layouts keep mace's."""

from __future__ import annotations

import pytest
import torch
from e3nn import o3
from mace.modules.gate import GatedEquivariantBlock

from mace_accel.patches import gate as split_gate

F64 = torch.float64


def _gate(scalars="8x0e", gated="8x1o+4x2e+8x3o", act=torch.nn.functional.silu,
          gate_act=None, layout="mul_ir"):
    irreps_gated = o3.Irreps(gated)
    irreps_gates = o3.Irreps([(mul, "0e") for mul, _ in irreps_gated])
    gate_act = act if gate_act is None else gate_act
    return GatedEquivariantBlock(o3.Irreps(scalars), [act], irreps_gates,
                                 [gate_act] * len(irreps_gates), irreps_gated, layout=layout)


@pytest.mark.parametrize("gated", ["8x1o+4x2e+8x3o", "4x1o", "8x2e+8x1o"])
@pytest.mark.parametrize("gate_act", [None, torch.sigmoid])
def test_the_split_forward_is_maces_bit_for_bit(gated, gate_act):
    module = _gate(gated=gated, gate_act=gate_act)
    layout = split_gate.layout_of(module)
    assert layout is not None
    x = torch.randn(7, module.irreps_in.dim, dtype=F64, requires_grad=True)
    want = module(x)
    (want_gx,) = torch.autograd.grad(want, x, torch.ones_like(want), create_graph=True)
    (want_hx,) = torch.autograd.grad(want_gx.square().sum(), x)
    split_gate.install(module)
    assert isinstance(module.__dict__.get("forward"), split_gate.SplitGate)
    got = module(x)
    (got_gx,) = torch.autograd.grad(got, x, torch.ones_like(got), create_graph=True)
    (got_hx,) = torch.autograd.grad(got_gx.square().sum(), x)
    assert torch.equal(got, want) and torch.equal(got_gx, want_gx)
    assert torch.equal(got_hx, want_hx)
    split_gate.remove(module)
    assert "forward" not in module.__dict__


def test_the_split_forward_launches_fewer_ops():
    """The point of it: fewer torch ops (kernel launches on a GPU) a forward + backward."""
    from torch.profiler import ProfilerActivity, profile

    module = _gate()
    x = torch.randn(5, module.irreps_in.dim, requires_grad=True)

    def ops() -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            torch.autograd.grad(module(x).sum(), x)
        return sum(e.count for e in prof.key_averages()
                   if e.key in ("aten::fill_", "aten::copy_", "aten::add_", "aten::zero_",
                                "aten::zeros", "aten::cat", "aten::mul", "aten::silu",
                                "aten::silu_backward", "aten::sum", "aten::narrow_copy"))

    plain = ops()
    split_gate.install(module)
    assert ops() < plain


def test_layouts_one_split_cannot_take_keep_maces_forward():
    assert split_gate.layout_of(_gate(layout="ir_mul")) is None
    assert split_gate.layout_of(_gate(scalars="8x0e", gated="")) is None  # scalars only
    assert split_gate.layout_of(torch.nn.Identity()) is None
    module = _gate(layout="ir_mul")
    split_gate.install(module)
    assert "forward" not in module.__dict__
    split_gate.install(None)  # a block without a gate


def test_the_non_linear_blocks_gates_take_it_are_reported_fused_and_reverted():
    import mace_accel
    from mace_accel.coverage import FUSED, account
    from mace_accel.models.architectures import build_model
    from test_coverage import SMALL

    model = build_model(SMALL["non-linear"], dtype=F64)
    gates = [b.equivariant_nonlin for b in model.interactions]
    report = mace_accel.accelerate(model, backend="reference")
    assert max(report.verification.values()) <= report.tolerance
    assert all(isinstance(g.__dict__.get("forward"), split_gate.SplitGate) for g in gates)
    statuses = {s.path: s.status for s in account(model)}
    assert all(statuses[f"interactions.{i}.equivariant_nonlin"] == FUSED
               for i in range(len(gates)))
    assert "GatedEquivariantBlock" not in {m.block for m in report.mace_built}
    mace_accel.revert(model)
    assert all("forward" not in g.__dict__ for g in gates)


def test_kernel_spec_matches_the_gate_and_its_reference_is_maces():
    """The kernels' layout of a gate (scalars, gates, gated groups in input order, each group's
    gates where mace reads them) and their torch reference: ``gate(x / d + res)`` as mace
    computes it, to rounding, for gated groups whose gates come in another order."""
    from mace_accel.ops import gate as gate_ops

    for gated in ("8x1o+4x2e+8x3o", "8x2e+8x1o"):
        module = _gate(gated=gated, gate_act=torch.sigmoid)
        spec = split_gate.kernel_spec(module, split_gate.layout_of(module))
        assert spec is not None and spec.d_in == module.irreps_in.dim
        assert (spec.act_scalar, spec.act_gate) == ("silu", "sigmoid")
        gen = torch.Generator().manual_seed(1)
        x, res = (torch.randn(6, spec.d_in, generator=gen, dtype=F64) for _ in range(2))
        d = torch.rand(6, 1, generator=gen, dtype=F64) + 0.5
        want = module(x / d + res)
        assert want.shape == (6, spec.d_out)
        assert torch.allclose(gate_ops.reference(spec, x, d, res), want, rtol=1e-14,
                              atol=1e-14)
        # on the CPU the kernels' entry point is the reference
        assert torch.equal(gate_ops.gate_residual(spec, x, d, res),
                           gate_ops.reference(spec, x, d, res))


def test_kernel_spec_refuses_activations_the_kernels_lack():
    from mace_accel.ops import gate as gate_ops

    module = _gate(act=torch.tanh)
    assert split_gate.kernel_spec(module, split_gate.layout_of(module)) is None
    split_gate.install(module)
    assert split_gate.spec_of(module) is None and split_gate.spec_of(None) is None
    with pytest.raises(ValueError, match="tile"):
        gate_ops.GateSpec(4, 24, (gate_ops.GatedGroup(8, 4, 3, 4, 4),), "silu", 1.0,
                          "sigmoid", 1.0)
    with pytest.raises(ValueError, match="activations"):
        gate_ops.GateSpec(4, 4, (), "tanh", 1.0, "none", 1.0)


def test_mh1_gate_catalog_renders_its_layout():
    from mace_accel.ops import gate as gate_ops

    spec = gate_ops.MH1_GATE
    assert (spec.d_in, spec.d_out) == (9728, 8192)
    sources = dict(gate_ops.catalog_sources(None))
    assert sorted(sources) == ["glue/gate_mh1_float32", "glue/gate_mh1_float64"]
    src = sources["glue/gate_mh1_float32"]
    for name in gate_ops.kernel_names(spec, "float32"):
        assert name in src
    assert "expf" in src and "512 x 7 from column 6144, gates from 1536" in src


def test_a_residual_of_leading_columns_reads_the_rest_as_zero():
    """``res [N, r]`` (the columns MH-1's linear_res feeds) is the whole residual padded with
    zeros: in the kernels' reference and in mace's steps (``gated`` off the kernels), with the
    gradient of the leading columns only; the non-linear blocks of a small MH-1-like model
    take it (their first linear_res feeds only the scalars)."""
    from mace_accel.models.architectures import build_model
    from mace_accel.ops import gate as gate_ops
    from mace_accel.options import AccelOptions
    from mace_accel.patches import nonlinear_block
    from mace_accel.patches.linears import FusedLinear
    from test_coverage import SMALL

    module = _gate(gate_act=torch.sigmoid)
    spec = split_gate.kernel_spec(module, split_gate.layout_of(module))
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, spec.d_in, generator=gen, dtype=F64)
    d = torch.rand(5, 1, generator=gen, dtype=F64) + 0.5
    for r in (0, 8, 21, spec.d_in):
        res = torch.randn(5, r, generator=gen, dtype=F64, requires_grad=True)
        padded = torch.cat([res, res.new_zeros(5, spec.d_in - r)], dim=1)
        want = module(x / d + padded)
        got = gate_ops.reference(spec, x, d, res)
        assert torch.allclose(got, want, rtol=1e-14, atol=1e-14)
        assert torch.equal(nonlinear_block.gated(module, x, d, res), module(x / d + padded))
        g = torch.randn_like(want)
        (ga,) = torch.autograd.grad(got, res, g)
        (gw,) = torch.autograd.grad(module(x / d + padded), res, g)
        assert ga.shape == (5, r) and torch.allclose(ga, gw, rtol=1e-13, atol=1e-14)
    model = build_model(SMALL["non-linear"], dtype=F64)
    first = FusedLinear(model.interactions[0].linear_res,
                        AccelOptions(backend="reference", verify=False))
    fed = first.spec.fed_prefix()
    assert fed is not None and fed.dim_out < first.spec.dim_out
