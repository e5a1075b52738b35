"""The conv kernels' launch plan (CPU): launches per direction, edge chunks, hoisted registers."""

from __future__ import annotations

import pytest

from mace_accel.ops.conv_tp import codegen
from mace_accel.ops.conv_tp.catalog import CATALOG
from mace_accel.ops.conv_tp.schedule import MAX_EDGE_CHUNKS, edge_chunks, plan_kernels
from mace_accel.ops.conv_tp.spec import make_spec


@pytest.fixture(scope="module")
def mp_medium():
    return make_spec(*CATALOG["mp-medium-l2"].irreps)


def _segments(launches):
    return [seg.index for plan in launches for seg in plan.segments]


@pytest.mark.parametrize("name", ["mp-medium-l2", "mp-large-l2", "odd-mul", "small-l3-node-feats"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_each_direction_covers_every_segment_once_in_order(name, dtype):
    spec = make_spec(*CATALOG[name].irreps)
    conv = plan_kernels(spec, dtype)
    used = sorted({p.i_in1 for p in spec.paths})
    for launches in (conv.forward_launches, conv.backward_launches):
        assert _segments(launches) == used
        assert [plan.group for plan in launches] == list(range(len(launches)))


def test_float64_forward_runs_one_segment_per_launch(mp_medium):
    conv = plan_kernels(mp_medium, "float64")
    assert [len(plan.segments) for plan in conv.forward_launches] == [1, 1]
    assert [len(plan.segments) for plan in conv.backward_launches] == [2]
    conv32 = plan_kernels(mp_medium, "float32")
    assert [len(plan.segments) for plan in conv32.forward_launches] == [2]
    assert max(plan.threads for plan in plan_kernels(
        make_spec(*CATALOG["mp-large-l2"].irreps), "float64").backward_launches) <= 256


@pytest.mark.parametrize("n_nodes, threads, chunks", [
    (256, 256, 4),      # 132 SMs x 8 blocks of 256 threads: 1056 blocks for 256 receivers
    (256, 128, 8),      # capped
    (6912, 256, 1),     # large systems keep one block per receiver
    (1000, 512, 1),
    (0, 256, MAX_EDGE_CHUNKS),
])
def test_edge_chunks(n_nodes, threads, chunks):
    assert edge_chunks(n_nodes, threads, 132) == chunks


def test_backward_holds_the_output_gradient_where_it_fits(mp_medium):
    (plan32,) = plan_kernels(mp_medium, "float32").backward_launches
    src = codegen.render_backward(plan32, (True, True, True))
    assert "gh1_0_0 = gr[" in src and "const real g0 = gh1_0_0;" in src
    # a float64 L=3 segment of 50 values would spill at 255 registers: loaded per edge instead
    spec = make_spec(*CATALOG["small-l3-node-feats"].irreps)
    plans = plan_kernels(spec, "float64").backward_launches
    srcs = [codegen.render_backward(plan, (True, True, True)) for plan in plans]
    assert any("const real g0 = gr[" in s for s in srcs)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_per_edge_streams_are_evict_first(mp_medium, dtype):
    """The TP weights, d(tp_weights) and the d(node_feats) messages are touched once each:
    every load and store of them carries the evict-first hint, the reused rows none."""
    conv = plan_kernels(mp_medium, dtype)
    for plan in conv.forward_launches:
        src = codegen.render_forward(plan)
        assert "const real wv = __ldcs(wr + " in src and "= wr[" not in src
    for plan in conv.backward_launches:
        src = codegen.render_backward(plan, (True, True, True))
        assert "__ldcs(wr + " in src and "= wr[" not in src
        assert "__stcs(gwr + " in src and "gwr[" not in src
        assert "__stcs(gxr + " in src and "gxr[" not in src
        assert "__ldcs(gr" not in src and "__ldcs(xr" not in src  # reused: cached as before
        atomic = codegen.render_backward(plan, (True, True, True), atomic=True)
        assert "atomicAdd(gxr + " in atomic and "__stcs(gxr" not in atomic
    summed = codegen.render_sender_sum(conv.backward_launches[0])
    assert summed.count("__ldcs(gxm + ") == 2 and "= gxm[" not in summed
