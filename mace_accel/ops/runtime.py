"""Run-time side of the CUDA backend, shared by every op family: lazy cupy import, NVRTC compile
with caches, launch on torch's stream.

* cupy is imported on first use only (never at import of mace_accel).
* Compiled cubins are cached in memory and on disk, keyed by a hash of (source, options, arch,
  NVRTC version), so a second process does not recompile. The disk cache lives in
  ``$MACE_ACCEL_CACHE_DIR`` or ``~/.cache/mace_accel/kernels``; writes are atomic.
* Kernels run on ``torch.cuda.current_stream(device)`` of the input's device, take raw device
  pointers and allocate nothing themselves, so they work inside ``torch.cuda.graph`` capture
  (after a first eager call has compiled and loaded them).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import queue
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Tuple

import numpy as np
import torch

from mace_accel.errors import KernelError, KernelSizeError
from mace_accel.ops.limits import (
    OPTIN_SHARED,
    SM_THREADS,
    STATIC_SHARED,
    DeviceLimits,
    resident_blocks,
)

NVRTC_OPTIONS = ("-std=c++17",)
INT32_MAX = 2**31 - 1


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


def cuda_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the CUDA backend cannot run for a model on ``device``, or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch (torch.cuda.is_available() is False)"
    if torch.device(device).type != "cuda":
        return f"the model is on {device}; move it to the GPU first (model.to('cuda'))"
    return cupy_unavailable_reason()


def cache_dir() -> Path:
    root = os.environ.get("MACE_ACCEL_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "mace_accel" / "kernels"


def device_limits(device: torch.device) -> DeviceLimits:
    """Read the schedule's limits off ``device`` (compute capability, block, SM and smem
    limits, the SM count). What torch does not report falls back to the sm_90 values of
    :mod:`mace_accel.ops.limits`; the opt-in shared memory of a device other than sm_90 to
    the limit without opt-in, which every device allows."""
    import cupy

    with cupy.cuda.Device(device_index(device)) as dev:
        attrs = dev.attributes
        major, minor = dev.compute_capability[:-1], dev.compute_capability[-1]
    props = torch.cuda.get_device_properties(device_index(device))
    arch = f"sm_{major}{minor}"
    static = int(attrs["MaxSharedMemoryPerBlock"])
    return DeviceLimits(arch=arch,
                        max_threads_per_block=int(attrs["MaxThreadsPerBlock"]),
                        max_shared_per_block=static,
                        warp_size=int(attrs["WarpSize"]),
                        max_shared_per_block_optin=int(getattr(
                            props, "shared_memory_per_block_optin",
                            OPTIN_SHARED if arch == "sm_90" else static)),
                        threads_per_sm=int(getattr(props, "max_threads_per_multi_processor",
                                                   SM_THREADS)),
                        multiprocessors=int(props.multi_processor_count))


def kernel_device(dtype: torch.dtype, device: torch.device) -> torch.device:
    """The CUDA device an op family's kernels run on, once cupy/NVRTC and ``dtype`` are
    checked (raises :class:`KernelError` naming what is missing)."""
    reason = cupy_unavailable_reason()
    if reason is not None:
        raise KernelError(reason)
    if dtype not in (torch.float32, torch.float64):
        raise KernelError(f"the CUDA kernels run float32 or float64, got {dtype}")
    return torch.device("cuda", device_index(device))


def check_tensor(name: str, t: torch.Tensor, shape: Tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, what: str = "") -> None:
    """Raise :class:`KernelError` unless ``t`` is a contiguous ``dtype`` tensor of ``shape`` on
    ``device`` (what every kernel checks before launch; ``what`` names the problem)."""
    where = f" ({what})" if what else ""
    if not isinstance(t, torch.Tensor):
        raise KernelError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise KernelError(f"{name}: expected {dtype}, got {t.dtype}{where}")
    if t.device != device:
        raise KernelError(f"{name}: expected device {device}, got {t.device}")
    if tuple(t.shape) != tuple(shape):
        raise KernelError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}{where}")
    if not t.is_contiguous():
        raise KernelError(f"{name}: the kernels read row-major contiguous tensors; call "
                          ".contiguous() first")


def device_index(device: torch.device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


_MEMORY_CACHE: Dict[str, bytes] = {}
_PENDING: Dict[str, "Future[bytes]"] = {}  # compiles started by compile_soon, until done
_LOCK = threading.Lock()
# background compiles at once (threads: NVRTC releases the GIL; what they gain is in
# docs/performance.md, "Cold start")
COMPILE_THREADS = 8


class _Compiler:
    """Daemon threads that compile in the background: unlike a ThreadPoolExecutor's, the
    process does not wait for them at exit (a kernel started but never launched is not worth
    waiting for; the disk cache's writes are atomic)."""

    def __init__(self, threads: int) -> None:
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        for i in range(threads):
            threading.Thread(target=self._work, name=f"mace-accel-nvrtc-{i}", daemon=True).start()

    def submit(self, fn, *args, future: "Optional[Future[bytes]]" = None) -> "Future[bytes]":
        """Queue ``fn(*args)``; its result goes to ``future`` (a new one where None)."""
        future = Future() if future is None else future
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            _fulfil(*self._queue.get())


def _fulfil(future: "Future[bytes]", fn, args: tuple) -> None:
    """Run ``fn(*args)`` into ``future``: its result, or the exception kept for whoever waits on
    it (a compiling thread's job, or a held one run where it is needed)."""
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)


