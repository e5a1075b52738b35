"""Staged conv kernels: the rows each edge reads, copied into shared memory ahead of use.

The plain kernels (``forward.cu.j2``, ``backward.cu.j2``) load each edge's TP weights and
sender features into registers, one edge ahead: the bytes a block has in flight are bounded by
its registers, and the per-edge streams run well below the bandwidth of a fast HBM (the
latency x bandwidth product grows with the bandwidth; the SM count does not). The staged kernels
copy the rows of ``STAGES - 1`` tiles of ``STAGE_EDGES`` edges ahead with ``cp.async`` (16-byte
copies where the rows allow, else 8 or 4), then compute from shared memory: the backward the
plain backward's per-edge code, the forward accumulating the outer product ``M`` where it fits
(:func:`~.codegen.fwd_outer_lines`). Results agree with the plain kernels to rounding and are
bit-reproducible. Design and measurements: ``docs/design/staged_conv.md``.

What is staged, per edge of a launch (its input segments' columns only):
    * the TP weights of the launch's paths (``w_spans``: runs of adjacent columns), read once:
      evict-first in L2;
    * the sender's features ``x[sender, x_lo : x_lo + x_cols]``;
    * the edge attributes ``y[e, :]`` (read by the threads as 16-byte vectors where they can).
The backward stages only what its gradients read (:func:`~.codegen._bwd_operands`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from mace_accel.ops.conv_tp.codegen import (
    Needs,
    _bwd_math,
    _bwd_operands,
    _fwd_lines,
    _g_hoist,
    _gy_reduce,
    _keeps_outer,
    _needs_tag,
    _real,
    _w_row0_arg,
    _y_cols,
)
from mace_accel.ops.conv_tp.schedule import KernelPlan, PathPlan
from mace_accel.ops.limits import LARGE_GRAPH_EDGES, RESERVED_SHARED, SM_SHARED
from mace_accel.ops.templates import RealType, render

# edge ids and senders read per refill of the index buffers (a node's edges are walked in
# chunks of this many)
INDEX_TILE = 128


class Staging(NamedTuple):
    """How one direction's kernels stage: ``edges`` per tile, ``stages`` buffers, ``unroll``
    (edges of a tile computed interleaved; 0: the plan's), ``by_segment`` (one input segment
    per launch, :func:`~.schedule.plan_kernels`)."""

    edges: int
    stages: int
    unroll: int = 0
    by_segment: bool = False


# How each direction's kernels stage their rows, by dtype; None: the plain kernels, which load
# each edge's rows into registers one edge ahead. Chosen by scripts/bench_kernels.py conv-staged on
# large graphs (MACE-MP-medium layer 2); the float64 forward stays plain: staged, it was slower.
DEFAULT_STAGING: Dict[str, Dict[str, Optional[Staging]]] = {
    "float32": {"forward": Staging(8, 2, by_segment=True), "backward": Staging(4, 2)},
    "float64": {"forward": None, "backward": Staging(4, 2)},
}
# Graphs with fewer edges run the plain kernels: at 20k edges (256 atoms) the staged forward
# was 1.3-1.4x slower and the staged backward no faster.
STAGED_MIN_EDGES = LARGE_GRAPH_EDGES


@dataclasses.dataclass(frozen=True)
class Span:
    """Adjacent weight columns ``[src, src + cols)`` of a row, staged at column ``dst``."""

    src: int
    dst: int
    cols: int


@dataclasses.dataclass(frozen=True)
class StagePlan(RealType):
    """The staging geometry of one launch (sizes in reals unless named ``*_bytes``).

    Attributes:
        edges: edges per tile (one stage).
        stages: stage buffers; ``stages - 1`` tiles are in flight while one is computed.
        w_spans: the weight columns staged (empty: weights not read).
        x_lo, x_cols: the sender-feature columns staged (``x_cols == 0``: not read).
        y_cols: edge-attribute columns staged (0 or ``dim_in2``).
        w_vec, x_vec, y_vec: bytes per copy (16, 8 or 4: the largest every row start, column
            offset and length allows).
        red_cols: the d(edge_attrs) reduction buffers' width (0: none).
        unroll: edges of a tile a thread computes interleaved (``#pragma unroll``).
        cap_registers: whether :attr:`min_blocks` may cap the registers (see there).
    """

    dtype: str
    edges: int
    stages: int
    warps: int
    w_spans: Tuple[Span, ...]
    x_lo: int
    x_cols: int
    y_cols: int
    w_vec: int
    x_vec: int
    y_vec: int
    red_cols: int
    unroll: int = 1
    cap_registers: bool = True
    index_tile: int = INDEX_TILE

    @property
    def min_blocks(self) -> int:
        """``__launch_bounds__`` blocks per SM: 2 for 8-warp float32 blocks whose stages fit
        twice in an SM's shared memory (ptxas then keeps to 128 registers a thread: 16 warps
        an SM, without spills over the catalog); else 1 (all the registers a thread wants:
        smaller blocks capped at 128 spill where several segments share a launch)."""
        fits_two = 2 * (self.shared_bytes + RESERVED_SHARED) <= SM_SHARED
        capped = self.dtype == "float32" and self.warps == 8 and fits_two and self.cap_registers
        return 2 if capped else 1

    @property
    def w_cols(self) -> int:
        return sum(s.cols for s in self.w_spans)

    def _padded(self, reals: int) -> int:
        per16 = 16 // self.real_bytes
        return -(-reals // per16) * per16

    @property
    def w_buffer(self) -> int:
        return self._padded(self.stages * self.edges * self.w_cols)

    @property
    def x_buffer(self) -> int:
        return self._padded(self.stages * self.edges * self.x_cols)

    @property
    def y_buffer(self) -> int:
        # the template addresses the y stage of tile k at k * STAGE_EDGES * DIM2
        return self._padded(self.stages * self.edges * self.y_cols)

    @property
    def red_buffer(self) -> int:
        return self._padded(2 * self.warps * self.edges * self.red_cols)

    @property
    def shared_bytes(self) -> int:
        reals = self.w_buffer + self.x_buffer + self.y_buffer + self.red_buffer
        return reals * self.real_bytes + 2 * self.index_tile * 4

    @property
    def y_per_vector(self) -> int:
        """Edge-attribute values per 16-byte shared-memory load of the staged rows (4 floats,
        2 doubles), 0 where a row is not a whole number of 16 bytes (:func:`~.codegen.y_loads`)."""
        whole = self.y_cols and (self.y_cols * self.real_bytes) % 16 == 0
        return 16 // self.real_bytes if whole else 0

    def w_column(self, p: PathPlan) -> int:
        """The staged column of path ``p``'s first weight."""
        for s in self.w_spans:
            if s.src <= p.w_offset < s.src + s.cols:
                return s.dst + p.w_offset - s.src
        raise KeyError(f"path at weight column {p.w_offset} is not staged")


