"""The conv forward that computes its TP weights itself: ``out = conv(x, y, h @ W_last)``.

The radial MLP's last layer ``w = h @ W_last`` (``h [E, hidden]``, ``W_last [hidden,
weight_numel]``) runs on the tensor cores inside the conv forward, so the conv reads ``h`` (64
values an edge for MACE-MP) instead of ``w`` (1,280). The weights are written once, with the
evict-first hint, only where the backward keeps them (``write_w``); a backward that recomputes
them (:mod:`mace_accel.ops.conv_tp.folded`) leaves them never stored.

Mapping (``docs/design/last_layer_in_conv.md``): one *job* per (input segment, channel block):
block ``b`` runs job ``b % jobs`` over a range of receivers, ``groups`` receivers at a time, with
the job's weight columns (every path of the segment, the block's channels) resident in shared
memory as ``mma.sync`` m16n8k8 B fragments, loaded once. Per tile of 16 of a receiver's edges
each warp loads the tile's ``h`` rows as A fragments (straight from global memory) and, path by
path, multiplies them by its 32 channels' columns (DMMA in float64; 3xTF32 in float32, float32
accuracy), parks the ``[16, 32]`` product in shared memory and runs that path's conv body,
thread ``u`` = channel ``u``, as the plain forward does. Jobs write disjoint output columns.

Slower than the GEMM kernel and the conv it replaces on large graphs (the product is
compute-bound in both dtypes and the resident weights leave 8-12 warps an SM;
scripts/bench_hidden_conv.py), so it runs only
where ``AccelOptions.last_layer_kernel`` asks for it.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch

from mace_accel.ops.conv_tp.codegen import fwd_path_lines, fwd_y_loads
from mace_accel.ops.conv_tp.schedule import (
    ConvPlan,
    KernelHeader,
    PathPlan,
    SegmentPlan,
    kernel_header,
)
from mace_accel.ops.conv_tp.spec import TPSpec
from mace_accel.ops.limits import OPTIN_SHARED, WARP
from mace_accel.ops.templates import render

ARCH = "sm_90"          # float64 m16n8k8 is Hopper's; the 3xTF32 float32 product runs from sm_80
TILE = 16               # edges per warp tile: the product's M
FRAG = 8                # K and N of one m16n8k8 product
TILES_PER_WARP = WARP // FRAG  # a warp's 32 channels: 4 n-tiles
SHARED_LIMIT = OPTIN_SHARED  # an sm_90 block's dynamic shared memory, opted in (ARCH only)
# warps a block may have: the register file holds about this many at the kernels' ~150-200
# registers (float64 keeps twice the words)
MAX_BLOCK_WARPS = {"float32": 12, "float64": 8}


# A thread keeps the output accumulators of every path of its job in registers: at most this
# many 32-bit words (float64 counts two), else the segment's paths are split over jobs. MP-large's
# 2e segment in float64 (31 values, 62 words) spilled; MP-medium's 1o (24 values) does not.
ACCUMULATOR_WORDS = 48


@dataclasses.dataclass(frozen=True)
class Job:
    """One block row of the launch: the channels ``[ch0, ch0 + 32 * warps)`` of one input
    segment and some of its paths (their weight columns of those channels resident)."""

    segment: SegmentPlan
    ch0: int
    paths: Tuple[PathPlan, ...]


def path_groups(seg: SegmentPlan, real_words: int) -> List[Tuple[PathPlan, ...]]:
    """The segment's paths in order, packed into groups whose accumulators fit
    :data:`ACCUMULATOR_WORDS`."""
    groups: List[List[PathPlan]] = [[]]
    words = 0
    for p in seg.paths:
        need = p.out_dim * real_words
        if groups[-1] and words + need > ACCUMULATOR_WORDS:
            groups.append([])
            words = 0
        groups[-1].append(p)
        words += need
    return [tuple(g) for g in groups if g]


@dataclasses.dataclass(frozen=True)
class HiddenForwardPlan(KernelHeader):
    """The launch of one spec's hidden-input forward.

    Attributes:
        jobs: the (segment, channel block) pairs, in the order of the packed fragments.
        hidden: ``h``'s width; ``kt`` its tiles of 8 (zero-padded).
        group_warps: warps that walk one receiver (32 channels each);
        groups: receivers a block walks at once (its warps share the resident weights).
    """

    hidden: int
    group_warps: int
    groups: int
    jobs: Tuple[Job, ...]

    @property
    def real_bytes(self) -> int:
        return 8 if self.dtype == "float64" else 4

    @property
    def warps(self) -> int:
        return self.group_warps * self.groups

    @property
    def threads(self) -> int:
        return self.warps * WARP

    @property
    def kt(self) -> int:
        return -(-self.hidden // FRAG)

    @property
    def n_tiles(self) -> int:
        """n-tiles of one path's columns in a job (its channel block, zero-padded)."""
        return self.group_warps * TILES_PER_WARP

    @property
    def path_fragment_numel(self) -> int:
        """Reals of one path's B fragments in a job: ``[kt, n_tiles, 32 lanes, 2]``."""
        return self.kt * self.n_tiles * WARP * 2

    def job_fragment_numel(self, job: Job) -> int:
        return len(job.paths) * self.path_fragment_numel

    def job_offsets(self) -> List[int]:
        """Start of each job's fragments in the buffer (reals), and the end."""
        out = [0]
        for job in self.jobs:
            out.append(out[-1] + self.job_fragment_numel(job))
        return out

    @property
    def fragment_shared_bytes(self) -> int:
        return max((self.job_fragment_numel(j) for j in self.jobs), default=0) * self.real_bytes

    @property
    def warp_shared_bytes(self) -> int:
        """A warp's tile: the ``[16, 32]`` weights of one path, the edge attributes, edge and
        sender ids."""
        return TILE * (WARP + self.dim_in2) * self.real_bytes + 2 * TILE * 4

    @property
    def shared_bytes(self) -> int:
        return self.fragment_shared_bytes + self.warps * self.warp_shared_bytes

    def describe(self) -> str:
        product = "float64 tensor cores" if self.dtype == "float64" else "3xTF32 tensor cores"
        return (f"conv forward with the last layer [{self.hidden}, {self.weight_numel}] on the "
                f"{product}: {len(self.jobs)} jobs x {self.groups} receivers x "
                f"{self.group_warps} warps, {self.shared_bytes} bytes of shared memory a block")


