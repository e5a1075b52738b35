"""The conv forward that applies the radial MLP's last layer itself
(:mod:`mace_accel.ops.conv_tp.hidden`), on the CPU: the fragment buffer emulated lane by lane
through the m16n8k8 layout gives ``h @ W_last`` for every path's channels, the plan's limits and
reasons, the generated source, and the patch's choice of path."""

from __future__ import annotations

import pytest
import torch
from dmma_emulation import G, T, mma

from mace_accel.ops.conv_tp import hidden
from mace_accel.ops.conv_tp.catalog import CATALOG
from mace_accel.ops.conv_tp.schedule import plan_kernels
from mace_accel.ops.conv_tp.spec import make_spec
from mace_accel.ops.limits import DeviceLimits

LIMITS = DeviceLimits(arch="sm_90", max_threads_per_block=1024, max_shared_per_block=48 * 1024)


def _plan(name: str, hidden_width: int, dtype: str = "float64"):
    spec = make_spec(*CATALOG[name].irreps)
    return spec, hidden.plan_hidden_forward(spec, plan_kernels(spec, dtype, LIMITS),
                                            hidden_width)


def _emulated_tile(plan, frag, h_tile, job, path, warp):
    """The kernel's ``ws [16, 32]``: rows ``h_tile [16, hidden]`` times the fragments of one
    path of one job for ``warp``'s channels (of the receiver group), one m16n8k8 product per
    (kt, nt), A fragments as the kernel loads them (``a0 = h[g, 8 kt + 2 t]``, ``a1 = h[g + 8,
    ..]``, ``a2 = h[g, 8 kt + 2 t + 1]``, ...)."""
    padded = torch.zeros(16, plan.kt * 8, dtype=torch.float64)
    padded[:, :h_tile.shape[1]] = h_tile
    start = plan.job_offsets()[job] + path * plan.path_fragment_numel
    frags = frag[start:start + plan.path_fragment_numel].view(plan.kt, plan.n_tiles, 32, 2)
    ws = torch.zeros(16, 32, dtype=torch.float64)
    for nt in range(4):
        acc = torch.zeros(32, 4, dtype=torch.float64)
        for kt in range(plan.kt):
            c = 8 * kt + 2 * T
            a = torch.stack([padded[G, c], padded[G + 8, c], padded[G, c + 1],
                             padded[G + 8, c + 1]], 1)
            acc += mma(a, frags[kt, warp * 4 + nt])
        col = 8 * nt + 2 * T
        ws[G, col], ws[G, col + 1] = acc[:, 0], acc[:, 1]
        ws[G + 8, col], ws[G + 8, col + 1] = acc[:, 2], acc[:, 3]
    return ws


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name,hidden_width", [("mp-medium-l2", 64), ("odd-mul", 13),
                                                ("tiny-gradcheck", 6), ("off-large-l2", 64)])
def test_fragments_give_each_paths_weights(name, hidden_width, dtype):
    """Every job's fragments, multiplied as the kernel does, are ``h @ W_last`` restricted to
    each path's columns of the job's channel block (zero past the segment's channels), for odd
    widths and channel counts and split channel blocks too."""
    spec, plan = _plan(name, hidden_width, dtype)
    torch.manual_seed(0)
    w_last = torch.randn(hidden_width, spec.weight_numel, dtype=torch.float64)
    frag = hidden.pack(w_last, hidden.fragment_index(plan))
    assert frag.shape == (plan.job_offsets()[-1],)
    h_tile = torch.randn(16, hidden_width, dtype=torch.float64)
    covered = set()
    for j, job in enumerate(plan.jobs):
        seg = job.segment
        for i, path in enumerate(job.paths):
            for warp in range(plan.group_warps):
                got = _emulated_tile(plan, frag, h_tile, j, i, warp)
                lo = job.ch0 + warp * 32
                hi = max(lo, min(seg.mul, lo + 32))
                covered.update((path.w_offset + c) for c in range(lo, hi))
                want = torch.zeros(16, 32, dtype=torch.float64)
                want[:, :hi - lo] = h_tile @ w_last[:, path.w_offset + lo:path.w_offset + hi]
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert covered == set(range(spec.weight_numel))  # every weight column in exactly one job


def test_packing_follows_the_weight_and_keeps_its_gradient_path():
    """The buffer is gathered from ``W_last`` (a column-major view as the radial MLP keeps it
    works), so a changed weight changes the buffer and nothing is cached inside."""
    spec, plan = _plan("mp-medium-l2", 64)
    index = hidden.fragment_index(plan)
    w = torch.randn(spec.weight_numel, 64, dtype=torch.float64).t()
    a = hidden.pack(w, index)
    b = hidden.pack(w.contiguous(), index)
    assert torch.equal(a, b)
    assert not torch.equal(a, hidden.pack(w * 2, index))