def _vector(real_bytes: int, columns: Sequence[int]) -> int:
    """The widest copy (16, 8 or ``real_bytes``) that divides every column count's bytes."""
    for v in (16, 8, 4):
        if v >= real_bytes and all((c * real_bytes) % v == 0 for c in columns):
            return v
    return real_bytes


def _w_spans(plan: KernelPlan) -> Tuple[Span, ...]:
    runs: List[List[int]] = []
    for src, cols in sorted({(p.w_offset, seg.mul) for seg in plan.segments for p in seg.paths}):
        if runs and runs[-1][0] + runs[-1][1] == src:
            runs[-1][1] += cols
        else:
            runs.append([src, cols])
    spans, dst = [], 0
    for src, cols in runs:
        spans.append(Span(src, dst, cols))
        dst += cols
    return tuple(spans)


def stage_plan(plan: KernelPlan, loads: Tuple[bool, bool, bool], reduce_y: bool, edges: int,
               stages: int, unroll: int = 1) -> StagePlan:
    """The staging of ``plan``'s launch reading (weights, sender features, edge attributes)
    as ``loads`` says; ``reduce_y``: the backward's d(edge_attrs) reduction buffers."""
    if stages < 2 or edges < 1:
        raise ValueError(f"a staged kernel needs >= 2 stages of >= 1 edge, got {stages} x {edges}")
    load_w, load_x, load_y = loads
    rb = plan.real_bytes
    spans = _w_spans(plan) if load_w else ()
    x_lo = min(seg.x_offset for seg in plan.segments)
    x_hi = max(seg.x_offset + seg.mul * seg.x_dim for seg in plan.segments)
    x_cols = x_hi - x_lo if load_x else 0
    return StagePlan(
        dtype=plan.dtype, edges=edges, stages=stages, warps=plan.warps, w_spans=spans,
        x_lo=x_lo, x_cols=x_cols, y_cols=plan.dim_in2 if load_y else 0,
        w_vec=_vector(rb, [plan.weight_numel] + [c for s in spans for c in (s.src, s.cols)]),
        x_vec=_vector(rb, [plan.dim_in1, x_lo, x_cols]), y_vec=_vector(rb, [plan.dim_in2]),
        red_cols=plan.dim_in2 if reduce_y else 0, unroll=unroll)


