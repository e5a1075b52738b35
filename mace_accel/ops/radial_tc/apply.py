"""The radial-MLP kernel as the forward of :func:`mace_accel.ops.radial_mlp.radial_mlp`: the
output and the hidden pre-activations its backward (the 3xTF32 layer kernels) reads. Not
differentiable by itself: the radial MLP's autograd function calls it."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from mace_accel.ops import registry
from mace_accel.ops.radial_tc import spec as spec_module
from mace_accel.ops.radial_tc.spec import RadialSpec

FAMILY = "radial_tc"
Tensor = torch.Tensor


def register_spec(spec: RadialSpec) -> str:
    """The registry key of ``spec``."""
    return registry.register(FAMILY, spec)


def _kernel(key: str, x: Tensor):
    """The compiled kernel of spec ``key`` on ``x``'s device (built once per process)."""
    from mace_accel.ops.radial_tc.cuda import CudaRadialMLP

    return registry.cached((FAMILY, key, x.device),
                           lambda: CudaRadialMLP(registry.lookup(key), x.device))


def pack_weights(key: str, weights: Sequence[Tensor]) -> Tensor:
    """The layers' ``[w_i, w_{i+1}]`` folded weights packed for the kernel of spec ``key`` on
    their device (each kernel has its own layout; off CUDA the ``mma.sync`` layout of
    :func:`~.spec.pack_weights`, which torch stand-ins read)."""
    if weights[0].device.type != "cuda":
        return spec_module.pack_weights(registry.lookup(key), weights)
    return _kernel(key, weights[0]).pack(weights)


def forward(key: str, x: Tensor, packed: Tensor, sm_share: Optional[float] = None
            ) -> Tuple[Tensor, List[Tensor]]:
    """``(out [E, n_out], [z_1 .. z_{L-1}])`` of ``x [E, h0]``: the MLP of spec ``key`` and its
    hidden layers' pre-activations ``[E, h_i]``, as :func:`~mace_accel.ops.radial_mlp.
    pre_activations` returns them (views of one buffer). ``sm_share``: the share of the GPU's
    multiprocessors the kernel may hold (None: all), for a launch beside other work."""
    spec: RadialSpec = registry.lookup(key)
    out, z = _kernel(key, x).forward(x.contiguous(), packed, sm_share)
    return out, [z[i] if h == spec.hidden_width else z[i, :, :h]
                 for i, h in enumerate(spec.widths[1:-1])]