def test_plans_fit_the_shared_memory_and_split_wide_segments():
    """MP-medium float32: one job a segment (all 128 channels, every path resident), two
    receivers a block; float64 halves the channel block; OFF-large float64 (192 channels) takes
    32-channel blocks."""
    spec, plan = _plan("mp-medium-l2", 64, "float32")
    assert [(j.segment.index, j.ch0) for j in plan.jobs] == [(0, 0), (1, 0)]
    assert plan.group_warps == 4 and plan.groups == 2 and plan.kt == 8
    assert plan.shared_bytes <= hidden.SHARED_LIMIT and hidden.unsupported_reason(plan) is None
    # the 1o segment's six paths x 128 channels x 64 rows of float32 pairs are resident
    assert plan.fragment_shared_bytes == 6 * 128 * 64 * 4
    _, plan64 = _plan("mp-medium-l2", 64, "float64")
    assert plan64.group_warps == 2 and [j.ch0 for j in plan64.jobs] == [0, 64, 0, 64]
    _, wide = _plan("off-large-l2", 64, "float64")
    step = 32 * wide.group_warps  # 192 channels in blocks
    assert {j.ch0 for j in wide.jobs} == set(range(0, 192, step))
    # paths whose float64 accumulators would not fit the registers are split over jobs
    for job in wide.jobs:
        assert sum(p.out_dim for p in job.paths) * 2 <= hidden.ACCUMULATOR_WORDS
    assert len({j.ch0 for j in wide.jobs}) < len(wide.jobs) and len(plan.jobs) == 2
    for name in ("mp-medium-l2", "off-large-l2", "odd-mul"):
        for dtype in ("float32", "float64"):
            p = _plan(name, 64, dtype)[1]
            assert p.shared_bytes <= hidden.SHARED_LIMIT
            assert p.warps <= hidden.MAX_BLOCK_WARPS[dtype]
    other = hidden.HiddenForwardPlan(**{**plan.__dict__, "arch": "sm_80"})
    assert "sm_90" in hidden.unsupported_reason(other)
    wide_hidden = hidden.plan_hidden_forward(spec, plan_kernels(spec, "float32", LIMITS), 512)
    assert "shared memory" in hidden.unsupported_reason(wide_hidden)


def test_blocks_cover_every_receiver_in_waves():
    for n, jobs, resident in ((6912, 10, 264), (256, 10, 264), (1, 4, 264), (100000, 1, 8)):
        per = hidden.nodes_per_block(n, jobs, resident)
        blocks = -(-n // per)
        assert per >= 1 and blocks * per >= n and (blocks - 1) * per < n
        assert blocks * jobs <= max(jobs, resident * hidden.WAVES) + jobs


def test_source_has_one_branch_per_path_and_hinted_weight_stores():
    spec, plan = _plan("mp-medium-l2", 64)
    src = hidden.render_hidden_forward(plan)
    assert src.count("if (job == ") == len(plan.jobs) == 4
    assert src.count("path_weights(a, wsm") == 2 * len(spec.paths)  # each segment twice
    assert "mma.sync.aligned.m16n8k8.row.col.f64" in src
    src32 = hidden.render_hidden_forward(_plan("mp-medium-l2", 64, "float32")[1])
    assert "tf32" in src32 and "split_tf32" in src32 and "f64" not in src32
    assert "__stcs(w_out" in src and "__ldcs" not in src  # w is never read
    assert "#define HID 64" in src


def test_the_patch_takes_it_only_when_asked_and_says_why_not():
    """Off by default (measured slower), and on the CPU / reference backend never, with the
    reason; the option is validated and recorded."""
    from mace_accel.errors import ConfigError
    from mace_accel.options import AccelOptions
    from mace_accel.patches.conv_tp import FusedConvTP

    spec = make_spec(*CATALOG["tiny-gradcheck"].irreps)

    class _Radial:
        hs = [8, 8, spec.weight_numel]

        def last_on_tensor_cores(self, t):
            return True

    h = torch.zeros(10, 8, dtype=torch.float64)
    w_last = torch.zeros(8, spec.weight_numel, dtype=torch.float64)
    off = FusedConvTP(torch.nn.Module(), spec, AccelOptions(backend="reference"),
                      radial=_Radial())
    assert "last_layer_kernel" in off.hidden_forward_reason(10, h)
    assert "last_layer_kernel" not in off.describe()
    on = FusedConvTP(torch.nn.Module(), spec,
                     AccelOptions(backend="reference", last_layer_kernel=True), radial=_Radial())
    assert "CUDA" in on.hidden_forward_reason(10, h)
    assert on._fragments(h, w_last) is None
    assert "inside the conv forward's kernel" in on.describe()
    assert AccelOptions(last_layer_kernel=True).to_dict()["last_layer_kernel"] is True
    with pytest.raises(ConfigError, match="last_layer_kernel"):
        AccelOptions(last_layer_kernel="yes")