def _issue_lines(st: StagePlan, w_sorted: bool) -> List[str]:
    """Copy tile ``kk`` of the current index chunk into its stage (every thread a share)."""
    lines = ["const int q0 = kk * STAGE_EDGES;",
             "const int nq = min(STAGE_EDGES, cnt - q0);",
             "const int sbk = kk % STAGES;"]
    w_row = "c0 + q0 + t - w_row0" if w_sorted else "eidx[q0 + t]"

    def loop(chunks: int, dst: str, src: str, copy: str) -> List[str]:
        return [f"for (int q = threadIdx.x; q < nq * {chunks}; q += THREADS) {{",
                f"  const int t = q / {chunks}, c = q - t * {chunks};",
                f"  {copy}({dst}, {src});",
                "}"]

    tile = "sbk * (STAGE_EDGES * {}) + t * {}"
    copies = [(s.cols, st.w_vec, f"sw + {tile.format('W_COLS', 'W_COLS')} + {s.dst}",
               f"w + (long long)({w_row}) * WN + {s.src}", "stage_stream", ", policy")
              for s in st.w_spans]
    if st.x_cols:
        copies.append((st.x_cols, st.x_vec, f"sx + {tile.format('X_COLS', 'X_COLS')}",
                       "x + (long long)sidx[q0 + t] * DIM1 + X_LO", "stage_copy", ""))
    if st.y_cols:
        copies.append((st.y_cols, st.y_vec, f"sy + {tile.format('DIM2', 'DIM2')}",
                       "y + (long long)eidx[q0 + t] * DIM2", "stage_copy", ""))
    for cols, vec, dst, src, copy, extra in copies:
        step = vec // st.real_bytes
        lines += loop(cols * st.real_bytes // vec, f"{dst} + c * {step}",
                      f"{src} + c * {step}{extra}", f"{copy}<{vec}>")
    return lines


def _operand_lines(i: int, seg, st: StagePlan, load_w: bool, load_x: bool,
                   x_name: str) -> List[str]:
    """Staged operands of edge ``t``: ``wr`` / ``cw{j}`` weights, ``xr`` / sender features."""
    lines = []
    if load_w:
        lines.append("const real* wr = sw_k + t * W_COLS + u;")
    if load_x:
        lines.append(f"const real* xr = sx_k + t * X_COLS + {seg.x_offset - st.x_lo} "
                     f"+ u * {seg.x_dim};")
        if x_name:
            lines += [f"const real {x_name}{a} = xr[{a}];" for a in range(seg.x_dim)]
    return lines


def staged_forward_name(plan: KernelPlan, st: StagePlan, w_sorted: bool = False) -> str:
    return (f"mace_conv_fwd_g{plan.group}_st{st.edges}x{st.stages}u{st.unroll}"
            + ("_ws" if w_sorted else ""))


def staged_backward_name(plan: KernelPlan, st: StagePlan, needs: Needs, atomic: bool = False,
                         w_sorted: bool = False) -> str:
    return ("mace_conv_bwd_g{}_x{}y{}w{}_st{}x{}u{}".format(
        plan.group, *(int(n) for n in needs), st.edges, st.stages, st.unroll)
            + ("_atomic" if atomic else "") + ("_ws" if w_sorted else ""))


def forward_stages(plan: KernelPlan, staging: Staging) -> StagePlan:
    """The forward's staging (``unroll`` 0: the plain forward's, ``plan.fwd_unroll``)."""
    return stage_plan(plan, (True, True, True), False, staging.edges, staging.stages,
                      staging.unroll or plan.fwd_unroll)


