"""Where one energy+forces call spends its time: radial MLP, conv TP, linears, symmetric
contraction, other; plus the host-side neighbour list and batch building.

Forward hooks open a ``torch.profiler.record_function`` range around each hooked submodule
(``conv_tp_weights`` → radial MLP, ``conv_tp`` → conv TP, ``linear``/``linear_up``/``skip_tp``
→ linears, ``products`` → symmetric contraction); the innermost range wins, so work one part
runs from inside another's module (the radial MLP's last layer applied by the fused conv)
keeps its own part through the ranges of :mod:`mace_accel.profiling`. The forces' backward
pass is attributed through autograd's sequence numbers: a backward node belongs to the part
whose range held the forward op that created it. On CUDA the table sums the kernels' self
device time; on the CPU, self CPU time. Whatever is not attributed (embeddings, spherical
harmonics, readouts' sums, scatter of energies, unlinked kernels, Python overhead on the CPU) is
"other". A backend that replays a captured CUDA graph runs no module forwards, so all of its
time shows as "other".
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from mace_accel.bench.timing import synchronize
from mace_accel.models.batch import ModelInfo
from mace_accel.profiling import PART_RANGE, RADIAL_MLP, part_range

HOOKED = {
    "conv_tp_weights": RADIAL_MLP,
    "density_fn": RADIAL_MLP,
    "conv_tp": "conv TP",
    "linear": "linears",
    "linear_up": "linears",
    "linear_res": "linears",
    "linear_1": "linears",
    "linear_2": "linears",
    "skip_tp": "linears",
    "products": "symmetric contraction",
}
PARTS = (RADIAL_MLP, "conv TP", "linears", "symmetric contraction")
OTHER = "other"
TOP_KERNELS = 8
_CALL_RANGE = "mace_accel.bench.call"
_BACKWARD_PREFIX = "autograd::engine::evaluate_function:"


@dataclasses.dataclass
class PartTime:
    """Time and kernel (CUDA) or leaf-op (CPU) count of one part of the call."""

    part: str
    time_ms: float
    count: int


@dataclasses.dataclass
class ProfileResult:
    """One profiled call.

    Attributes:
        clock: ``"self CUDA time"`` or ``"self CPU time"``.
        count_label: ``"kernels"`` (CUDA) or ``"ops"`` (CPU leaf aten ops).
        parts: the four parts and ``other``, in table order.
        total_ms: all attributed plus unattributed time of the call.
        total_count: all kernels (CUDA) or leaf ops (CPU) of the call.
        host: ``{"neighbour_list_ms", "batch_build_ms"}`` (batch building excludes the
            neighbour list), when measured.
        gpu: :func:`gpu_state` right after the call (empty off CUDA or where torch cannot
            read it): hosts of one GPU model differ in their clocks under load, which moves
            the tensor-core-bound parts (the 3xFP16 linears) more than the memory-bound ones.
        kernels: per part, its heaviest CUDA kernels as ``(name, ms, launches)``, heaviest
            first (:data:`TOP_KERNELS` of each; empty on the CPU): what a part's time is made of,
            so two profiles of one model that disagree can be told apart by name.
    """

    clock: str
    count_label: str
    parts: List[PartTime]
    total_ms: float
    total_count: int
    host: Dict[str, float] = dataclasses.field(default_factory=dict)
    gpu: Dict[str, float] = dataclasses.field(default_factory=dict)
    kernels: Dict[str, List[Tuple[str, float, int]]] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"clock": self.clock, "count_label": self.count_label,
                "parts": {p.part: {"time_ms": p.time_ms, "count": p.count} for p in self.parts},
                "total_ms": self.total_ms, "total_count": self.total_count, "host": self.host,
                "gpu": self.gpu, "kernels": {part: [list(k) for k in top]
                                             for part, top in self.kernels.items()}}


def gpu_state(device: torch.device | str) -> Dict[str, float]:
    """``{"sm_clock_mhz", "power_w", "temperature_c"}`` of a CUDA ``device`` now (NVML through
    torch), or ``{}`` where they cannot be read (no pynvml, another vendor, the CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    try:
        return {"sm_clock_mhz": float(torch.cuda.clock_rate(device)),
                "power_w": torch.cuda.power_draw(device) / 1000.0,
                "temperature_c": float(torch.cuda.temperature(device))}
    except Exception:  # pynvml missing or the query unsupported: the profile stands without it
        return {}


def hooked_modules(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module, str]]:
    """``(path, module, part)`` of every submodule to bracket, outermost only.

    Items of a ModuleList take the list's name (``products.0`` is a ``products`` module). A
    module inside an already hooked one (the ``linear`` inside ``products.0``, or the e3nn TP
    kept inside a fused ``conv_tp``) belongs to its ancestor's part.
    """
    found: List[Tuple[str, torch.nn.Module, str]] = []
    for path, module in model.named_modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue  # containers have no forward; their items carry the hooks
        # an item of a ModuleList (products.0) takes the list's name
        names = [n for n in path.split(".") if not n.isdigit()]
        part = HOOKED.get(names[-1]) if names else None
        if part is None or any(path.startswith(p + ".") for p, _, _ in found):
            continue
        found.append((path, module, part))
    return found


