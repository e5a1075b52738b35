"""Kernel plan: how a :class:`~mace_accel.spec.TPSpec` maps onto CUDA threads. Pure Python.

Mapping (both kernels, one thread block per receiver node, or per part of its edges):
    * each input segment ``i`` of ``irreps_in1`` (``mul_i x l_i``) that feeds a path gets
      ``ceil(mul_i / 32)`` warps; thread ``u`` of the segment owns channel ``u`` of every path
      that starts from segment ``i`` (``uvu``: the channel index is shared by in1, weight and out);
    * forward: block ``n`` walks the edges of receiver ``n`` and keeps its outputs in registers,
      so no per-edge message touches memory and no atomics are needed;
    * backward: block ``n`` walks the edges of receiver ``n`` too (its output-gradient row is
      read once per tile of edges), or, on small systems, a part of them (:func:`edge_chunks`:
      every output is per edge); ``d tp_weights`` is written per edge, ``d edge_attrs`` is
      reduced over the block per edge (warp shuffles, then a fixed-order sum over warps),
      ``d node_feats`` is written as one message per edge and summed per sender by a second
      kernel in edge order (deterministic), or added into the sender rows with atomics
      (``deterministic=False``).

The device limits are passed in (read from the tensor's device by the runtime), never assumed.
CG coefficients are multiplied by the path weight in float64 here and printed as exact hex
literals by the code generator.
"""

from __future__ import annotations

import dataclasses
from typing import List, Tuple

from mace_accel.errors import KernelError
from mace_accel.ops.conv_tp.spec import DTYPES, TPSpec
from mace_accel.ops.limits import SM_THREADS, WARP, DeviceLimits


@dataclasses.dataclass(frozen=True)
class PathPlan:
    """One ``uvu`` path as one thread sees it (channel ``u`` fixed).

    Attributes:
        y_offset: first column of the path's edge_attrs segment (``2 l2 + 1`` values).
        out_offset: first column of the output segment; the thread's values start at
            ``out_offset + u * out_dim``.
        w_offset: column of weight ``u`` is ``w_offset + u``.
        terms: ``(a, b, k, coef)``: ``out[k] += coef * x[a] * y[b] * w`` with coef =
            path_weight x CG (float64).
    """

    y_offset: int
    y_dim: int
    out_offset: int
    out_dim: int
    w_offset: int
    terms: Tuple[Tuple[int, int, int, float], ...]


@dataclasses.dataclass(frozen=True)
class SegmentPlan:
    """The warps that own one input segment ``mul x l``."""

    index: int
    mul: int
    x_offset: int
    x_dim: int          # 2 l + 1
    warp_begin: int
    warps: int
    paths: Tuple[PathPlan, ...]

    @property
    def warp_end(self) -> int:
        return self.warp_begin + self.warps


@dataclasses.dataclass(frozen=True)
class KernelHeader:
    """What every conv kernel's shared header (``conv_tp/_header.cuh.j2``) prints: the spec,
    dtype and architecture, and the problem's widths."""

    spec_key: str
    dtype: str
    arch: str
    dim_in1: int
    dim_in2: int
    dim_out: int
    weight_numel: int


def kernel_header(spec: TPSpec, dtype: str, arch: str) -> dict:
    """The :class:`KernelHeader` fields of ``spec`` in ``dtype`` on ``arch``, as keywords."""
    return dict(spec_key=spec.key(), dtype=dtype, arch=arch, dim_in1=spec.dim_in1,
                dim_in2=spec.dim_in2, dim_out=spec.dim_out, weight_numel=spec.weight_numel)


@dataclasses.dataclass(frozen=True)
class KernelPlan(KernelHeader):
    """Everything the code generator prints, for one spec and dtype on one architecture."""

    segments: Tuple[SegmentPlan, ...]
    threads: int
    fwd_tile: int       # edges staged per warp in the forward
    bwd_tile: int       # edges staged per block in the backward
    group: int = 0      # launch number within the ConvPlan (0 writes d edge_attrs, later add)
    fwd_unroll: int = 4  # edges in flight per thread in the forward (register budget permitting)

    @property
    def warps(self) -> int:
        return self.threads // WARP

    @property
    def min_blocks(self) -> int:
        """``__launch_bounds__`` minimum blocks per SM: 1 leaves ptxas the whole register file.

        (A bare thread-count bound made ptxas aim for 64 registers and spill on some problems;
        register pressure is bounded by splitting launches instead, see _max_group_threads.)
        """
        return 1

    @property
    def real_bytes(self) -> int:
        return 8 if self.dtype == "float64" else 4

    def fwd_shared_bytes(self) -> int:
        return self.warps * self.fwd_tile * (self.dim_in2 * self.real_bytes + 8)

    def bwd_shared_bytes(self) -> int:
        staged = self.bwd_tile * (self.dim_in2 * self.real_bytes + 8)
        return staged + self.warps * self.bwd_tile * self.dim_in2 * self.real_bytes