def backward_stages(plan: KernelPlan, needs: Needs, staging: Staging) -> StagePlan:
    """The backward's staging for ``needs`` (``unroll`` 0: 1)."""
    load_w, load_x = _bwd_operands(needs)
    st = stage_plan(plan, (load_w, load_x, needs[0] or needs[2]), needs[1], staging.edges,
                    staging.stages, staging.unroll or 1)
    # d(x) and d(y) without d(w) spilled 16 bytes under the 128-register cap (MACE-MP-medium,
    # nvcc 13); MACE asks for d(w) whenever it asks for d(y), so this selection is rare
    return dataclasses.replace(st, cap_registers=not (needs[0] and needs[1] and not needs[2]))


def render_staged_forward(plan: KernelPlan, st: StagePlan, w_sorted: bool = False) -> str:
    """CUDA source of the staged forward of ``plan``'s launch."""
    segments = []
    for seg in plan.segments:
        accs, body, store = _fwd_lines(seg, lambda p: f"wr[{st.w_column(p)}]",
                                       outer=_keeps_outer(seg), per_vector=st.y_per_vector)
        body = _operand_lines(0, seg, st, True, True, "") + ["const real* yr = ys + t * DIM2;"] \
            + body
        segments.append(dict(warp_begin=seg.warp_begin, warp_end=seg.warp_end, mul=seg.mul,
                             accumulators=accs, fwd_body=body, fwd_store=store))
    return render("conv_tp/staged_forward.cu.j2", plan=plan, st=st,
                  name=staged_forward_name(plan, st, w_sorted), segments=segments,
                  real=_real(plan),
                  issue=_issue_lines(st, w_sorted), w_row0_arg=_w_row0_arg(w_sorted),
                  unroll=st.unroll)


def _gy_sum(tile: str, plan: KernelPlan, group_adds: bool) -> List[str]:
    """Sum tile ``tile``'s d(edge_attrs) over the warps (in warp order) into ``gy``."""
    op = "+=" if group_adds else "="
    return [f"const int j = {tile};",
            "const int nj = min(STAGE_EDGES, cnt - j * STAGE_EDGES);",
            "const real* rj = red_all + (j & 1) * (WARPS * STAGE_EDGES * DIM2);",
            "const int* ej = eidx + j * STAGE_EDGES;",
            "for (int q = threadIdx.x; q < nj * DIM2; q += THREADS) {",
            "  real s = 0;",
            f"  for (int wi = 0; wi < {plan.warps}; ++wi) s += rj[wi * STAGE_EDGES * DIM2 + q];",
            "  const int t = q / DIM2;",
            f"  gy[(long long)ej[t] * DIM2 + (q - t * DIM2)] {op} s;",
            "}"]


def _bwd_tile_decls(needs: Needs, atomic: bool, w_sorted: bool) -> List[str]:
    """The names the backward's edge body reads for tile ``k`` (only those it uses: nvcc
    warns of the others, and the CI compile treats warnings as errors)."""
    need_x, need_y, need_w = needs
    load_w, load_x = _bwd_operands(needs)
    decls = []
    if load_w:
        decls.append("const real* sw_k = sw + sb * (STAGE_EDGES * W_COLS);")
    if load_x:
        decls.append("const real* sx_k = sx + sb * (STAGE_EDGES * X_COLS);")
    if need_x or need_w:
        decls.append("const real* ys = sy + sb * (STAGE_EDGES * DIM2);")
    if (need_x and not atomic) or (need_w and not w_sorted):
        decls.append("const int* es = eidx + k * STAGE_EDGES;")
    if need_x and atomic:
        decls.append("const int* ss = sidx + k * STAGE_EDGES;")
    if need_w and w_sorted:
        decls.append("const int t0 = c0 + k * STAGE_EDGES;")
    if need_y:
        decls.append("real* red = red_all + (k & 1) * (WARPS * STAGE_EDGES * DIM2);")
    return decls


