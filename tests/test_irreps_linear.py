"""The equivariant linear op (:mod:`mace_accel.ops.irreps_linear`) on the CPU: the reference
equals e3nn's ``o3.Linear`` and MACE's one-hot skip tensor product through the fused modules,
the backward is the transposed map, double backward is exact, weights are cached only when
nothing can change them, bad input is refused."""

from __future__ import annotations

import pytest
import torch

from mace_accel.errors import InputError
from mace_accel.ops.irreps_linear import autograd, codegen
from mace_accel.ops.irreps_linear.catalog import CATALOG
from mace_accel.ops.irreps_linear.spec import (Block, LinearInstruction, LinearSpec, skip_reason,
                                                transpose_weights)
from mace_accel.options import AccelOptions
from mace_accel.patches.linears import FusedLinear, FusedSkip, linear_reason

OPTIONS = AccelOptions(backend="reference", verify=False)


def _o3():
    from mace_accel._e3nn_compat import o3

    return o3()


def _linear(irreps_in="8x0e+8x1o+4x0e+8x2e", irreps_out="6x0e+8x1o+5x2e+3x3o"):
    torch.manual_seed(0)
    o3 = _o3()
    return o3.Linear(o3.Irreps(irreps_in), o3.Irreps(irreps_out)).double()


def _skip():
    torch.manual_seed(0)
    o3 = _o3()
    return o3.FullyConnectedTensorProduct(o3.Irreps("8x0e+8x1o+8x2e+4x3o"), o3.Irreps("5x0e"),
                                          o3.Irreps("8x0e+6x1o+8x2e")).double()


def test_linear_equals_e3nn_with_gradients():
    lin = _linear()
    fused = FusedLinear(lin, OPTIONS)
    x = torch.randn(9, lin.irreps_in.dim, dtype=torch.float64, requires_grad=True)
    ref, out = lin(x), fused(x)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-13)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, [x, lin.weight], g),
                    torch.autograd.grad(ref, [x, lin.weight], g)):
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-12)


def test_fed_columns_are_the_leading_columns_and_their_gradients():
    """A map whose trailing output blocks no input feeds (MH-1's linear_res: 0e in, 0e/1o/2e/3o
    out): ``fed_columns`` is the output's leading columns, the rest of which is zero, with the
    same gradients as the whole output's leading columns; the gemm path takes the same weights
    for the map and its prefix (one cache entry each)."""
    from mace_accel.ops.irreps_linear import gemm

    lin = _linear("8x0e+4x1o", "6x0e+8x1o+5x2e+3x3o")
    fused = FusedLinear(lin, OPTIONS)
    fed = fused.spec.fed_prefix()
    assert fed is not None and fed.dim_out == 6 + 8 * 3 and fed.instructions == \
        fused.spec.instructions
    x = torch.randn(9, lin.irreps_in.dim, dtype=torch.float64, requires_grad=True)
    whole, lead = lin(x), fused.fed_columns(x)
    assert lead.shape == (9, fed.dim_out)
    assert torch.allclose(lead, whole[:, :fed.dim_out], rtol=1e-12, atol=1e-13)
    assert torch.equal(whole[:, fed.dim_out:], torch.zeros_like(whole[:, fed.dim_out:]))
    g = torch.randn_like(lead)
    for a, b in zip(torch.autograd.grad(lead, [x, lin.weight], g),
                    torch.autograd.grad(whole[:, :fed.dim_out], [x, lin.weight], g)):
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-12)
    w = torch.randn(fed.weight_numel, dtype=torch.float64)
    xs = x.detach()
    assert torch.allclose(gemm.apply(fed, xs, w), gemm.apply(fused.spec, xs, w)[:, :fed.dim_out],
                          rtol=1e-13, atol=1e-13)
    assert gemm.apply(fed, xs, w).shape == (9, fed.dim_out)
    # every block fed: no prefix, fed_columns is the whole map
    full = FusedLinear(_linear("8x0e+4x1o", "6x0e+8x1o"), OPTIONS)
    assert full.spec.fed_prefix() is None
    x2 = torch.randn(3, full.spec.dim_in, dtype=torch.float64)
    assert torch.equal(full.fed_columns(x2), full(x2))


def test_skip_equals_e3nn_tensor_product_with_one_hot_attributes():
    skip = _skip()
    fused = FusedSkip(skip, OPTIONS)
    x = torch.randn(7, skip.irreps_in1.dim, dtype=torch.float64, requires_grad=True)
    y = torch.nn.functional.one_hot(torch.tensor([0, 4, 1, 2, 3, 4, 0]), 5).double()
    ref, out = skip(x, y), fused(x, y)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-13)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, [x, skip.weight], g),
                    torch.autograd.grad(ref, [x, skip.weight], g)):
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-12)