@contextlib.contextmanager
def part_ranges(model: torch.nn.Module) -> Iterator[int]:
    """Bracket each hooked submodule's forward in a named profiler range; yields the count."""
    open_ranges: List[torch.profiler.record_function] = []
    handles = []

    def opener(part: str):
        def pre_hook(module, args):
            rf = part_range(part)
            rf.__enter__()
            open_ranges.append(rf)
        return pre_hook

    def closer(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    modules = hooked_modules(model)
    try:
        for _, module, part in modules:
            handles.append(module.register_forward_pre_hook(opener(part)))
            handles.append(module.register_forward_hook(closer))
        yield len(modules)
    finally:
        for handle in handles:
            handle.remove()
        while open_ranges:  # a forward that raised leaves its range open
            open_ranges.pop().__exit__(None, None, None)


def _is_range(name: str) -> bool:
    return name == _CALL_RANGE or name.startswith(PART_RANGE)


def _own_part(evt) -> Optional[str]:
    return evt.name[len(PART_RANGE):] if evt.name.startswith(PART_RANGE) else None


def _forward_part(evt) -> Optional[str]:
    while evt is not None:
        part = _own_part(evt)
        if part is not None:
            return part
        evt = evt.cpu_parent
    return None


def _backward_node(evt):
    while evt is not None:
        if evt.name.startswith(_BACKWARD_PREFIX):
            return evt
        evt = evt.cpu_parent
    return None


def _is_runtime_call(evt) -> bool:
    """A CUDA runtime or driver API call (``cudaLaunchKernel``, CuPy's ``cuLaunchKernel``,
    ``cudaMemcpyAsync``); torch's ops, autograd's nodes and our ranges are named otherwise."""
    return evt.name.startswith("cu")


def _launching_ops(cpu, device) -> Dict[int, Any]:
    """``id(device event) -> the CPU op that launched it``, where the launch was recorded.

    A device event shares its ``id`` (CUPTI's correlation id) with the runtime call that
    launched it; the launcher is the innermost op whose time holds that call (the backward's
    ops, on autograd's thread, start inside the forward thread's call range: innermost wins).
    """
    launched_at = {e.id: e.time_range.start for e in cpu if _is_runtime_call(e)}
    # innermost first when walked backwards: the latest start, then the earliest end
    ops = sorted((e for e in cpu if not _is_runtime_call(e)),
                 key=lambda op: (op.time_range.start, -op.time_range.end))
    starts = [op.time_range.start for op in ops]
    owner: Dict[int, Any] = {}
    for k in device:
        at = launched_at.get(k.id)
        if at is None:
            continue
        # back from the last op started by the launch to the first that still runs: a few
        # steps (the launcher's children that ended before it), not every op of the call
        for i in range(bisect.bisect_right(starts, at) - 1, -1, -1):
            if ops[i].time_range.end >= at:
                owner[id(k)] = ops[i]
                break
    return owner


def attribute(events, on_cuda: bool
              ) -> Tuple[List[PartTime], float, int, Dict[str, List[Tuple[str, float, int]]]]:
    """Split the profiler's events of one call into parts.

    Args:
        events: ``profiler.events()`` of a run holding exactly one model call.
        on_cuda: attribute CUDA kernel time (True) or CPU time (False).

    Returns:
        (parts in table order incl. ``other``, total ms, total kernel/op count, each part's
        heaviest kernels as in :attr:`ProfileResult.kernels`).
    """
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    fwd_of: Dict[Tuple[int, int], str] = {}
    fwd_threads = set()
    part_of: Dict[int, Optional[str]] = {}
    for evt in cpu:
        part = _forward_part(evt)
        part_of[id(evt)] = part
        if part is not None and evt.sequence_nr >= 0:
            fwd_of[(evt.sequence_nr, evt.thread)] = part
            fwd_threads.add(evt.thread)
    # sequence numbers count per thread; with one forward thread they alone identify the op,
    # which guards against thread ids that the profiler reports differently for backward nodes
    fwd_of_seq = {seq: part for (seq, _), part in fwd_of.items()} if len(fwd_threads) == 1 \
        else {}
    for evt in cpu:
        if part_of[id(evt)] is None:
            node = _backward_node(evt)
            if node is not None:
                part_of[id(evt)] = fwd_of.get((node.sequence_nr, node.fwd_thread),
                                              fwd_of_seq.get(node.sequence_nr))

    # one (part, name, us, count) per unit of work, each counted once
    device = [e for e in events if e.device_type != DeviceType.CPU
              and not _is_range(e.name)] if on_cuda else []
    if device:
        # CUPTI: each device event once, under the CPU op that launched it. Not the ops' own
        # kernel lists: torch appends a kernel to every op that carries the launch's linked
        # id, and ops of two threads can share one (MH-1: the radial table's 0.8 ms forward
        # kernel sat in a linear's backward op too, and counted in both parts). Our ranges
        # also appear on the device, spanning their kernels: not work of their own (counting
        # them tripled the total).
        owner = _launching_ops(cpu, device)
        work = [(part_of[id(owner[id(k)])] if id(k) in owner else None, k.name,
                 float(k.time_range.elapsed_us()), 1) for k in device]
    elif on_cuda:
        # without CUPTI, torch times every op with CUDA events ("legacy" kernels that
        # include the children's): count leaves only, so nothing is counted twice
        work = [(part_of[id(evt)], k.name, k.duration, 1) for evt in cpu
                if not (evt.is_legacy and evt.cpu_children) for k in evt.kernels]
    else:
        work = [(part_of[id(evt)], evt.name, evt.self_cpu_time_total,
                 int(evt.name.startswith("aten::") and not any(
                     c.name.startswith("aten::") for c in evt.cpu_children))) for evt in cpu]
    time_us = {p: 0.0 for p in PARTS}
    count = {p: 0 for p in PARTS}
    by_kernel: Dict[Tuple[str, str], List[float]] = {}
    for part, name, us, n in work:
        if part is not None:
            time_us[part] += us
            count[part] += n
        if on_cuda:
            slot = by_kernel.setdefault((part or OTHER, name), [0.0, 0])
            slot[0] += us
            slot[1] += n
    total_n = sum(n for *_, n in work)
    if on_cuda:
        total_us = float(sum(us for _, _, us, _ in work))
    else:
        total_us = float(sum(e.cpu_time_total for e in cpu if e.name == _CALL_RANGE))
    parts = [PartTime(p, time_us[p] / 1e3, count[p]) for p in PARTS]
    parts.append(PartTime(OTHER, max(total_us - sum(time_us.values()), 0.0) / 1e3,
                          max(total_n - sum(count.values()), 0)))
    kernels: Dict[str, List[Tuple[str, float, int]]] = {}
    for (part, name), (us, n) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0]):
        top = kernels.setdefault(part, [])
        if len(top) < TOP_KERNELS:
            top.append((name, us / 1e3, int(n)))
    return parts, total_us / 1e3, total_n, kernels


