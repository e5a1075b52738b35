"""The kernel cache's background compiles (:func:`mace_accel.ops.runtime.compile_soon`): started
once per source, waited for by the call that needs the kernel, written to the disk cache, and a
failure raised where the kernel is needed, not in the background. NVRTC is replaced by a slow
stand-in (no GPU here); the surgery's part, which kernels a model starts, runs on the GPU."""

from __future__ import annotations

import threading
import time

import pytest

from mace_accel.errors import KernelError
from mace_accel.ops import runtime


@pytest.fixture
def nvrtc(monkeypatch, tmp_path):
    """A stand-in NVRTC that takes 0.2 s a source and counts its compiles; a fresh cache."""
    compiled = []
    failing = set()

    def compile_(source, arch, options):
        time.sleep(0.2)
        compiled.append((source, threading.current_thread().name))
        if source in failing:
            raise KernelError(f"NVRTC failed to compile {source}")
        return f"cubin of {source}".encode()

    monkeypatch.setattr(runtime, "_nvrtc_version", lambda: "stand-in")
    monkeypatch.setattr(runtime, "_nvrtc_compile", compile_)
    monkeypatch.setattr(runtime, "_MEMORY_CACHE", {})
    monkeypatch.setattr(runtime, "_PENDING", {})
    monkeypatch.setenv("MACE_ACCEL_CACHE_DIR", str(tmp_path))
    return compiled, failing


def test_started_compiles_run_at_once_and_are_waited_for(nvrtc, tmp_path):
    compiled, _ = nvrtc
    sources = [f"kernel {i}" for i in range(4)]
    start = time.perf_counter()
    for source in sources + sources:  # the second start of a source does nothing
        runtime.compile_soon(source, "sm_90")
    cubins = [runtime.compile_cubin(source, "sm_90") for source in sources]
    took = time.perf_counter() - start
    assert cubins == [f"cubin of {s}".encode() for s in sources]
    assert sorted(s for s, _ in compiled) == sources  # each once
    assert all(name.startswith("mace-accel-nvrtc") for _, name in compiled)
    if runtime.COMPILE_THREADS >= 4 and (runtime.os.cpu_count() or 1) >= 2:
        assert took < 0.2 * len(sources) - 0.1  # not one after another
    assert len(list(tmp_path.glob("*.cubin"))) == len(sources)
    assert not runtime._PENDING
    runtime.compile_soon(sources[0], "sm_90")  # compiled: nothing started
    assert len(compiled) == len(sources) and not runtime._PENDING


def test_a_compile_found_on_disk_is_not_started(nvrtc):
    compiled, _ = nvrtc
    runtime.compile_cubin("kernel", "sm_90")
    runtime._MEMORY_CACHE.clear()  # a new process: only the disk cache
    runtime.compile_soon("kernel", "sm_90")
    assert not runtime._PENDING
    assert runtime.compile_cubin("kernel", "sm_90") == b"cubin of kernel"
    assert len(compiled) == 1


def test_a_failed_background_compile_fails_where_the_kernel_is_needed(nvrtc):
    compiled, failing = nvrtc
    failing.add("bad kernel")
    runtime.compile_soon("bad kernel", "sm_90")  # raises nothing here
    with pytest.raises(KernelError, match="bad kernel"):
        runtime.compile_cubin("bad kernel", "sm_90")
    assert [s for s, _ in compiled] == ["bad kernel", "bad kernel"]  # compiled again to raise
    assert not runtime._MEMORY_CACHE and not runtime._PENDING


@pytest.mark.skipif(not hasattr(runtime.os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_wait_for_its_parents_compiles(nvrtc):
    """The parent's compiling threads are not in a forked child: the child compiles itself
    instead of waiting for a compile that would never finish."""
    import os

    runtime.compile_soon("kernel", "sm_90")
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only where it got the cubin by compiling it itself
        ok = False
        try:
            ok = not runtime._PENDING and runtime.compile_cubin("kernel", "sm_90") == \
                b"cubin of kernel"
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert runtime.compile_cubin("kernel", "sm_90") == b"cubin of kernel"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_the_convolution_starts_every_kernel_a_forces_call_launches(dtype, deterministic,
                                                                    monkeypatch):
    """The conv's head start (:meth:`CudaConvPrimitives.start_compiles`) covers what its
    launches pick for a forces call (the forward; the backward of a first layer, without the
    node features' gradient, and of a later one) on a small and a large graph, on an sm_90
    device stood in for on the CPU."""
    import torch

    from mace_accel.ops.conv_tp import cuda
    from mace_accel.ops.conv_tp.catalog import CATALOG
    from mace_accel.ops.conv_tp.spec import make_spec
    from mace_accel.ops.conv_tp.staged import STAGED_MIN_EDGES
    from mace_accel.ops.limits import DeviceLimits

    monkeypatch.setattr(runtime, "kernel_device", lambda dtype_, device: torch.device("cpu"))
    monkeypatch.setattr(runtime, "device_limits", lambda device: DeviceLimits())
    started, launched = set(), set()
    monkeypatch.setattr(cuda, "compile_soon",
                        lambda source, arch, later=False: started.add(source))
    conv = cuda.CudaConvPrimitives(make_spec(*CATALOG["mp-medium-l2"].irreps),
                                   getattr(torch, dtype), torch.device("cpu"), deterministic)
    assert conv.staged_min_edges == STAGED_MIN_EDGES  # small graphs run the plain kernels
    monkeypatch.setattr(conv, "_kernel", lambda name, render, shared=0: launched.add(render()))
    conv.start_compiles()
    for n_edges in (1_000, STAGED_MIN_EDGES):
        for needs in (None, (False, True, True), (True, True, True)):
            conv._launches("forward" if needs is None else "backward", needs,
                           not deterministic, False, (), n_edges)
    if deterministic:
        conv._kernel(cuda.SENDER_SUM,
                     lambda: cuda.render_sender_sum(conv.plan.backward_launches[0]))
    assert launched and launched <= started


def test_a_batch_of_compiles_starts_longest_first(nvrtc, monkeypatch):
    """Inside ``compiles_longest_first`` nothing is queued; at its end the sources go to the
    threads longest first, those only some calls launch (``later``) last (one thread here, so
    the order is the compile order), and each is waited for as any other compile."""
    compiled, _ = nvrtc
    monkeypatch.setattr(runtime, "COMPILE_THREADS", 1)
    monkeypatch.setattr(runtime, "_COMPILER", None)
    sources = ["short", "a much longer kernel source", "medium size"]
    large_graphs_only = "the longest source of all: a staged kernel"
    with runtime.compiles_longest_first():
        runtime.compile_soon(large_graphs_only, "sm_90", later=True)
        for source in sources:
            runtime.compile_soon(source, "sm_90")
        time.sleep(0.3)
        assert compiled == [] and len(runtime._PENDING) == 4  # held, yet known as started
        # a kernel needed now, inside the batch (a constructor that loads its kernel): compiled
        # here at once, not waited for until the batch ends
        needed = "needed inside"
        runtime.compile_soon(needed, "sm_90")
        assert runtime.compile_cubin(needed, "sm_90") == b"cubin of needed inside"
        assert [s for s, _ in compiled] == [needed]
        compiled.clear()
    assert [runtime.compile_cubin(s, "sm_90") for s in sources] == [
        f"cubin of {s}".encode() for s in sources]
    runtime.compile_cubin(large_graphs_only, "sm_90")
    assert [s for s, _ in compiled] == sorted(sources, key=len, reverse=True) + [
        large_graphs_only]
    assert runtime._HELD is None and not runtime._PENDING
