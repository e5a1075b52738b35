"""The radial-MLP kernels as the forward and backward of :func:`mace_accel.ops.radial.mlp.
radial_mlp`: the forward writes the output and the hidden pre-activations; the backward (where
the device has its kernel, :func:`has_backward`; else the 3xTF32 layer kernels) reads them. Not
differentiable by themselves: the radial MLP's autograd function calls them."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from mace_accel.ops import registry
from mace_accel.ops.radial.tc import spec as spec_module
from mace_accel.ops.radial.tc.spec import RadialSpec

FAMILY = "radial_tc"
Tensor = torch.Tensor


def register_spec(spec: RadialSpec) -> str:
    """The registry key of ``spec``."""
    return registry.register(FAMILY, spec)


def _kernel(key: str, device: torch.device):
    """The kernels of spec ``key`` on ``device`` (built once per process)."""
    from mace_accel.ops.radial.tc.cuda import CudaRadialMLP

    return registry.cached((FAMILY, key, device),
                           lambda: CudaRadialMLP(registry.lookup(key), device))


def pack_weights(key: str, weights: Sequence[Tensor]) -> Tensor:
    """The layers' ``[w_i, w_{i+1}]`` folded weights packed for the kernel of spec ``key`` on
    their device (each kernel has its own layout; off CUDA the ``mma.sync`` layout of
    :func:`~.spec.pack_weights`, which torch stand-ins read)."""
    if weights[0].device.type != "cuda":
        return spec_module.pack_weights(registry.lookup(key), weights)
    return _kernel(key, weights[0].device).pack(weights)


def forward(key: str, x: Tensor, packed: Tensor, sm_share: Optional[float] = None
            ) -> Tuple[Tensor, Tensor]:
    """``(out [E, n_out], z [n_hidden, E, hidden_width])`` of ``x [E, h0]``: the MLP of spec
    ``key`` and its hidden layers' pre-activations (:func:`pre_views` gives them one by one).
    ``sm_share``: the share of the GPU's multiprocessors the kernel may hold (None: all), for a
    launch beside other work."""
    return _kernel(key, x.device).forward(x.contiguous(), packed, sm_share)


def pre_views(key: str, z: Tensor) -> List[Tensor]:
    """The hidden layers' pre-activations ``[E, h_i]`` in ``z`` (:func:`forward`), as
    :func:`~mace_accel.ops.radial.mlp.pre_activations` returns them (views)."""
    spec: RadialSpec = registry.lookup(key)
    return [z[i] if h == spec.hidden_width else z[i, :, :h]
            for i, h in enumerate(spec.widths[1:-1])]


def has_backward(key: str, device: torch.device) -> bool:
    """Whether the input gradient of spec ``key`` has a kernel on ``device`` (sm_90)."""
    return _kernel(key, device).has_backward


def backward(key: str, grad: Tensor, z: Tensor, packed: Tensor,
             sm_share: Optional[float] = None) -> Tensor:
    """``d x [E, h0]`` of ``<grad [E, n_out], out>`` from the forward's ``z`` and the same
    ``packed`` weights (where :func:`has_backward`)."""
    return _kernel(key, grad.device).backward(grad.contiguous(), z, packed, sm_share)
