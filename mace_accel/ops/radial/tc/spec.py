"""What the radial-MLP kernels compute, frozen: ``out = silu(... silu(x W_0) ...) W_L``, the
layer widths ``widths = (h0, h1, ..., h_L, n_out)`` of a MACE radial MLP whose constants are
folded into its weights (:mod:`mace_accel.ops.radial.mlp`).

The kernels read the weights as one flat buffer (:func:`pack_weights`): each layer's folded
weight ``[k, n]`` transposed, ``[n, k]`` row-major, with the input and hidden widths padded to a
multiple of :data:`PAD` with zeros (the last layer's rows ``n_out`` are not padded). A padded
column has pre-activation 0 and SiLU(0) = 0, and meets zero weights in the next layer, so
padding changes no result. The forward reads the blocks as ``[n][k]`` and the backward reads
the same blocks as ``[k][n]``: one copy serves both.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch

from mace_accel.errors import UnsupportedModelError
from mace_accel.ops.radial.silu_mlp.spec import LayerWidths, check_layer_weights, zero_padded

PAD = 32  # input and hidden widths are padded to this (a warp column of the 2 x 4 warp grid)
MAX_HIDDEN = 64  # wider inputs or hidden layers keep the GEMM path (shared memory)
ALIGN = 4  # n_out: 16-byte copies and 8-byte stores of the last layer


def padded(width: int) -> int:
    return -(-width // PAD) * PAD


def unsupported_reason(widths: Sequence[int]) -> Optional[str]:
    """Why the MLP of ``widths`` cannot run in the kernels, or None."""
    widths = tuple(int(w) for w in widths)
    if len(widths) < 3:
        return f"the radial kernels need at least one hidden layer, got widths {widths}"
    if min(widths) < 1:
        return f"layer widths must be positive, got {widths}"
    if max(widths[:-1]) > MAX_HIDDEN:
        return (f"the radial kernels take inputs and hidden layers up to {MAX_HIDDEN} wide, got "
                f"{widths[:-1]}")
    if widths[-1] % ALIGN:
        return (f"the radial kernels need the output width to be a multiple of {ALIGN}, got "
                f"{widths[-1]}")
    return None


@dataclasses.dataclass(frozen=True)
class RadialSpec(LayerWidths):
    """``[E, widths[0]] -> [E, widths[-1]]``: ``len(widths) - 2`` SiLU layers, then a linear
    one."""

    widths: Tuple[int, ...]

    def __post_init__(self) -> None:
        why = unsupported_reason(self.widths)
        if why is not None:
            raise UnsupportedModelError(why)

    @property
    def padded_widths(self) -> Tuple[int, ...]:
        """Input and hidden widths padded to :data:`PAD`; the output width as it is."""
        return tuple(padded(w) for w in self.widths[:-1]) + (self.widths[-1],)

    def offsets(self) -> List[int]:
        """Per layer, the offset of its ``[n_pad, k_pad]`` block in the packed buffer."""
        p = self.padded_widths
        out, at = [], 0
        for i in range(self.n_layers):
            out.append(at)
            at += p[i] * p[i + 1]
        return out

    @property
    def hidden_width(self) -> int:
        """The widest hidden layer: the row width of the pre-activations the kernel writes."""
        return max(self.widths[1:-1])

    @property
    def packed_numel(self) -> int:
        p = self.padded_widths
        return sum(p[i] * p[i + 1] for i in range(self.n_layers))

    def describe(self) -> str:
        return f"radial MLP {'->'.join(map(str, self.widths))} (3xTF32 kernels)"


def pack_weights(spec: RadialSpec, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The flat kernel buffer (see module docstring) of the layers' ``[w_i, w_{i+1}]`` folded
    weights.

    Raises:
        UnsupportedModelError: the weights do not have the spec's shapes.
    """
    check_layer_weights(spec.describe(), spec.widths, weights)
    p = spec.padded_widths
    parts = [zero_padded(w.t(), p[i + 1], p[i]).reshape(-1) for i, w in enumerate(weights)]
    return torch.cat(parts).contiguous()


def unpack_weights(spec: RadialSpec, packed: torch.Tensor) -> List[torch.Tensor]:
    """The layers' unpadded ``[w_i, w_{i+1}]`` weights of a packed buffer (views)."""
    p = spec.padded_widths
    out = []
    for i, off in enumerate(spec.offsets()):
        block = packed[off:off + p[i] * p[i + 1]].reshape(p[i + 1], p[i])
        out.append(block[:spec.widths[i + 1], :spec.widths[i]].t())
    return out
