"""The CUDA side of the fused convolution: the generated kernels of one spec, dtype and device.

Kernels are compiled on first use by :mod:`mace_accel.ops.runtime` and launched on torch's
current stream; launch geometry comes from the :class:`~.schedule.ConvPlan`.
"""

from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from mace_accel.errors import KernelError, KernelSizeError
from mace_accel.ops.conv_tp.codegen import (
    SENDER_SUM,
    backward_name,
    forward_name,
    render_backward,
    render_forward,
    render_sender_sum,
)
from mace_accel.ops.conv_tp import staged
from mace_accel.ops.conv_tp.staged import DEFAULT_STAGING, STAGED_MIN_EDGES
from mace_accel.ops.conv_tp.schedule import ConvPlan, KernelPlan, edge_chunks, plan_kernels
from mace_accel.ops.conv_tp.spec import TPSpec
from mace_accel.ops.graph import KernelGraph, ReceiverRows
from mace_accel.ops.runtime import INT32_MAX, CudaKernels, Kernel, compile_soon, i32, ptr
from mace_accel.options import dtype_name


class BackwardBuffers(NamedTuple):
    """The accumulators of one backward over all receivers, filled range by range.

    Attributes:
        needs: the gradients asked for (node_feats, edge_attrs, tp_weights).
        gx: ``[N, dim_in1]`` d(node_feats), or None.
        gxm: ``[E, dim_in1]`` its per-edge messages (deterministic), ``gx`` itself (atomic),
            or None.
        gy: ``[E, dim_in2]`` d(edge_attrs), or None.
    """

    needs: Tuple[bool, bool, bool]
    gx: Optional[torch.Tensor]
    gxm: Optional[torch.Tensor]
    gy: Optional[torch.Tensor]


