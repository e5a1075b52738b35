"""Run-time side of the CUDA backend: lazy cupy import, NVRTC compile with caches, launch.

* cupy is imported on first use only (never at import of mace_accel).
* Compiled cubins are cached in memory and on disk, keyed by a hash of (source, options, arch,
  NVRTC version), so a second process does not recompile. The disk cache lives in
  ``$MACE_ACCEL_CACHE_DIR`` or ``~/.cache/mace_accel/kernels``; writes are atomic.
* Kernels run on ``torch.cuda.current_stream(device)`` of the input's device, take raw device
  pointers and allocate nothing themselves, so they work inside ``torch.cuda.graph`` capture
  (after a first eager call has compiled and loaded them).
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import threading
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from .codegen import (SENDER_SUM, backward_name, forward_name, render_backward, render_forward,
                      render_sender_sum)
from .errors import KernelError
from .graph import ConvGraph
from .schedule import ConvPlan, DeviceLimits, plan_kernels
from .spec import TPSpec

NVRTC_OPTIONS = ("-std=c++17",)
_INT32_MAX = 2**31 - 1


@functools.lru_cache(maxsize=None)
def cupy_unavailable_reason() -> Optional[str]:
    """Why cupy (our NVRTC front end) cannot be used, or None. Imports cupy lazily."""
    try:
        import cupy  # noqa: F401
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # ImportError, or a CUDA library missing at load time
        return (f"cupy/NVRTC could not be loaded ({type(exc).__name__}: {exc}); install the "
                "extra matching your CUDA: pip install 'mace-accel[cuda12]' or "
                "'mace-accel[cuda13]'")
    return None


def cache_dir() -> Path:
    root = os.environ.get("MACE_ACCEL_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "mace_accel" / "kernels"


def device_limits(device: torch.device) -> DeviceLimits:
    """Read the schedule's limits off ``device`` (compute capability, block and smem limits)."""
    import cupy

    with cupy.cuda.Device(_index(device)) as dev:
        attrs = dev.attributes
        major, minor = dev.compute_capability[:-1], dev.compute_capability[-1]
    return DeviceLimits(arch=f"sm_{major}{minor}",
                        max_threads_per_block=int(attrs["MaxThreadsPerBlock"]),
                        max_shared_per_block=int(attrs["MaxSharedMemoryPerBlock"]),
                        warp_size=int(attrs["WarpSize"]))


def _index(device: torch.device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


_MEMORY_CACHE: Dict[str, bytes] = {}
_LOCK = threading.Lock()


def compile_cubin(source: str, arch: str, options: Tuple[str, ...] = NVRTC_OPTIONS) -> bytes:
    """Compile ``source`` for ``arch`` (e.g. ``"sm_90"``) with NVRTC; cached in memory and disk.

    Raises:
        KernelError: NVRTC rejected the source (the log is in the message).
    """
    from cupy_backends.cuda.libs import nvrtc

    key = hashlib.sha256("\0".join((source, arch, *options, str(nvrtc.getVersion())))
                         .encode()).hexdigest()
    with _LOCK:
        if key in _MEMORY_CACHE:
            return _MEMORY_CACHE[key]
    path = cache_dir() / f"{key}.cubin"
    if path.is_file():
        cubin = path.read_bytes()
    else:
        prog = nvrtc.createProgram(source, "mace_accel_conv.cu", [], [])
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *options])
        except Exception as exc:
            log = nvrtc.getProgramLog(prog)
            raise KernelError(f"NVRTC failed to compile a generated kernel for {arch}: {exc}\n"
                              f"{log}") from exc
        cubin = nvrtc.getCUBIN(prog)
        nvrtc.destroyProgram(prog)
        _write_atomic(path, cubin)
    with _LOCK:
        _MEMORY_CACHE[key] = cubin
    return cubin


