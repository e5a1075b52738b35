"""The staged conv kernels' plans and sources (CPU): what is staged, copy widths, shared memory,
register caps, the names the sources declare, the defaults and the catalog."""

from __future__ import annotations

import re

import pytest

from mace_accel.ops.conv_tp import staged
from mace_accel.ops.conv_tp.catalog import CATALOG
from mace_accel.ops.conv_tp.codegen import all_backward_needs
from mace_accel.ops.conv_tp.schedule import plan_kernels
from mace_accel.ops.conv_tp.spec import make_spec
from mace_accel.ops.limits import DeviceLimits
from mace_accel.ops.sources import PIN_LIMITS

EVERY = (True, True, True)


def _plans(name, dtype, by_segment=False, direction="backward"):
    conv = plan_kernels(make_spec(*CATALOG[name].irreps), dtype, by_segment=by_segment)
    return conv.forward_launches if direction == "forward" else conv.backward_launches


def test_mp_medium_float32_backward_geometry():
    (plan,) = _plans("mp-medium-l2", "float32")
    st = staged.backward_stages(plan, EVERY, staged.Staging(4, 2))
    assert st.w_spans == (staged.Span(0, 0, 1280),)
    assert (st.x_lo, st.x_cols, st.y_cols, st.red_cols) == (0, 512, 16, 16)
    assert (st.w_vec, st.x_vec, st.y_vec) == (16, 16, 16)
    # 2 stages x 4 edges x (1280 + 512 + 16) floats, two reduction buffers, the index buffers
    assert st.shared_bytes == 4 * (2 * 4 * 1808 + 2 * 8 * 4 * 16) + 2 * 128 * 4
    assert st.min_blocks == 2  # two 8-warp blocks an SM: 128 registers a thread
    for seg in plan.segments:
        for p in seg.paths:
            assert st.w_column(p) == p.w_offset


def test_what_the_backward_stages_follows_the_gradients():
    (plan,) = _plans("mp-medium-l2", "float32")
    only_w = staged.backward_stages(plan, (False, False, True), staged.Staging(4, 2))
    assert only_w.w_spans == () and only_w.x_cols == 512 and only_w.red_cols == 0
    only_x = staged.backward_stages(plan, (True, False, False), staged.Staging(4, 2))
    assert only_x.x_cols == 0 and only_x.y_cols == 16 and only_x.w_cols == 1280
    only_y = staged.backward_stages(plan, (False, True, False), staged.Staging(4, 2))
    assert only_y.y_cols == 0 and only_y.red_cols == 16


def test_split_weight_columns_are_staged_as_spans():
    """A float64 forward launch of one segment reads every other path's weight block."""
    plans = _plans("mp-medium-l2", "float64", direction="forward")
    st = staged.forward_stages(plans[1], staged.Staging(4, 2))
    assert len(st.w_spans) > 1 and st.w_cols == 768
    assert [s.dst for s in st.w_spans] == [0] + [sum(s.cols for s in st.w_spans[:i + 1])
                                               for i in range(len(st.w_spans) - 1)]
    columns = sorted(st.w_column(p) for p in plans[1].segments[0].paths)
    assert columns == list(range(0, 768, 128))


@pytest.mark.parametrize("dtype, vec", [("float32", 4), ("float64", 8)])
def test_odd_widths_copy_one_value_at_a_time(dtype, vec):
    (plan,) = _plans("odd-mul", dtype)
    st = staged.backward_stages(plan, EVERY, staged.Staging(4, 2))
    assert st.w_vec == vec  # 119 weight columns: rows are not 16-byte aligned
    src = staged.render_staged_backward(plan, st, EVERY)
    assert f"stage_stream<{vec}>" in src


def test_bad_staging_is_refused():
    (plan,) = _plans("mp-medium-l2", "float32")
    with pytest.raises(ValueError, match="stages"):
        staged.backward_stages(plan, EVERY, staged.Staging(4, 1))


@pytest.mark.parametrize("needs", all_backward_needs())
@pytest.mark.parametrize("atomic, w_sorted", [(False, False), (True, False), (False, True)])
def test_backward_declares_only_what_its_body_reads(needs, atomic, w_sorted):
    """nvcc warns of declared-but-unused names, and CI compiles with warnings as errors."""
    (plan,) = _plans("mp-medium-l2", "float32")
    st = staged.backward_stages(plan, needs, staged.Staging(4, 2))
    src = staged.render_staged_backward(plan, st, needs, atomic and needs[0], w_sorted)
    for name in ("sw_k", "sx_k", "ys", "es", "ss", "t0", "red"):
        declared = re.search(rf"\b{name} = ", src) is not None
        used = len(re.findall(rf"\b{name}\b", src)) > 1
        assert declared == used, name