def profile_call(model: torch.nn.Module, batch: Dict[str, torch.Tensor],
                 device: torch.device | str, compute_stress: bool = False,
                 call: Optional[Callable[[], Any]] = None) -> ProfileResult:
    """Profile one ``model(batch, training=False, compute_force=True)`` call, or ``call()``
    (the same model's call another way), run warm."""
    from torch.profiler import ProfilerActivity, profile, record_function

    on_cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with part_ranges(model):
        synchronize(device)
        with profile(activities=activities) as prof:
            with record_function(_CALL_RANGE):
                if call is not None:
                    call()
                else:
                    model(dict(batch), training=False, compute_force=True,
                          compute_stress=compute_stress)
            synchronize(device)
    gpu = gpu_state(device)  # the sampled clock of the call just made
    parts, total_ms, total_n, kernels = attribute(prof.events(), on_cuda)
    return ProfileResult("self CUDA time" if on_cuda else "self CPU time",
                         "kernels" if on_cuda else "ops", parts, total_ms, total_n, gpu=gpu,
                         kernels=kernels)


def time_host_graph(atoms, info: ModelInfo, dtype: torch.dtype,
                    device: torch.device | str) -> Dict[str, float]:
    """Host time of the neighbour list, and of the rest of batch building (to ``device``).

    Returns:
        ``{"neighbour_list_ms": ..., "batch_build_ms": ...}``; the second excludes the first.
    """
    from mace_accel._e3nn_compat import import_mace

    import_mace()
    from mace.data.neighborhood import get_neighborhood

    from mace_accel.bench.systems import BenchSystem, make_batch

    t0 = time.perf_counter()
    get_neighborhood(np.asarray(atoms.positions, dtype=np.float64), cutoff=info.r_max,
                     pbc=tuple(bool(p) for p in atoms.pbc), cell=np.array(atoms.cell))
    neighbour_ms = (time.perf_counter() - t0) * 1e3
    system = BenchSystem(atoms, "given", None, {}, "")
    t0 = time.perf_counter()
    make_batch(system, info, dtype, device)
    synchronize(device)
    total_ms = (time.perf_counter() - t0) * 1e3
    return {"neighbour_list_ms": neighbour_ms,
            "batch_build_ms": max(total_ms - neighbour_ms, 0.0)}


def render_profile(result: ProfileResult, title: str = "") -> str:
    """Table of the parts: time, share of the call, kernel/op count; then the host times."""
    lines = [title] if title else []
    lines.append(f"  {'part':<22} {'ms':>10} {'%':>6} {result.count_label:>8}   ({result.clock})")
    for p in result.parts:
        share = 100.0 * p.time_ms / result.total_ms if result.total_ms > 0 else 0.0
        lines.append(f"  {p.part:<22} {p.time_ms:>10.3f} {share:>6.1f} {p.count:>8d}")
    lines.append(f"  {'total (one call)':<22} {result.total_ms:>10.3f} {100.0:>6.1f} "
                 f"{result.total_count:>8d}")
    if result.host:
        lines.append(f"  host: neighbour list {result.host['neighbour_list_ms']:.2f} ms, batch "
                     f"building excl. neighbour list {result.host['batch_build_ms']:.2f} ms")
    if result.gpu:
        lines.append(f"  GPU after the call: SM clock {result.gpu['sm_clock_mhz']:.0f} MHz, "
                     f"{result.gpu['power_w']:.0f} W, {result.gpu['temperature_c']:.0f} C")
    return "\n".join(lines)
