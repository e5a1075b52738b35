"""What a kernel schedule needs to know about the target GPU (pure Python, no CUDA needed).

The runtime reads these off the device (:func:`mace_accel.ops.runtime.device_limits`); the CPU
tests and the nvcc compile test use the defaults, which are an H100/H200 (sm_90).
"""

from __future__ import annotations

import dataclasses

WARP = 32
DEFAULT_SMS = 132   # the SMs of an H100/H200 (DeviceLimits' default: the pins, the CPU tests)
BLOCKS_PER_SM = 16  # resident blocks enough to hide latency; grid-stride loops do the rest

# The sm_90 (H100/H200) limits: what the kernels' plans, the pinned sources and the CPU tests
# assume, and what :func:`mace_accel.ops.runtime.device_limits` falls back to where the driver
# does not say. Values of the CUDA programming guide's table for compute capability 9.0.
# shared memory a block gets without opting in (every architecture since sm_20)
STATIC_SHARED = 48 * 1024
# dynamic shared memory a block may opt in to (cudaFuncAttributeMaxDynamicSharedMemorySize):
# the SM's 228 KB less the 1 KB the system reserves per block
OPTIN_SHARED = 227 * 1024
# shared memory of one SM, which its resident blocks share (with the carve-out at its largest)
SM_SHARED = 228 * 1024
# shared memory the system reserves per resident block (sm_80 and later), on top of its own
RESERVED_SHARED = 1024
SM_THREADS = 2048  # resident threads of one SM

# Graphs from this many edges count as large: the staged conv (ops/conv_tp/staged.py) switches
# on here. Its extra set-up per block pays off only once the graph gives every SM of an
# H100/H200 several blocks: it was measured no faster on the benchmarks' graphs of 20k-44k
# edges and faster on those of 87k-539k, and 2**16 is the power of two between 44k and 87k.
LARGE_GRAPH_EDGES = 65536


def resident_blocks(blocks: int, sms: int) -> int:
    """A grid-stride launch's blocks: ``blocks``, at most :data:`BLOCKS_PER_SM` a
    multiprocessor of ``sms``, at least one."""
    return max(1, min(blocks, sms * BLOCKS_PER_SM))


@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    """What the schedule needs to know about the target GPU (defaults: sm_90, H100/H200)."""

    arch: str = "sm_90"                 # e.g. "sm_90" (compute capability 9.0)
    max_threads_per_block: int = 1024
    max_shared_per_block: int = STATIC_SHARED  # static shared memory limit without opt-in
    warp_size: int = WARP
    max_shared_per_block_optin: int = OPTIN_SHARED  # dynamic shared memory, opted in
    threads_per_sm: int = SM_THREADS
    multiprocessors: int = DEFAULT_SMS  # SMs (launch grids only: no source depends on it)