def test_double_backward_matches_e3nn():
    skip = _skip()
    fused = FusedSkip(skip, OPTIONS)
    x = torch.randn(6, skip.irreps_in1.dim, dtype=torch.float64, requires_grad=True)
    y = torch.nn.functional.one_hot(torch.tensor([0, 4, 1, 2, 3, 4]), 5).double()
    v = torch.randn_like(x)
    results = []
    for call in (lambda: skip(x, y), lambda: fused(x, y)):
        (gx,) = torch.autograd.grad(call().pow(2).sum(), x, create_graph=True)
        results.append(torch.autograd.grad((gx * v).sum(), [x, skip.weight]))
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_eager_calls_equal_the_custom_op_to_the_second_derivative():
    """Eager calls skip torch's dispatcher (:mod:`mace_accel.ops.custom_op`); torch.compile
    traces the registered op (``.op``): both give the same values, gradients and double
    backward, weights included."""
    from mace_accel.ops.irreps_linear import spec as linear_spec

    lin = _linear()
    spec = linear_spec.linear_spec(lin)
    key = autograd.register_spec(spec)
    scales = linear_spec.linear_scales(lin)
    x = torch.randn(5, spec.dim_in, dtype=torch.float64, requires_grad=True)
    elem = x.new_empty((0,), dtype=torch.int32)
    results = []
    for call in (autograd.linear_op.op, autograd.linear_op):
        w = linear_spec.effective_weights(spec, lin.weight, scales, False)
        y = call(x, w, transpose_weights(spec, w), elem, key, "reference")
        (gx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
        results.append((y, gx) + torch.autograd.grad(gx.pow(2).sum(), [lin.weight, x]))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    with torch.no_grad():
        assert torch.equal(autograd.linear_op(x, w, w, elem, key, "reference"), results[0][0])


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_transposed_spec_is_the_adjoint(name):
    spec = CATALOG[name]
    key = autograd.register_spec(spec)
    key_t = autograd.register_spec(spec.transposed())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, spec.dim_in, generator=gen, dtype=torch.float64)
    g = torch.randn(4, spec.dim_out, generator=gen, dtype=torch.float64)
    w = torch.randn(spec.weight_numel, generator=gen, dtype=torch.float64)
    elem = torch.randint(0, spec.num_elements, (4,), generator=gen, dtype=torch.int32)
    wt = transpose_weights(spec, w)
    lhs = (autograd.linear_op(x, w, wt, elem, key, "reference") * g).sum()
    rhs = (autograd.linear_op(g, wt, w, elem, key_t, "reference") * x).sum()
    assert torch.allclose(lhs, rhs, rtol=1e-12)


def test_weights_are_cached_until_a_parameter_changes():
    lin = _linear()
    lin.weight.requires_grad_(False)
    fused = FusedLinear(lin, OPTIONS)
    x = torch.randn(3, lin.irreps_in.dim, dtype=torch.float64)
    fused(x)
    first = fused._kernels["weights"][1]
    fused(x)
    assert fused._kernels["weights"][1] is first
    with torch.no_grad():
        lin.weight.mul_(3.0)
    assert torch.allclose(fused(x), lin(x), rtol=1e-12, atol=1e-13)
    assert fused._kernels["weights"][1] is not first


def test_skip_refuses_attributes_that_are_not_one_hot():
    fused = FusedSkip(_skip(), OPTIONS.replace(check_indices=True))
    x = torch.randn(2, fused.spec.dim_in, dtype=torch.float64)
    with pytest.raises(InputError, match="not one-hot"):
        fused(x, torch.full((2, 5), 0.2, dtype=torch.float64))
    with pytest.raises(InputError, match=r"node_attrs must have shape \[2, 5\]"):
        fused(x, torch.zeros(2, 4, dtype=torch.float64))


def test_modules_the_op_cannot_take_are_named():
    o3 = _o3()
    with_bias = o3.Linear(o3.Irreps("4x0e"), o3.Irreps("4x0e"), biases=True)
    assert "biases" in linear_reason(with_bias)
    assert "not an e3nn o3.Linear" in linear_reason(torch.nn.Linear(2, 2))
    vector_attrs = o3.FullyConnectedTensorProduct(o3.Irreps("4x0e"), o3.Irreps("1x1o"),
                                                  o3.Irreps("4x1o"))
    assert "not one block of scalars" in skip_reason(vector_attrs)


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_plan_fits_the_static_shared_memory(name):
    for spec in (CATALOG[name], CATALOG[name].transposed()):
        for dtype, size in (("float32", 4), ("float64", 8)):
            plan = codegen.plan_kernel(spec, dtype)
            assert plan.buffer * size <= 48 * 1024
            assert plan.tile_nodes % plan.vec_width == 0 and plan.threads % 32 == 0
            for blk in plan.out_blocks:
                for ins in blk["instructions"]:
                    assert plan.tile_nodes * ins["chunk"] * blk["d"] <= plan.buffer
            assert plan.k_split * plan.tile_nodes * max(b["d"] for b in plan.out_blocks) * 32 \
                <= plan.buffer
            grid = plan.grid(10**6)
            assert grid[1] == len(spec.out_blocks)
            assert grid[2] * 32 * plan.v_tile >= max(b.mul for b in spec.out_blocks)