def plan_hidden_forward(spec: TPSpec, conv: ConvPlan, hidden: int) -> HiddenForwardPlan:
    """The hidden-input forward of ``spec`` (its segments as ``conv`` planned them): the widest
    channel block whose weights fit the shared memory with one receiver's warps, then as many
    receivers a block as the shared memory and :data:`MAX_BLOCK_WARPS` allow."""
    segments = [seg for launch in conv.forward_launches for seg in launch.segments]
    arch = conv.forward_launches[0].arch if conv.forward_launches else ""
    base = HiddenForwardPlan(**kernel_header(spec, conv.dtype, arch), hidden=hidden,
                             group_warps=1, groups=1, jobs=())
    widest = max((seg.warps for seg in segments), default=1)
    plan = base
    for group_warps in [w for w in range(widest, 0, -1) if widest % w == 0]:
        words = 2 if conv.dtype == "float64" else 1
        jobs = tuple(Job(seg, ch0, paths) for seg in segments
                     for ch0 in range(0, seg.warps * WARP, group_warps * WARP)
                     for paths in path_groups(seg, words))
        plan = dataclasses.replace(base, group_warps=group_warps, jobs=jobs)
        if plan.shared_bytes <= SHARED_LIMIT:
            break
    room = (SHARED_LIMIT - plan.fragment_shared_bytes) // (
        plan.group_warps * plan.warp_shared_bytes)
    groups = max(1, min(room, MAX_BLOCK_WARPS[plan.dtype] // plan.group_warps))
    return dataclasses.replace(plan, groups=groups)


def unsupported_reason(plan: HiddenForwardPlan) -> Optional[str]:
    """Why the hidden-input forward cannot run ``plan``, or None."""
    if plan.dtype not in ("float32", "float64"):
        return f"no tensor-core product for {plan.dtype}"
    if plan.arch != ARCH:
        return f"the kernels are built for {ARCH}, this GPU is {plan.arch}"
    if not plan.jobs:
        return "the tensor product has no paths"
    if plan.shared_bytes > SHARED_LIMIT:
        return (f"a segment's slice of the last layer and the tiles need {plan.shared_bytes} "
                f"bytes of shared memory a block, more than {SHARED_LIMIT}")
    return None


# blocks a launch has per resident slot: each job's blocks cover a range of receivers; jobs are
# unequal, so several waves of smaller ranges keep the GPU busy to the end
WAVES = 4


def nodes_per_block(n_nodes: int, jobs: int, resident: int) -> int:
    """Receivers per block: ``WAVES`` waves of ``resident`` blocks over ``jobs`` jobs."""
    return max(1, -(-n_nodes * jobs // max(1, resident * WAVES)))


def fragment_index(plan: HiddenForwardPlan) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(rows, cols)`` ``[job_offsets()[-1] // 2, 2]`` into ``W_last`` zero-padded by one row
    and one column (:func:`pack`): the kernels' B fragments of every job.

    Per job, per path of the job, per tile ``(kt, nt)`` (``nt`` fastest), per lane
    (``g = lane // 4``, ``t = lane % 4``) the pair ``W[8 kt + 2 t + i, w_offset + ch0 + 8 nt +
    g]``, ``i = 0, 1``: K permuted within each tile as the DMMA kernels do, so an A fragment
    loaded as row pairs fits as it stands. Past ``hidden`` rows or the segment's channels: the
    zero row / column.
    """
    lane = torch.arange(WARP)
    g, t = lane // 4, lane % 4
    kt = torch.arange(plan.kt).view(-1, 1, 1, 1)
    nt = torch.arange(plan.n_tiles).view(1, -1, 1, 1)
    k = FRAG * kt + 2 * t.view(1, 1, -1, 1) + torch.arange(2).view(1, 1, 1, 2)
    k, c = torch.broadcast_tensors(k, FRAG * nt + g.view(1, 1, -1, 1))
    rows, cols = [], []
    for job in plan.jobs:
        ch = job.ch0 + c
        inside = (k < plan.hidden) & (ch < job.segment.mul)
        for path in job.paths:
            rows.append(torch.where(inside, k, plan.hidden).reshape(-1))
            cols.append(torch.where(inside, path.w_offset + ch, plan.weight_numel).reshape(-1))
    return torch.cat(rows), torch.cat(cols)


def pack(w_last: torch.Tensor, index: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The kernels' fragment buffer of ``w_last [hidden, weight_numel]``
    (``index``: :func:`fragment_index` on ``w_last``'s device)."""
    padded = torch.nn.functional.pad(w_last, (0, 1, 0, 1))
    return padded[index[0], index[1]].contiguous()


def kernel_name(plan: HiddenForwardPlan) -> str:
    """One kernel per spec, dtype and hidden width (the width is compiled in)."""
    return f"mace_conv_fwd_hidden{plan.hidden}"


def render_hidden_forward(plan: HiddenForwardPlan) -> str:
    """CUDA source of the hidden-input forward of ``plan``."""
    offsets = plan.job_offsets()
    jobs = []
    for j, job in enumerate(plan.jobs):
        seg = job.segment
        accs, paths, store = [], [], []
        for i, p in enumerate(job.paths):
            a, body, st = fwd_path_lines(seg, p, "ws[t * 32 + lane]", i)
            accs, store = accs + a, store + st
            x_loads = [f"const real x{a} = xr[{a}];" for a in range(seg.x_dim)]
            paths.append(dict(w_offset=p.w_offset,
                              fragments=offsets[j] // 2 + i * plan.path_fragment_numel // 2,
                              body=x_loads + fwd_y_loads(seg, [p]) + body))
        jobs.append(dict(index=j, mul=seg.mul, ch0=job.ch0, x_offset=seg.x_offset,
                         x_dim=seg.x_dim, accumulators=accs, paths=paths, fwd_store=store,
                         fragment_pairs=plan.job_fragment_numel(job) // 2,
                         fragment_start=offsets[j] // 2))
    return render("conv_tp/forward_hidden.cu.j2", plan=plan, name=kernel_name(plan), jobs=jobs,
                  tile=TILE, real="double" if plan.dtype == "float64" else "float")


def catalog_sources(limits, problems=None, hidden: int = 64) -> List[Tuple[str, str]]:
    """``(name, source)`` of the hidden-input forward of every catalog problem, both dtypes."""
    from mace_accel.ops.conv_tp.catalog import select, unique
    from mace_accel.ops.conv_tp.schedule import plan_kernels
    from mace_accel.ops.conv_tp.spec import make_spec

    out = []
    for problem in problems if problems is not None else unique(select()):
        spec = make_spec(*problem.irreps)
        for dtype in ("float32", "float64"):
            plan = plan_hidden_forward(spec, plan_kernels(spec, dtype, limits), hidden)
            if unsupported_reason(plan) is None:
                out.append((f"conv_tp/{problem.name}-{dtype}-hidden-fwd",
                            render_hidden_forward(plan)))
    return out