@dataclasses.dataclass(frozen=True)
class ConvPlan:
    """The launches of one convolution: each covers a disjoint set of input segments.

    Wide problems (many channels, float64) are split so each launch keeps its accumulators in
    registers, and the float64 forward runs one segment per launch (see _max_group_threads);
    the launches write disjoint output columns, and the backward's d(edge_attrs) is written by
    launch 0 and accumulated by the later ones (in order: deterministic). The forward and the
    backward are planned apart (``forward_launches``, ``backward_launches``).
    """

    spec_key: str
    dtype: str
    forward_launches: Tuple[KernelPlan, ...]
    backward_launches: Tuple[KernelPlan, ...]
    sender_sum_threads: int  # threads of the per-sender sum of d(node_feats): one per column



def _largest_tile(bytes_for_tile, budget: int, candidates=(32, 16, 8, 4, 2, 1)) -> int:
    for tile in candidates:
        if bytes_for_tile(tile) <= budget:
            return tile
    raise KernelError("not even one edge fits the shared-memory budget")


def plan_kernels(spec: TPSpec, dtype: str, limits: DeviceLimits = DeviceLimits(),
                 by_segment: bool = False) -> ConvPlan:
    """Map ``spec`` onto threads for ``dtype`` (``"float32"|"float64"``) under ``limits``.

    ``by_segment``: one input segment per launch in both directions (every warp of a block
    then does the same work per edge; the staged kernels' blocks wait for their slowest warp
    at each tile).

    Raises:
        KernelError: the spec is not supported by the fused kernels, or does not fit one block.
    """
    if dtype not in DTYPES:
        raise KernelError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    reason = spec.unsupported_reason()
    if reason is not None:
        raise KernelError(f"{spec.describe()} cannot be fused: {reason}")
    if limits.warp_size != WARP:
        raise KernelError(f"the kernels assume 32-thread warps, device has {limits.warp_size}")

    paths_of: dict = {}  # input segment -> its paths
    for p in spec.paths:
        b, c = spec.irreps_in2[p.i_in2], spec.irreps_out[p.i_out]
        coef = tuple((i, j, k, v * p.path_weight) for i, j, k, v in p.cg)
        paths_of.setdefault(p.i_in1, []).append(PathPlan(
            y_offset=spec.offsets_in2[p.i_in2], y_dim=b.ir_dim,
            out_offset=spec.offsets_out[p.i_out], out_dim=c.ir_dim,
            w_offset=p.weight_offset, terms=coef))
    forward_launches, backward_launches = (
        tuple(_plan_launches(spec, dtype, limits, paths_of,
                             WARP if by_segment else _max_group_threads(dtype, way)))
        for way in ("forward", "backward"))
    sender_sum_threads = min(limits.max_threads_per_block,
                             max(WARP, -(-spec.dim_in1 // WARP) * WARP))
    return ConvPlan(spec_key=spec.key(), dtype=dtype, forward_launches=forward_launches,
                    backward_launches=backward_launches, sender_sum_threads=sender_sum_threads)


def _plan_launches(spec: TPSpec, dtype: str, limits: DeviceLimits, by_segment: dict,
                   max_threads: int) -> List[KernelPlan]:
    """The launches of one direction: input segments packed into blocks of ``max_threads``."""
    launches = []
    for g, members in enumerate(_group_segments(spec, by_segment, max_threads)):
        segments, warp = [], 0
        for i in members:
            ir = spec.irreps_in1[i]
            n_warps = -(-ir.mul // WARP)
            segments.append(SegmentPlan(index=i, mul=ir.mul, x_offset=spec.offsets_in1[i],
                                        x_dim=ir.ir_dim, warp_begin=warp, warps=n_warps,
                                        paths=tuple(by_segment[i])))
            warp += n_warps
        threads = warp * WARP
        if threads > limits.max_threads_per_block:
            raise KernelError(
                f"{spec.describe()} needs {threads} threads per block (one per channel of an "
                f"input segment) but the device allows {limits.max_threads_per_block}")
        plan = KernelPlan(**kernel_header(spec, dtype, limits.arch), segments=tuple(segments),
                          threads=max(threads, WARP), fwd_tile=1, bwd_tile=1, group=g,
                          fwd_unroll=_fwd_unroll(dtype, segments, threads))
        fwd_tile = _largest_tile(
            lambda t: dataclasses.replace(plan, fwd_tile=t).fwd_shared_bytes(),
            limits.max_shared_per_block)
        bwd_tile = _largest_tile(
            lambda t: dataclasses.replace(plan, bwd_tile=t).bwd_shared_bytes(),
            limits.max_shared_per_block, candidates=(16, 8, 4, 2, 1))
        launches.append(dataclasses.replace(plan, fwd_tile=fwd_tile, bwd_tile=bwd_tile))
    return launches


def _fwd_unroll(dtype: str, segments: List["SegmentPlan"], threads: int) -> int:
    """Edges in flight per thread in the forward: more hides latency, but each copy of the
    edge body needs its own registers. float64 keeps twice the words per accumulator, so it
    unrolls only small launches (chosen by the nvcc spill check over the catalog)."""
    if dtype == "float32":
        return 4
    small = len(segments) <= 2 and max(seg.x_dim for seg in segments) <= 3
    return 2 if small and threads <= 256 else 1


# most parts a receiver's edges are split into in the backward (see edge_chunks)
MAX_EDGE_CHUNKS = 8


def edge_chunks(n_nodes: int, threads: int, multiprocessors: int,
                threads_per_multiprocessor: int = SM_THREADS) -> int:
    """Parts each receiver's edges are split into in the backward (one block each).

    One block per receiver leaves most of a large GPU idle on small systems (256 atoms: 256
    blocks); the backward's outputs are all per edge, so a receiver's edges can be shared out
    to more blocks, up to as many as the GPU holds at its thread limit.
    """
    room = multiprocessors * max(1, threads_per_multiprocessor // max(1, threads))
    return max(1, min(MAX_EDGE_CHUNKS, room // max(1, n_nodes)))


def _max_group_threads(dtype: str, direction: str) -> int:
    """Threads per launch beyond which a launch is split (register budget per thread).

    float32 fits in 512 threads (~128 registers each). float64 keeps twice the registers per
    value: its backward (the node's output gradient held in registers) fits 256 threads, ~255
    registers each, without spills (the nvcc test of the catalog checks). Its forward runs one
    input segment per launch: the blocks of one launch then do equal work, where a shared block
    waits for its slowest segment. float32 gains little from that and loses on small graphs,
    so it shares blocks (scripts/bench_kernels.py conv, MACE-MP-medium layer 2).
    """
    if dtype == "float32":
        return 512
    return WARP if direction == "forward" else 256


def _group_segments(spec: TPSpec, by_segment: dict, max_threads: int) -> List[List[int]]:
    """Pack input segments, in order, into launches of at most ``max_threads`` threads."""
    groups: List[List[int]] = [[]]
    threads = 0
    for i in sorted(by_segment):
        need = -(-spec.irreps_in1[i].mul // WARP) * WARP
        if groups[-1] and threads + need > max_threads:
            groups.append([])
            threads = 0
        groups[-1].append(i)
        threads += need
    return groups if groups[0] else []


def count_flops_bytes(spec: TPSpec, n_nodes: int, n_edges: int, dtype: str) -> dict:
    """Roofline numbers of the fused convolution (forward and backward), for benchmarks.

    Bytes are the fewest the ops must move: every input read once, every output written once.
    """
    real = 8 if dtype == "float64" else 4
    terms = sum(len(p.cg) * spec.irreps_in1[p.i_in1].mul for p in spec.paths)
    w_cols = spec.weight_numel
    fwd_flops = 2 * n_edges * (terms + w_cols)
    fwd_bytes = real * (n_nodes * (spec.dim_in1 + spec.dim_out)
                        + n_edges * (spec.dim_in2 + w_cols)) + 8 * n_edges
    bwd_flops = 3 * fwd_flops
    bwd_bytes = real * (n_nodes * (2 * spec.dim_in1 + spec.dim_out)
                        + n_edges * (2 * spec.dim_in2 + 2 * w_cols)) + 8 * n_edges
    return {"fwd_flops": fwd_flops, "fwd_bytes": fwd_bytes,
            "bwd_flops": bwd_flops, "bwd_bytes": bwd_bytes}
