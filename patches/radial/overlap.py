"""The later interaction blocks' radial MLPs beside the earlier blocks' work, on a side stream.

Every interaction block's radial MLP maps the same edge features ``[E, h0]`` to its TP weights;
nothing else feeds it. In a small system's call the blocks' node-wise kernels (linears, skip,
symmetric contraction on a few hundred nodes) fill a few SMs each, one after the other, and
leave the rest of the GPU idle. So when the first block calls its radial MLP, the later blocks'
radial MLPs are launched on a side CUDA stream right after it, and each later block takes its
weights from there (its stream waits on an event). Inside a captured CUDA graph the fork and
the join become graph edges: the later MLPs run beside the first block's conv, linears and
product. Autograd runs each op's backward on the stream of its forward, so their backward also
runs beside the earlier blocks' backward.

A caller that has the edge features before the first block runs (the lean energy head,
:mod:`mace_accel.models.energy_head`, which calls the blocks itself) starts every block's MLP,
the first one's too, right after the edge features (:meth:`RadialOverlap.start`): the first
block's node-wise linears then run beside its radial MLP as well.

Results are bit for bit those of the serial call: the same kernels on the same inputs, only the
order between independent kernels changes. Above :data:`OVERLAP_MAX_EDGES` edges every kernel
fills the GPU by itself, and starting a block's MLP early would only hold its ``[E, weights]``
output longer, so larger calls run in order.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from mace_accel.ops.runtime import side_stream
from mace_accel.options import AccelOptions

Tensor = torch.Tensor
OVERLAP_MAX_EDGES = 131072
# Not an option (the same results bit for bit, only where it was measured to help, see
# OVERLAP_MAX_EDGES): tests and ``--serial`` of scripts/bench_model.py graphs and
# scripts/profile_gpu.py md switch it off to compare with the serial order.
_OVERLAP = True


class RadialOverlap:
    """The radial MLPs of one model, in block order, on the process's radial side stream of
    their device.

    Args:
        members: the model's fused radial MLP modules in the order the blocks call them; each
            has a ``compute(x [E, h0]) -> Tensor`` method (its serial forward).
    """

    def __init__(self, members: List[torch.nn.Module]) -> None:
        self.members = list(members)
        self._pending: Dict[int, Tuple[Tensor, int, Tensor, torch.cuda.Event]] = {}

    def __getstate__(self) -> dict:
        return {"members": self.members}  # events and results stay in this process

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["members"])

    def describe(self) -> str:
        return (f"radial MLPs 2..{len(self.members)} of the model's {len(self.members)} (in the "
                f"order the blocks call them) start on a side CUDA stream when the first is "
                f"called (with the lean energy head all of them, right after the edge features), "
                f"beside the earlier blocks' work (calls up to {OVERLAP_MAX_EDGES} edges; same "
                "results bit for bit)")

    @staticmethod
    def overlaps(x: Tensor) -> bool:
        """Whether a call on edge features ``x`` forks: CUDA, at most :data:`OVERLAP_MAX_EDGES`
        edges, not inside ``torch.compile`` (which orders the kernels itself)."""
        return x.is_cuda and x.shape[0] <= OVERLAP_MAX_EDGES \
            and not torch.compiler.is_compiling()

    def __call__(self, member: torch.nn.Module, x: Tensor) -> Tensor:
        """``member.compute(x)``, forked or joined as above."""
        index = next((i for i, m in enumerate(self.members) if m is member), None)
        if index is not None:
            pending = self._pending.pop(index, None)
            if pending is not None:
                return self._join(pending, x, lambda: member.compute(x))
        if index == 0:
            return self._first(x)
        return member.compute(x)

    def start(self, x: Tensor) -> bool:
        """Launch every member's MLP, the first block's too, on the side stream now: a caller
        that has the edge features before the first block's node-wise work (the lean energy
        head, :mod:`mace_accel.models.energy_head`) lets that work run beside them. Each block
        joins its result at its call (or computes its own if handed other features). Returns
        whether anything was forked."""
        self._pending.clear()
        return self._fork(x, range(len(self.members)))

    def _fork(self, x: Tensor, indices: range) -> bool:
        """Launch the members ``indices`` on ``x`` on the side stream (when :meth:`overlaps`
        and there is a side stream), each result pending with its event; whether it did."""
        if len(indices) == 0 or not self.overlaps(x):
            return False
        main = torch.cuda.current_stream(x.device)
        side = side_stream("radial", x.device)
        if side == main:
            return False
        side.wait_stream(main)
        x.record_stream(side)
        with torch.cuda.stream(side):
            for i in indices:
                result = self.members[i].compute(x)
                done = torch.cuda.Event()
                done.record(side)
                self._pending[i] = (x, x._version, result, done)
        return True

    def _first(self, x: Tensor) -> Tensor:
        self._pending.clear()  # a call that stopped half-way leaves nothing for the next
        out = self.members[0].compute(x)
        self._fork(x, range(1, len(self.members)))
        return out

    @staticmethod
    def _join(pending: Tuple[Tensor, int, Tensor, torch.cuda.Event], x: Tensor,
              serial: Callable[[], Tensor]) -> Tensor:
        """The forked result if it was made from this very ``x``, else the serial one; the
        current stream waits on the fork either way (a capture needs every fork joined)."""
        made_from, version, result, done = pending
        main = torch.cuda.current_stream(x.device)
        main.wait_event(done)
        if made_from is not x or version != x._version:
            return serial()
        result.record_stream(main)  # the side stream's allocator must not reuse it early
        return result


def group_of(model: torch.nn.Module) -> Optional[RadialOverlap]:
    """The :class:`RadialOverlap` linking ``model``'s radial MLPs, or None."""
    for module in model.modules():
        group = getattr(module, "overlap", None)
        if isinstance(group, RadialOverlap):
            return group
    return None


def link(model: torch.nn.Module, options: AccelOptions,
         is_member: Callable[[torch.nn.Module], bool]) -> Optional[RadialOverlap]:
    """Give the fused radial MLPs of ``model`` (those ``is_member`` takes, in module order) one
    :class:`RadialOverlap` as ``overlap``, when the backend is CUDA and there are at least two
    (and :data:`_OVERLAP` is on); returns it, or None (then each runs in order)."""
    members = [m for m in model.modules() if is_member(m)]
    for m in members:
        m.overlap = None
    if not _OVERLAP or options.backend != "cuda" or len(members) < 2:
        return None
    group = RadialOverlap(members)
    for m in members:
        m.overlap = group
    return group