def test_high_l_blocks_get_a_geometry_that_fits():
    """L = 6 (d = 13) in float64: the default 4 warps x 4 nodes would need 53 KB for the partial
    sums; the plan takes fewer warps instead, and a map that fits not even one warp of two
    nodes (L = 50) is refused with the sizes."""
    spec = LinearSpec((Block(0, 128, 13),), (Block(0, 128, 13),), (LinearInstruction(0, 0, 0),))
    plan = codegen.plan_kernel(spec, "float64")
    assert plan.buffer * 8 <= codegen.STATIC_SHARED and plan.k_split < codegen.MAX_K_SPLIT
    huge = LinearSpec((Block(0, 32, 101),), (Block(0, 32, 101),), (LinearInstruction(0, 0, 0),))
    with pytest.raises(ValueError, match="shared memory"):
        codegen.plan_kernel(huge, "float64")


def test_wide_blocks_are_staged_in_chunks():
    plan = codegen.plan_kernel(CATALOG["wide"], "float64")  # the GPU tests run this one
    (first,) = plan.out_blocks[0]["instructions"]
    assert first["chunk"] < 384 and plan.buffer * 8 <= codegen.TILE_BYTES


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_gemm_path_equals_the_reference(name):
    """The float64 cuBLAS path (ops/irreps_linear/gemm.py) is the same map, and its transpose
    applies the transposed weights (the backward)."""
    from mace_accel.ops.irreps_linear import gemm
    from mace_accel.ops.irreps_linear.spec import transpose_weights

    spec = CATALOG[name]
    if not gemm.runs_on(spec):
        assert spec.indexed
        return
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, spec.dim_in, generator=gen, dtype=torch.float64)
    w = torch.randn(spec.weight_numel, generator=gen, dtype=torch.float64)
    elem = torch.zeros(37, dtype=torch.int32)
    want = autograd.reference(spec, x, w, elem)
    assert torch.allclose(gemm.apply(spec, x, w), want, rtol=1e-13, atol=1e-13)
    g = torch.randn_like(want)
    want_t = autograd.reference(spec.transposed(), g, transpose_weights(spec, w), elem)
    got_t = gemm.apply(spec.transposed(), g, transpose_weights(spec, w))
    assert torch.allclose(got_t, want_t, rtol=1e-13, atol=1e-13)


def test_prepared_gemms_live_as_long_as_their_weights():
    """A captured CUDA graph reads a map's prepared (split, packed) weights: they stay while the
    weights tensor lives, however many maps there are, and go with it."""
    import gc

    from mace_accel.ops.irreps_linear import gemm

    spec = CATALOG[sorted(CATALOG)[0]]
    if not gemm.runs_on(spec):
        spec = next(s for s in CATALOG.values() if gemm.runs_on(s))
    weights = [torch.randn(spec.weight_numel, dtype=torch.float64) for _ in range(80)]
    prepared = [gemm._prepared(spec, w) for w in weights]
    assert all(gemm._prepared(spec, w) is p for w, p in zip(weights, prepared))
    keys = [(id(w), id(spec)) for w in weights]
    assert all(k in gemm._PREPARED for k in keys)
    del weights, prepared
    gc.collect()
    assert not any(k in gemm._PREPARED for k in keys)


def test_grouped_maps_take_contiguous_16_byte_aligned_tensors_only():
    """One predicate (``runtime.is_aligned16``): the grouped kernel's yes/no and the checks
    that refuse a misaligned tensor before a launch agree."""
    from mace_accel.errors import KernelError
    from mace_accel.ops.irreps_linear.gemm import _fits_grouped
    from mace_accel.ops.runtime import aligned16, check_aligned, is_aligned16

    base = torch.zeros(4 * 64 + 4)
    assert is_aligned16(base)
    x, shifted = base[:256].view(4, 64), base[1:257].view(4, 64)  # 4 bytes off
    assert _fits_grouped(x, x) and not _fits_grouped(shifted, x)
    assert not _fits_grouped(x, base[:256].view(64, 4).t())  # not contiguous
    check_aligned("x", x, "the test")
    with pytest.raises(KernelError, match="16-byte"):
        check_aligned("x", shifted, "the test")
    assert aligned16(x) is x and is_aligned16(aligned16(shifted))