def render_staged_backward(plan: KernelPlan, st: StagePlan, needs: Needs, atomic: bool = False,
                           w_sorted: bool = False) -> str:
    """CUDA source of the staged backward of ``plan``'s launch for ``needs`` (x, y, w)."""
    load_w, load_x = _bwd_operands(needs)
    rw = plan.real_bytes // 4
    segments = []
    for i, seg in enumerate(plan.segments):
        body = _operand_lines(i, seg, st, load_w, load_x, f"xs{i}_")
        if load_w:
            body += [f"const real cw{j} = wr[{st.w_column(p)}];" for j, p in enumerate(seg.paths)]
        body += _bwd_math(i, seg, needs, atomic, w_sorted, rw, st.y_per_vector)
        segments.append(dict(
            warp_begin=seg.warp_begin, warp_end=seg.warp_end, mul=seg.mul,
            hoist=_g_hoist(i, seg, rw), bwd_body=body,
            gy_regs=[f"py{c}" for c in _y_cols(seg)] if needs[1] else [],
            gy_reduce=_gy_reduce(_y_cols(seg), plan.dim_in2) if needs[1] else []))
    return render("conv_tp/staged_backward.cu.j2", plan=plan, st=st,
                  name=staged_backward_name(plan, st, needs, atomic, w_sorted),
                  segments=segments, real=_real(plan), needs=needs,
                  tile_decls=_bwd_tile_decls(needs, atomic, w_sorted),
                  issue=_issue_lines(st, w_sorted), w_row0_arg=_w_row0_arg(w_sorted),
                  gy_sum=lambda tile: _gy_sum(tile, plan, plan.group > 0))


def catalog_sources(limits, problems=None) -> Iterator[Tuple[str, str]]:
    """``(name, source)`` of the staged kernels :data:`DEFAULT_STAGING` launches for the
    catalog's problems, both dtypes: for ``mp-medium-l2`` every gradient selection and the
    atomic and weights-in-receiver-order variants; elsewhere the forward and the two
    backward selections MACE runs (each variant's code is the same template)."""
    from mace_accel.ops.conv_tp.catalog import select, unique
    from mace_accel.ops.conv_tp.codegen import all_backward_needs
    from mace_accel.ops.conv_tp.schedule import plan_kernels
    from mace_accel.ops.conv_tp.spec import make_spec

    if int(limits.arch.split("_")[1]) < 80:  # cp.async
        return
    for problem in problems if problems is not None else unique(select()):
        spec = make_spec(*problem.irreps)
        for dtype, staging in DEFAULT_STAGING.items():
            base = f"conv_tp/{problem.name}-{dtype}-staged"
            fwd, bwd = staging["forward"], staging["backward"]
            full = problem.name == "mp-medium-l2"  # every variant; the rest what MACE runs
            if fwd is not None:
                for plan in plan_kernels(spec, dtype, limits, fwd.by_segment).forward_launches:
                    st = forward_stages(plan, fwd)
                    yield f"{base}-g{plan.group}-fwd", render_staged_forward(plan, st)
                    if full:
                        yield f"{base}-g{plan.group}-ws-fwd", render_staged_forward(plan, st,
                                                                                   True)
            if bwd is None:
                continue
            every = (True, True, True)
            selections = all_backward_needs() if full else [every, (False, True, True)]
            for plan in plan_kernels(spec, dtype, limits, bwd.by_segment).backward_launches:
                tag = f"{base}-g{plan.group}"
                for needs in selections:
                    yield (f"{tag}-bwd{_needs_tag(needs)}",
                           render_staged_backward(plan, backward_stages(plan, needs, bwd), needs))
                if not full:
                    continue
                st = backward_stages(plan, every, bwd)
                yield f"{tag}-bwd111-atomic", render_staged_backward(plan, st, every, True)
                for needs in (every, (False, True, True)):
                    yield (f"{tag}-ws-bwd{_needs_tag(needs)}",
                           render_staged_backward(plan, backward_stages(plan, needs, bwd), needs,
                                                  w_sorted=True))

__all__ = ["DEFAULT_STAGING", "INDEX_TILE", "STAGED_MIN_EDGES", "Span", "StagePlan", "Staging", "backward_stages", "forward_stages",
           "catalog_sources", "render_staged_backward", "render_staged_forward", "stage_plan",
           "staged_backward_name", "staged_forward_name"]