def test_names_carry_the_shape():
    (plan,) = _plans("mp-medium-l2", "float32")
    a = staged.backward_stages(plan, EVERY, staged.Staging(4, 2))
    b = staged.backward_stages(plan, EVERY, staged.Staging(8, 2))
    names = {staged.staged_backward_name(plan, st, EVERY, atomic, ws)
             for st in (a, b) for atomic in (False, True) for ws in (False, True)}
    assert len(names) == 8
    src = staged.render_staged_backward(plan, a, EVERY)
    assert staged.staged_backward_name(plan, a, EVERY) in src
    assert "cp.async.cg.shared.global.L2::cache_hint" in src and "bar.sync 0" in src


def test_defaults_and_catalog():
    assert staged.DEFAULT_STAGING["float32"]["forward"].by_segment
    assert staged.DEFAULT_STAGING["float64"]["forward"] is None
    names = [name for name, _ in staged.catalog_sources(PIN_LIMITS)]
    assert len(names) == len(set(names))
    assert "conv_tp/mp-medium-l2-float32-staged-g0-bwd111" in names
    assert "conv_tp/mp-medium-l2-float32-staged-g1-fwd" in names  # one segment a launch
    assert not any("float64-staged" in n and n.endswith("-fwd") for n in names)
    assert list(staged.catalog_sources(DeviceLimits(arch="sm_75"))) == []  # no cp.async


class _Tensor:
    """What the launch choice reads of a tensor: its address and size."""

    def __init__(self, address: int) -> None:
        self.address = address

    def data_ptr(self) -> int:
        return self.address

    def numel(self) -> int:
        return 1


def _primitives(dtype: str):
    """CudaConvPrimitives' launch choice without a GPU: kernels stand in as their names."""
    from mace_accel.ops.conv_tp.cuda import CudaConvPrimitives

    spec = make_spec(*CATALOG["mp-medium-l2"].irreps)
    prims = object.__new__(CudaConvPrimitives)
    prims.staging = dict(staged.DEFAULT_STAGING[dtype])
    prims.staged_min_edges = staged.STAGED_MIN_EDGES
    prims.arch, prims._shared_optin, prims._launch_cache = "sm_90", 227 * 1024, {}
    prims.plan = plan_kernels(spec, dtype)
    prims._segment_plan = plan_kernels(spec, dtype, by_segment=True)
    prims._kernel = lambda name, render, dynamic_shared=0: name
    return prims


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_launch_choice_by_size_and_alignment(dtype):
    prims = _primitives(dtype)
    aligned, view = _Tensor(1 << 20), _Tensor((1 << 20) + 4)
    big, small = staged.STAGED_MIN_EDGES, staged.STAGED_MIN_EDGES - 1
    fwd = [k for _, k in prims._launches("forward", None, False, False, (aligned,), big)]
    bwd = [k for _, k in prims._launches("backward", EVERY, False, False, (aligned,), big)]
    if dtype == "float32":  # one segment a launch, each staged
        assert len(fwd) == 2 and all("_st8x2" in k for k in fwd)
    else:  # the float64 forward stays plain: its launches are one segment each anyway
        assert len(fwd) == 2 and not any("_st" in k for k in fwd)
    assert len(bwd) == 1 and "_st4x2" in bwd[0]
    for tensors, n_edges in (((aligned,), small), ((view,), big)):  # small graph, a view
        launches = prims._launches("backward", EVERY, False, False, tensors, n_edges)
        assert not any("_st" in k for _, k in launches)
    # the choice is made once per (direction, gradients, variant, size class)
    assert prims._launches("backward", EVERY, False, False, (aligned,), big)[0][1] == bwd[0]
    assert len(prims._launch_cache) == 3  # forward, backward staged, backward plain


def test_stages_past_the_shared_memory_run_plain():
    prims = _primitives("float32")
    prims._shared_optin = 16 * 1024
    launches = prims._launches("backward", EVERY, False, False, (), staged.STAGED_MIN_EDGES)
    assert not any("_st" in k for _, k in launches)