_COMPILER: Optional[_Compiler] = None


def _nvrtc_version() -> str:
    from cupy_backends.cuda.libs import nvrtc

    return str(nvrtc.getVersion())


def _cubin_key(source: str, arch: str, options: Tuple[str, ...]) -> str:
    return hashlib.sha256("\0".join((source, arch, *options, _nvrtc_version()))
                          .encode()).hexdigest()


def _nvrtc_compile(source: str, arch: str, options: Tuple[str, ...]) -> bytes:
    """The cubin of ``source`` from NVRTC (no cache)."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, "mace_accel_kernel.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *options])
        return nvrtc.getCUBIN(prog)
    except Exception as exc:
        raise KernelError(f"NVRTC failed to compile a generated kernel for {arch}: "
                          f"{exc}\n{nvrtc.getProgramLog(prog)}") from exc
    finally:
        nvrtc.destroyProgram(prog)


def compile_cubin(source: str, arch: str, options: Tuple[str, ...] = NVRTC_OPTIONS) -> bytes:
    """Compile ``source`` for ``arch`` (e.g. ``"sm_90"``) with NVRTC; cached in memory and disk.
    Where :func:`compile_soon` started the same compile, wait for it.

    Raises:
        KernelError: NVRTC rejected the source (the log is in the message).
    """
    key = _cubin_key(source, arch, options)
    with _LOCK:
        if key in _MEMORY_CACHE:
            return _MEMORY_CACHE[key]
        pending = _PENDING.get(key)
        held = _HELD.pop(key, None) if _HELD is not None else None
    if held is not None:  # started in a batch not queued yet: compiled here, now (an error is
        _, future, job = held  # raised below, where the kernel is needed)
        _fulfil(future, job[0], job[1:])
    if pending is not None:
        try:
            return pending.result()
        except Exception:  # compiled again below: the error is raised where the kernel is needed
            pass
    return _compile_to_caches(source, arch, options, key)


def compile_soon(source: str, arch: str, options: Tuple[str, ...] = NVRTC_OPTIONS,
                 later: bool = False) -> None:
    """Start compiling ``source`` on a background thread, for a kernel the model's first calls
    are expected to launch (:meth:`~mace_accel.patches.adopt.FusedModule.start_compiles`):
    several compile at once instead of one after another as the call reaches them. Nothing to
    do where it is compiled or started already, or on disk. A failure here is not reported: the
    kernel, if it is launched, is compiled again and fails there. ``later``: a kernel only some
    calls launch (large graphs), queued after the others of a :func:`compiles_longest_first`
    batch."""
    global _COMPILER
    key = _cubin_key(source, arch, options)
    with _LOCK:
        if key in _MEMORY_CACHE or key in _PENDING or (cache_dir() / f"{key}.cubin").is_file():
            return
        if _COMPILER is None:
            _COMPILER = _Compiler(min(COMPILE_THREADS, os.cpu_count() or 1))
            os.register_at_fork(after_in_child=_forget_compiles)
        job = (_compile_to_caches, source, arch, options, key)
        if _HELD is not None:  # queued when the batch ends, longest first
            _PENDING[key] = Future()
            _HELD[key] = ((later, -len(source)), _PENDING[key], job)
        else:
            _PENDING[key] = _COMPILER.submit(*job)


# compiles started inside compiles_longest_first(), until it ends: key -> ((later, -length of
# the source): the order they are queued in, future, job)
_HELD: Optional[Dict[str, Tuple[Tuple[bool, int], "Future[bytes]", tuple]]] = None


@contextlib.contextmanager
def compiles_longest_first() -> Iterator[None]:
    """The :func:`compile_soon` calls inside go to the compiling threads together at the end,
    longest source first (those marked ``later`` after all others): a model's largest kernels
    (its post-convolution linears, 1-4 s of NVRTC each) no longer start last and set the wait
    of its first call (longest job first keeps the last thread's finish near the average).
    Nothing inside may wait for them."""
    global _HELD
    with _LOCK:
        outer, _HELD = _HELD, ({} if _HELD is None else _HELD)
    try:
        yield
    finally:
        with _LOCK:
            held, _HELD = _HELD, outer
            if outer is None:
                for _, future, job in sorted(held.values(), key=lambda item: item[0]):
                    _COMPILER.submit(*job, future=future)


def _forget_compiles() -> None:
    """In a forked child: the parent's compiling threads are not there, so nothing it started
    may be waited for (the child compiles what it needs itself)."""
    global _COMPILER, _PENDING, _LOCK, _HELD
    _COMPILER, _PENDING, _LOCK, _HELD = None, {}, threading.Lock(), None


def _compile_to_caches(source: str, arch: str, options: Tuple[str, ...], key: str) -> bytes:
    """The cubin of ``source`` from the disk cache or NVRTC, then in both caches."""
    try:
        path = cache_dir() / f"{key}.cubin"
        if path.is_file():
            cubin = path.read_bytes()
        else:
            cubin = _nvrtc_compile(source, arch, options)
            _write_atomic(path, cubin)
        with _LOCK:
            _MEMORY_CACHE[key] = cubin
        return cubin
    finally:
        with _LOCK:
            _PENDING.pop(key, None)


def _write_atomic(path: Path, data: bytes) -> None:
    from mace_accel.files import atomic_write_bytes

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
    except OSError:
        pass  # a read-only home only costs a recompile in the next process


class Kernel:
    """A loaded CUDA function on one device."""

    def __init__(self, source: str, name: str, device: torch.device, arch: str,
                 dynamic_shared: int = 0) -> None:
        """``dynamic_shared``: bytes of dynamic shared memory every launch gets (above the
        48 KB default a kernel must opt in; done here, once)."""
        import cupy

        self.name = name
        self.device_index = device_index(device)
        self.dynamic_shared = int(dynamic_shared)
        cubin = compile_cubin(source, arch)
        with cupy.cuda.Device(self.device_index):
            self._module = cupy.cuda.function.Module()
            self._module.load(cubin)
            self._function = self._module.get_function(name)
            if self.dynamic_shared > STATIC_SHARED:
                _opt_in_shared(self._function, self.dynamic_shared, name)

    def launch(self, grid, block: int, args: tuple) -> None:
        """``grid``: blocks along x, or a tuple (x, y[, z]), on torch's current stream of the
        kernel's device."""
        # the raw handle, not torch.cuda.current_stream(): a launch is host time on every call
        # of a model too small to fill the GPU (a Stream object costs several microseconds)
        index = self.device_index
        stream = _cupy_stream(torch._C._cuda_getCurrentRawStream(index), index)
        grid = grid if isinstance(grid, tuple) else (grid,)
        if torch._C._cuda_getDevice() == index:  # the usual case: no switch of devices
            self._function(grid, (block,), args, shared_mem=self.dynamic_shared, stream=stream)
            return
        import cupy

        with cupy.cuda.Device(index):
            self._function(grid, (block,), args, shared_mem=self.dynamic_shared, stream=stream)


_MAX_DYNAMIC_SHARED_ATTRIBUTE = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def _opt_in_shared(function, size: int, name: str) -> None:
    """Let ``function`` launch with ``size`` bytes of dynamic shared memory."""
    from cupy_backends.cuda.api import driver

    try:
        driver.funcSetAttribute(function.ptr, _MAX_DYNAMIC_SHARED_ATTRIBUTE, size)
    except Exception as exc:  # CUDA_ERROR_INVALID_VALUE: the device has less to give
        raise KernelError(f"kernel {name} needs {size} bytes of shared memory per block, which "
                          f"this GPU does not allow ({exc}); it is built for sm_80 or newer "
                          "(A100, H100, H200)") from exc


class CudaKernels:
    """The base of an op family's CUDA side for one dtype on one device: what every family's
    starts from. The device its kernels run on (checked by :func:`kernel_device`) and its
    limits (:func:`device_limits`), the kernels loaded so far, and what a launch checks and
    allocates before it runs.

    Args:
        dtype: ``torch.float32`` or ``torch.float64``.
        device: a CUDA device.
        what: names the problem in a failed check (a spec's description, say).
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, what: str = "") -> None:
        self.dtype = dtype
        self.device = kernel_device(dtype, device)
        self.limits = device_limits(self.device)
        self.arch = self.limits.arch
        self.what = what
        self._kernels: Dict[str, Kernel] = {}

    def _kernel(self, name: str, render: Callable[[], str], dynamic_shared: int = 0) -> Kernel:
        """The kernel ``name`` of the source ``render()`` gives, loaded on first use."""
        kernel = self._kernels.get(name)
        if kernel is None:
            kernel = self._kernels[name] = self._load(render(), name, dynamic_shared)
        return kernel

    def _load(self, source: str, name: str, dynamic_shared: int = 0) -> Kernel:
        """The kernel ``name`` of ``source``, compiled for this device and loaded on it."""
        return Kernel(source, name, self.device, self.arch, dynamic_shared=dynamic_shared)

    def _check_tensor(self, name: str, t: torch.Tensor, shape: Tuple[int, ...],
                      dtype: Optional[torch.dtype] = None) -> None:
        """:func:`check_tensor` on this device, of the kernels' dtype unless ``dtype`` is
        given."""
        check_tensor(name, t, shape, self.dtype if dtype is None else dtype, self.device,
                     self.what)

    def _empty(self, *shape: int) -> torch.Tensor:
        """An uninitialised output ``[*shape]`` of the kernels' dtype on their device."""
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _blocks(self, blocks: int) -> int:
        """The grid of a grid-stride launch of ``blocks`` blocks on this device
        (:func:`~mace_accel.ops.limits.resident_blocks`)."""
        return resident_blocks(blocks, self.limits.multiprocessors)


class _RawStream:
    """A raw CUDA stream handle in the CUDA stream protocol, which cupy's
    ``Stream.from_external`` reads."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> Tuple[int, int]:
        return (0, self.handle)  # (the protocol's version, the cudaStream_t)


@functools.lru_cache(maxsize=64)
def _cupy_stream(handle: int, index: int):
    """cupy's wrapper of torch's stream ``handle`` on device ``index`` (made once per stream,
    not per launch)."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:  # cupy 13 (cupy 14 deprecates ExternalStream)
        return cupy.cuda.ExternalStream(handle, index)
    return from_external(_RawStream(handle))


_SIDE_STREAMS: Dict[Tuple[str, int], "torch.cuda.Stream"] = {}


def side_stream(purpose: str, device: torch.device) -> "torch.cuda.Stream":
    """The process's side stream for ``purpose`` on ``device``, made on first use.

    One per purpose and device for the whole process, not one per model or per call: torch's
    allocator caches freed memory per stream (a radial-table build leaves tens of GB there, for
    the next build to reuse) and keeps a cuBLAS workspace for every stream that ran a GEMM,
    which would pin the memory of streams nobody uses any more."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get((purpose, index))
    if stream is None:
        stream = _SIDE_STREAMS[(purpose, index)] = torch.cuda.Stream(device=index)
    return stream


def is_aligned16(t: torch.Tensor) -> bool:
    """Whether ``t`` starts on a 16-byte boundary (what the kernels' 16-byte copies read)."""
    return t.data_ptr() % 16 == 0


def check_aligned(name: str, t: Optional[torch.Tensor], what: str) -> None:
    """Raise :class:`KernelError` unless ``t`` (None: nothing to check) starts on a 16-byte
    boundary, as ``what``'s 16-byte copies need."""
    if t is not None and not is_aligned16(t):
        raise KernelError(f"{name}: {what} copies 16-byte chunks and needs a 16-byte aligned "
                          "tensor; pass a fresh .contiguous() copy")


def aligned16(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy where its start is not 16-byte aligned (for kernels that read row pairs
    as 16-byte vectors; a view may start mid-pair)."""
    return t if is_aligned16(t) else t.clone()


def check_rows(n: int, tile: int, what: str) -> None:
    """Raise :class:`KernelError` unless ``n`` rows, rounded up to a tile of ``tile``, index in
    int32: for kernels that take the row index as an ``int`` and every global offset in 64 bits
    (``(size_t)row * width``), so the width does not count."""
    if n + tile > INT32_MAX:
        raise KernelSizeError(f"{n} rows exceed {what}'s int32 row index (at most "
                              f"{INT32_MAX - tile})")


def ptr(t: Optional[torch.Tensor]) -> np.uint64:
    """A tensor's device pointer as a kernel argument (0 for an absent output)."""
    return np.uint64(0 if t is None else t.data_ptr())


def i32(v: int) -> np.int32:
    return np.int32(v)
