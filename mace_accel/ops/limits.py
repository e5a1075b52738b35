"""What a kernel schedule needs to know about the target GPU (pure Python, no CUDA needed).

The runtime reads these off the device (:func:`mace_accel.ops.runtime.device_limits`); the CPU
tests and the nvcc compile test use the defaults, which are an H100/H200 (sm_90).
"""

from __future__ import annotations

import dataclasses

WARP = 32
DEFAULT_SMS = 132   # what a device without a known SM count gets (an H100/H200 has 132)
BLOCKS_PER_SM = 16  # resident blocks enough to hide latency; grid-stride loops do the rest


@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    """What the schedule needs to know about the target GPU."""

    arch: str = "sm_90"                 # e.g. "sm_90" (compute capability 9.0)
    max_threads_per_block: int = 1024
    max_shared_per_block: int = 48 * 1024  # static shared memory limit without opt-in
    warp_size: int = WARP