def _write_atomic(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs a recompile in the next process


class _Kernel:
    """A loaded CUDA function on one device."""

    def __init__(self, source: str, name: str, device: torch.device, arch: str) -> None:
        import cupy

        self.name = name
        self.device_index = _index(device)
        cubin = compile_cubin(source, arch)
        with cupy.cuda.Device(self.device_index):
            self._module = cupy.cuda.function.Module()
            self._module.load(cubin)
            self._function = self._module.get_function(name)

    def launch(self, grid: int, block: int, args: tuple) -> None:
        import cupy

        stream = _cupy_stream(torch.cuda.current_stream(self.device_index).cuda_stream,
                              self.device_index)
        with cupy.cuda.Device(self.device_index):
            self._function((grid,), (block,), args, stream=stream)


@functools.lru_cache(maxsize=64)
def _cupy_stream(handle: int, device_index: int):
    """cupy's wrapper of torch's stream ``handle`` (made once per stream, not per launch)."""
    import cupy

    return cupy.cuda.ExternalStream(handle, device_index)


def _ptr(t: Optional[torch.Tensor]) -> np.uint64:
    """A tensor's device pointer as a kernel argument (0 for an absent output)."""
    return np.uint64(0 if t is None else t.data_ptr())


class CudaConvPrimitives:
    """The generated forward and backward kernels of one spec, dtype and device.

    Implements :class:`mace_accel.ops.ConvPrimitives`. Kernels are compiled lazily (the backward
    for each selection of gradients on first use). ``deterministic=False`` selects the atomic
    backward: d(node_feats) is added into the sender rows with float atomics, which skips the
    per-edge message buffer and the per-sender sum (faster, not bit-reproducible).
    """

    def __init__(self, spec: TPSpec, dtype: torch.dtype, device: torch.device,
                 deterministic: bool = True) -> None:
        reason = cupy_unavailable_reason()
        if reason is not None:
            raise KernelError(reason)
        if dtype not in (torch.float32, torch.float64):
            raise KernelError(f"the CUDA kernels run float32 or float64, got {dtype}")
        self.spec, self.dtype = spec, dtype
        self.deterministic = deterministic
        self.device = torch.device("cuda", _index(device))
        limits = device_limits(self.device)
        self.arch = limits.arch
        self.plan: ConvPlan = plan_kernels(spec, str(dtype).replace("torch.", ""), limits)
        self._kernels: Dict[str, _Kernel] = {}
        # columns no path writes must read as zeros (e3nn semantics)
        self._out_all_written = {p.i_out for p in spec.paths} == set(range(len(spec.irreps_out)))
        self._in1_all_read = {p.i_in1 for p in spec.paths} == set(range(len(spec.irreps_in1)))

    def _kernel(self, name: str, render) -> _Kernel:
        k = self._kernels.get(name)
        if k is None:
            k = _Kernel(render(), name, self.device, self.arch)
            self._kernels[name] = k
        return k

    # -- checks before launch -------------------------------------------------------------------
    def _check(self, graph: ConvGraph, **tensors: torch.Tensor) -> None:
        n, e = graph.n_nodes, graph.n_edges
        s = self.spec
        rows = {"x": (n, s.dim_in1), "y": (e, s.dim_in2), "w": (e, s.weight_numel),
                "g": (n, s.dim_out)}
        for name, t in tensors.items():
            if t.dtype != self.dtype:
                raise KernelError(f"{name}: expected {self.dtype}, got {t.dtype}")
            if t.device != self.device:
                raise KernelError(f"{name}: expected device {self.device}, got {t.device}")
            if tuple(t.shape) != rows[name]:
                raise KernelError(f"{name}: expected shape {rows[name]}, got {tuple(t.shape)}")
            if not t.is_contiguous():
                raise KernelError(f"{name}: the kernels read row-major contiguous tensors; "
                                  "call .contiguous() first")
        if n > _INT32_MAX or e > _INT32_MAX:
            raise KernelError(f"{n} nodes / {e} edges exceed the kernels' int32 indexing")
        if graph.sender.device != self.device:
            raise KernelError(f"edge_index is on {graph.sender.device}, inputs on {self.device}")

    # -- primitives -------------------------------------------------------------------------------
    def forward(self, graph: ConvGraph, x: torch.Tensor, y: torch.Tensor,
                w: torch.Tensor) -> torch.Tensor:
        """``out [N, dim_out]``: the fused convolution (see :mod:`mace_accel.reference`)."""
        self._check(graph, x=x, y=y, w=w)
        alloc = torch.empty if self._out_all_written else torch.zeros
        out = alloc((graph.n_nodes, self.spec.dim_out), dtype=self.dtype, device=x.device)
        if graph.n_nodes == 0:
            return out
        row_ptr, perm = graph.csr("receiver")
        sender = graph.index32("sender")
        for plan in self.plan.launches:
            name = forward_name(plan)
            k = self._kernel(name, lambda: render_forward(plan))
            k.launch(graph.n_nodes, plan.threads,
                     (_ptr(x), _ptr(y), _ptr(w), _ptr(sender), _ptr(row_ptr), _ptr(perm),
                      _ptr(out), _i32(graph.n_nodes)))
        return out

    def backward(self, graph: ConvGraph, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
                 g: torch.Tensor, needs: Tuple[bool, bool, bool]):
        """``(gx [N, dim_in1], gy [E, dim_in2], gw [E, weight_numel])``, None where not needed."""
        self._check(graph, x=x, y=y, w=w, g=g)
        needs = tuple(bool(n) for n in needs)
        n, e, s = graph.n_nodes, graph.n_edges, self.spec
        opts = dict(dtype=self.dtype, device=x.device)
        atomic = needs[0] and not self.deterministic  # d(node_feats) added into sender rows
        gx = (torch.zeros if atomic else torch.empty)((n, s.dim_in1), **opts) \
            if needs[0] else None
        gy = torch.empty((e, s.dim_in2), **opts) if needs[1] else None
        gw = torch.empty((e, s.weight_numel), **opts) if needs[2] else None
        if n == 0 or not any(needs):
            return gx, gy, gw
        if atomic:
            gxm = gx
        else:  # per-edge messages, summed per sender below (columns of segments without
            # paths are never written, so they must start at zero)
            gxm = (torch.empty if self._in1_all_read else torch.zeros)((e, s.dim_in1), **opts) \
                if needs[0] else None
        row_ptr, perm = graph.csr("receiver")
        sender = graph.index32("sender")
        for plan in self.plan.launches:  # launch 0 writes gy, later launches add to it
            name = backward_name(plan, needs, atomic)
            k = self._kernel(name, lambda: render_backward(plan, needs, atomic))
            k.launch(n, plan.threads,
                     (_ptr(x), _ptr(y), _ptr(w), _ptr(g), _ptr(sender), _ptr(row_ptr),
                      _ptr(perm), _ptr(gxm), _ptr(gy), _ptr(gw), _i32(n)))
        if gx is not None and not atomic:
            s_ptr, s_perm = graph.csr("sender")
            k = self._kernel(SENDER_SUM, lambda: render_sender_sum(self.plan.launches[0]))
            k.launch(n, min(1024, max(32, -(-s.dim_in1 // 32) * 32)),
                     (_ptr(gxm), _ptr(s_ptr), _ptr(s_perm), _ptr(gx), _i32(n)))
        return gx, gy, gw


def _i32(v: int) -> np.int32:
    return np.int32(v)
