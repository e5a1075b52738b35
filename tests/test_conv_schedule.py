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


def test_backward_holds_h_or_the_output_gradient_where_it_fits(mp_medium):
    """``h = C . g`` (64 values at most) is held per node where it fits, else the output
    gradient (:data:`codegen.HOIST_G_WORDS`), else the gradient is read per edge."""
    (plan32,) = plan_kernels(mp_medium, "float32").backward_launches
    src = codegen.render_backward(plan32, (True, True, True))
    # the 128x1o segment: 60 values of h, each a sum of CG x gradient terms
    assert "hh1_0_0_0 = " in src and " * hh1_0_0_0" in src and "gh1_" not in src
    assert sum(len(codegen._h_pairs(p)) for p in plan32.segments[1].paths) == 60
    # MACE-MP-large's 128x2e segment (111 values of h) holds its 31 gradient values instead
    large = plan_kernels(make_spec(*CATALOG["mp-large-l2"].irreps), "float32").backward_launches
    src = codegen.render_backward(large[0], (True, True, True))
    assert "gh2_0_0 = gr[" in src and "const real g0 = gh2_0_0;" in src
    # a float64 L=3 segment of 50 values would spill at 255 registers: loaded per edge instead
    spec = make_spec(*CATALOG["small-l3-node-feats"].irreps)
    plans = plan_kernels(spec, "float64").backward_launches
    srcs = [codegen.render_backward(plan, (True, True, True)) for plan in plans]
    assert any("const real g0 = gr[" in s for s in srcs)


def test_h_form_is_the_gradient_of_the_forward():
    """The per-edge algebra the h-form kernels print, against the u-form, for random values:
    ``s[a] = sum_b y_b h[a][b]`` equals ``sum_k g_k u[a][k]``, and ``sum_a x_a h[a][b]`` equals
    ``sum_{a,k} C[a,b,k] x_a g_k``."""
    import random

    spec = make_spec(*CATALOG["mp-medium-l2"].irreps)
    (plan,) = plan_kernels(spec, "float64").backward_launches
    rng = random.Random(0)
    for p in plan.segments[1].paths:
        x = [rng.gauss(0, 1) for _ in range(3)]
        y = [rng.gauss(0, 1) for _ in range(p.y_dim)]
        g = [rng.gauss(0, 1) for _ in range(p.out_dim)]
        h = {ab: sum(c * g[k] for k, c in terms) for ab, terms in codegen._h_pairs(p).items()}
        u = {ak: sum(c * y[b - p.y_offset] for b, c in terms)
             for ak, terms in codegen._by_ak(p).items()}
        for a in range(3):
            s_h = sum(y[b] * v for (aa, b), v in h.items() if aa == a)
            s_u = sum(g[k] * v for (aa, k), v in u.items() if aa == a)
            assert s_h == pytest.approx(s_u, rel=1e-12, abs=1e-12)
        for b in range(p.y_dim):
            d_h = sum(x[a] * v for (a, bb), v in h.items() if bb == b)
            d_c = sum(c * x[a] * g[k] for a, bb, k, c in p.terms if bb == b)
            assert d_h == pytest.approx(d_c, rel=1e-12, abs=1e-12)


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