class CudaConvPrimitives(CudaKernels):
    """The generated forward and backward kernels of one spec, dtype and device.

    Called by the custom ops of :mod:`mace_accel.ops.conv_tp.autograd`. Kernels are compiled
    lazily (the backward for each selection of gradients on first use).
    ``deterministic=False`` selects the atomic backward: d(node_feats) is added into the sender
    rows with float atomics, which skips the per-edge message buffer and the per-sender sum
    (faster, not bit-reproducible).
    """

    def __init__(self, spec: TPSpec, dtype: torch.dtype, device: torch.device,
                 deterministic: bool = True,
                 staging: Optional[Dict[str, Optional[staged.Staging]]] = None) -> None:
        super().__init__(dtype, device)
        self.spec = spec
        self.deterministic = deterministic
        self.staging = dict(DEFAULT_STAGING[dtype_name(dtype)] if staging is None else staging)
        self.staged_min_edges = STAGED_MIN_EDGES
        self.plan: ConvPlan = plan_kernels(spec, dtype_name(dtype), self.limits)
        self._segment_plan: ConvPlan = plan_kernels(spec, dtype_name(dtype), self.limits,
                                                    by_segment=True)
        self._shared_optin = self.limits.max_shared_per_block_optin
        self._launch_cache: Dict[tuple, list] = {}  # see _launches
        # columns no path writes must read as zeros (e3nn semantics)
        self._out_all_written = {p.i_out for p in spec.paths} == set(range(len(spec.irreps_out)))
        self._in1_all_read = {p.i_in1 for p in spec.paths} == set(range(len(spec.irreps_in1)))

    def _staging(self, direction: str, n_edges: int) -> Optional[staged.Staging]:
        """How ``direction`` stages on a graph of ``n_edges`` edges (None: plain kernels)."""
        staging = self.staging.get(direction)
        if staging is None or n_edges < self.staged_min_edges or not self._can_stage():
            return None
        return staging

    def _can_stage(self) -> bool:
        return int(self.arch.split("_")[1]) >= 80  # the staged kernels' cp.async needs sm_80

    def _launches(self, direction: str, needs, atomic: bool, w_sorted: bool, tensors,
                  n_edges: int) -> List[Tuple[KernelPlan, Kernel]]:
        """The launches of ``direction`` and their kernels (built on first use, then cached:
        a call costs a lookup and an alignment check): every launch staged, on the plan its
        staging asks for (one segment a launch or not), else every launch of the plain plan
        plain, where staging is off or the graph small (:meth:`_staging`), a launch's stages
        pass the shared memory, or a tensor does not start on the copies' alignment (a view;
        the plain kernels read any)."""
        staging = self._staging(direction, n_edges)
        key = (direction, needs, atomic, w_sorted, staging is not None)
        entry = self._launch_cache.get(key)
        if entry is None:
            entry = self._launch_cache[key] = [*self._plan_launches(direction, needs, staging),
                                               None]
        launches, vec, kernels = entry
        if vec and any(t is not None and t.numel() and t.data_ptr() % vec for t in tensors):
            return self._launches(direction, needs, atomic, w_sorted, (), -1)  # plain
        if kernels is None:
            kernels = entry[2] = [(plan, self._kernel_of(plan, st, needs, atomic, w_sorted))
                                  for plan, st in launches]
        return kernels

    def _plan_launches(self, direction: str, needs, staging: Optional[staged.Staging]):
        """``([(launch, stage plan or None)], copy alignment in bytes, 0 for plain kernels)``."""
        forward = direction == "forward"
        if staging is not None:
            conv = self._segment_plan if staging.by_segment else self.plan
            plans = conv.forward_launches if forward else conv.backward_launches
            stages = [staged.forward_stages(plan, staging) if forward
                      else staged.backward_stages(plan, needs, staging) for plan in plans]
            if all(st.shared_bytes <= self._shared_optin for st in stages):
                return (list(zip(plans, stages)),
                        max(max(st.w_vec, st.x_vec, st.y_vec) for st in stages))
        plans = self.plan.forward_launches if forward else self.plan.backward_launches
        return [(plan, None) for plan in plans], 0

    def _kernel_of(self, plan: KernelPlan, st: Optional[staged.StagePlan], needs,
                   atomic: bool, w_sorted: bool) -> Kernel:
        """The kernel of one launch: forward where ``needs`` is None; plain where ``st`` is."""
        return self._kernel(*self._source_of(plan, st, needs, atomic, w_sorted))

    @staticmethod
    def _source_of(plan: KernelPlan, st: Optional[staged.StagePlan], needs, atomic: bool,
                   w_sorted: bool) -> Tuple[str, Callable[[], str], int]:
        """``(name, render, dynamic shared bytes)`` of the kernel of one launch."""
        if needs is None and st is None:
            return forward_name(plan, w_sorted), lambda: render_forward(plan, w_sorted), 0
        if needs is None:
            return (staged.staged_forward_name(plan, st, w_sorted),
                    lambda: staged.render_staged_forward(plan, st, w_sorted), st.shared_bytes)
        if st is None:
            return (backward_name(plan, needs, atomic, w_sorted),
                    lambda: render_backward(plan, needs, atomic, w_sorted), 0)
        return (staged.staged_backward_name(plan, st, needs, atomic, w_sorted),
                lambda: staged.render_staged_backward(plan, st, needs, atomic, w_sorted),
                st.shared_bytes)

    def start_compiles(self) -> None:
        """Start compiling (:func:`~mace_accel.ops.runtime.compile_soon`) what a forces call
        launches: the forward, and the backward with the gradients of a first layer (none for
        its node features) and of a later one with its per-sender sum; the staged ones of
        large graphs after the others."""
        atomic = not self.deterministic
        for staged_pass in (False, True):
            for needs in (None, (False, True, True), (True, True, True)):
                direction = "forward" if needs is None else "backward"
                staging = self.staging.get(direction)
                if staged_pass and (staging is None or not self._can_stage()):
                    continue
                launches, _ = self._plan_launches(direction, needs,
                                                  staging if staged_pass else None)
                for plan, st in launches:
                    _, render, _ = self._source_of(plan, st, needs, atomic, False)
                    compile_soon(render(), self.arch, later=staged_pass)
            if not staged_pass and self.deterministic:  # the per-sender sum of d(node_feats)
                compile_soon(render_sender_sum(self.plan.backward_launches[0]), self.arch)

    # -- checks before launch -------------------------------------------------------------------
    def _check(self, n: int, graph: KernelGraph, **tensors: torch.Tensor) -> None:
        e = graph.n_edges
        s = self.spec
        rows = {"x": (n, s.dim_in1), "y": (e, s.dim_in2), "w": (e, s.weight_numel),
                "g": (n, s.dim_out)}
        for name, t in tensors.items():
            self._check_tensor(name, t, rows[name])
        if n > INT32_MAX or e > INT32_MAX:
            raise KernelSizeError(f"{n} nodes / {e} edges exceed the kernels' int32 indexing")
        lengths = {"sender": e, "recv_ptr": n + 1, "recv_perm": e, "send_ptr": n + 1,
                   "send_perm": e}
        for name, t in graph._asdict().items():
            if (t.device != self.device or t.dtype != torch.int32 or not t.is_contiguous()
                    or tuple(t.shape) != (lengths[name],)):
                raise KernelError(f"graph.{name}: expected a contiguous int32 tensor of shape "
                                  f"({lengths[name]},) on {self.device}, got {t.dtype} "
                                  f"{tuple(t.shape)} on {t.device}")

    # -- primitives -------------------------------------------------------------------------------
    def new_output(self, n: int) -> torch.Tensor:
        """``out [n, dim_out]`` for the forward (zeros where no path writes, as in e3nn)."""
        alloc = torch.empty if self._out_all_written else torch.zeros
        return alloc((n, self.spec.dim_out), dtype=self.dtype, device=self.device)

    def forward(self, n: int, graph: KernelGraph, x: torch.Tensor, y: torch.Tensor,
                w: torch.Tensor) -> torch.Tensor:
        """``out [n, dim_out]``: the fused convolution (see :mod:`.reference`)."""
        self._check(n, graph, x=x, y=y, w=w)
        out = self.new_output(n)
        self._launch_forward(n, graph, (x, y, w), out, None)
        return out

    def forward_rows(self, rows: ReceiverRows, graph: KernelGraph, x: torch.Tensor,
                     y: torch.Tensor, w_rows: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``out[rows.n0:rows.n1]``; ``w_rows [rows.e1 - rows.e0, WN]`` are the weights of
        the rows' edges in receiver order."""
        n = out.shape[0]
        self._check(n, graph, x=x, y=y)
        self._check_rows(rows, graph, w_rows)
        self._launch_forward(n, graph, (x, y, w_rows), out, rows)

    def _launch_forward(self, n: int, graph: KernelGraph, xyw, out: torch.Tensor, rows) -> None:
        n0, n1 = rows[:2] if rows is not None else (0, n)
        if n1 <= n0:
            return
        sorted_w = rows is not None
        extra = (i32(rows.e0),) if sorted_w else ()
        for plan, k in self._launches("forward", None, False, sorted_w, xyw, graph.n_edges):
            k.launch(n1 - n0, plan.threads,
                     (*(ptr(t) for t in xyw), ptr(graph.sender), ptr(graph.recv_ptr[n0:]),
                      ptr(graph.recv_perm), ptr(out[n0:]), i32(n1 - n0)) + extra)

    def backward(self, n: int, graph: KernelGraph, x: torch.Tensor, y: torch.Tensor,
                 w: torch.Tensor, g: torch.Tensor, needs: Tuple[bool, bool, bool]):
        """``(gx [N, dim_in1], gy [E, dim_in2], gw [E, weight_numel])``, None where not needed."""
        self._check(n, graph, x=x, y=y, w=w, g=g)
        acc = self.backward_buffers(n, graph, needs)
        gw = self._empty(graph.n_edges, self.spec.weight_numel) if needs[2] else None
        self._launch_backward(n, graph, (x, y, w, g), acc, gw, None)
        return (*self.finish_backward(n, graph, acc), gw)

    def backward_buffers(self, n: int, graph: KernelGraph,
                         needs: Tuple[bool, bool, bool]) -> BackwardBuffers:
        """The accumulators of one backward over all receivers."""
        needs = tuple(bool(v) for v in needs)
        e, s = graph.n_edges, self.spec
        opts = dict(dtype=self.dtype, device=self.device)
        atomic = needs[0] and not self.deterministic  # d(node_feats) added into sender rows
        gx = (torch.zeros if atomic else torch.empty)((n, s.dim_in1), **opts) \
            if needs[0] else None
        gy = torch.empty((e, s.dim_in2), **opts) if needs[1] else None
        if atomic:
            gxm = gx
        else:  # per-edge messages, summed per sender below (columns of segments without
            # paths are never written, so they must start at zero)
            gxm = (torch.empty if self._in1_all_read else torch.zeros)((e, s.dim_in1), **opts) \
                if needs[0] else None
        return BackwardBuffers(needs, gx, gxm, gy)

    def backward_rows(self, rows: ReceiverRows, graph: KernelGraph, x: torch.Tensor,
                      y: torch.Tensor, w_rows: torch.Tensor, g: torch.Tensor,
                      acc: BackwardBuffers) -> Optional[torch.Tensor]:
        """The backward of the receivers ``rows`` into ``acc`` (:meth:`backward_buffers`);
        returns their ``d w [rows.e1 - rows.e0, WN]`` in receiver order (if needed)."""
        n = g.shape[0]
        self._check(n, graph, x=x, y=y, g=g)
        self._check_rows(rows, graph, w_rows)
        gw = torch.empty_like(w_rows) if acc.needs[2] else None
        self._launch_backward(n, graph, (x, y, w_rows, g), acc, gw, rows)
        return gw

    def _launch_backward(self, n: int, graph: KernelGraph, xywg, acc: BackwardBuffers, gw,
                         rows) -> None:
        needs = acc.needs
        n0, n1 = rows[:2] if rows is not None else (0, n)
        if n1 <= n0 or not any(needs):
            return
        atomic = needs[0] and not self.deterministic
        sorted_w = rows is not None
        extra = (i32(rows.e0),) if sorted_w else ()
        x, y, w, g = xywg
        # launch 0 writes gy, the later ones add to it
        for plan, k in self._launches("backward", needs, atomic, sorted_w, (x, y, w),
                                      graph.n_edges):
            chunks = edge_chunks(n1 - n0, plan.threads, self.limits.multiprocessors,
                                 self.limits.threads_per_sm)
            k.launch((n1 - n0) * chunks, plan.threads,
                     (ptr(x), ptr(y), ptr(w), ptr(g[n0:]), ptr(graph.sender),
                      ptr(graph.recv_ptr[n0:]), ptr(graph.recv_perm), ptr(acc.gxm),
                      ptr(acc.gy), ptr(gw), i32(n1 - n0), i32(chunks)) + extra)

    def finish_backward(self, n: int, graph: KernelGraph, acc: BackwardBuffers):
        """``(gx, gy)`` of the accumulators: the per-sender sum of the d(node_feats) messages."""
        if acc.gx is not None and acc.gxm is not acc.gx and n > 0:
            k = self._kernel(SENDER_SUM, lambda: render_sender_sum(self.plan.backward_launches[0]))
            k.launch(n, self.plan.sender_sum_threads, (ptr(acc.gxm), ptr(graph.send_ptr),
                                                       ptr(graph.send_perm), ptr(acc.gx), i32(n)))
        return acc.gx, acc.gy

    def _check_rows(self, rows: ReceiverRows, graph: KernelGraph,
                    w_rows: torch.Tensor) -> None:
        n_nodes = graph.recv_ptr.shape[0] - 1
        if not (0 <= rows.n0 <= rows.n1 <= n_nodes and 0 <= rows.e0 <= rows.e1 <= graph.n_edges):
            raise KernelError(f"receiver rows {tuple(rows)} out of range for {n_nodes} nodes and "
                              f"{graph.n_edges} edges")
        self._check_tensor("w_rows", w_rows, (rows.e1 - rows.e0, self.spec.weight_numel))
