"""Named profiler ranges that tell ``mace-accel bench --profile`` which part of the model runs.

The profile brackets the forwards of the parts' submodules (:mod:`mace_accel.bench.profile`)
and credits each kernel to the innermost range around the op that launched it (in the
backward: around the forward op that made its autograd node). Work of one part that runs
from inside another part's module opens its own range here: the radial MLP's last layer,
applied by the fused conv when the last layer is folded in, stays radial-MLP work (only a
kernel that does both, one launch, would be the conv's).

Outside a profiler run a range costs a few microseconds of host time, and none in a replayed
CUDA graph; ``torch.compile`` traces through it.
"""

from __future__ import annotations

import torch

PART_RANGE = "mace_accel.bench.part::"
RADIAL_MLP = "radial MLP"


def part_range(part: str) -> torch.profiler.record_function:
    """Context manager: the ops inside belong to ``part`` (e.g. :data:`RADIAL_MLP`)."""
    return torch.profiler.record_function(PART_RANGE + part)
