"""What the fused SiLU MLP computes, frozen: the layer widths of ``h = silu(... silu(silu(x W_1)
W_2) ... W_L)``: every layer has a SiLU, no bias (the hidden part of a MACE radial MLP whose
constants are folded into the weights, :mod:`mace_accel.ops.radial.mlp`; its last, linear layer
is applied by the convolution or by one GEMM). The kernels are float64 on Hopper's tensor cores
(:mod:`.dmma`).

One flat buffer holds the weights (:func:`pack_weights`): every layer's ``W_i [w_i, w_{i+1}]``
as it is (the plain-torch reference and the gradients read these), then, from
:attr:`SiluMLPSpec.fragment_start`, the section the kernels read: every layer's ``W_i`` and then
every layer's ``W_i^T``, padded with zeros to multiples of :data:`FRAG` and stored as
``mma.sync`` B fragments (:func:`fragments`). A zero-padded column has pre-activation 0 and
SiLU(0) = 0, and meets zero weight rows in the next layer, so padding changes no result.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import List, Sequence, Tuple

import torch

from mace_accel.errors import UnsupportedModelError

FRAG = 8  # the tensor-core section's padding: an m16n8k8 product's K and N
# the widest layer: the kernels hold a warp's whole activation row of it (8 n-tiles of 8) in
# registers; wider MLPs stay with the GEMMs
MAX_WIDTH = 64
FRAGMENT_ALIGN = 64  # the fragment section starts on a multiple of this many reals (a fragment tile)


def padded(width: int, to: int = FRAG) -> int:
    return -(-width // to) * to


class LayerWidths:
    """What the MLP specs share: ``widths`` (a field of the dataclass), a stable key, the layer
    count."""

    widths: Tuple[int, ...]

    def key(self) -> str:
        """Stable hex digest of the spec (kernel names and cache keys)."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    @property
    def n_layers(self) -> int:
        return len(self.widths) - 1


@dataclasses.dataclass(frozen=True)
class SiluMLPSpec(LayerWidths):
    """``[E, widths[0]] -> [E, widths[-1]]`` through ``len(widths) - 1`` SiLU layers."""

    widths: Tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.widths) < 2 or any(int(w) < 1 for w in self.widths):
            raise UnsupportedModelError(f"a SiLU MLP needs at least one layer of positive "
                                        f"widths, got {self.widths}")
        if max(self.widths) > MAX_WIDTH:
            raise UnsupportedModelError(f"the fused SiLU MLP takes layers up to {MAX_WIDTH} "
                                        f"wide, got {self.widths}")

    def offsets(self) -> List[int]:
        """Per layer, the offset of ``W_i`` (unpadded, row-major) in the packed buffer."""
        sizes = [self.widths[i] * self.widths[i + 1] for i in range(self.n_layers)]
        return [sum(sizes[:i]) for i in range(self.n_layers)]

    @property
    def fragment_widths(self) -> Tuple[int, ...]:
        """The widths padded to :data:`FRAG` (the tensor-core section)."""
        return tuple(padded(w, FRAG) for w in self.widths)

    @property
    def fragment_start(self) -> int:
        """Offset of the tensor-core section (after the plain ``W_i``)."""
        plain = sum(self.widths[i] * self.widths[i + 1] for i in range(self.n_layers))
        return padded(plain, FRAGMENT_ALIGN)

    def fragment_offsets(self) -> List[Tuple[int, int]]:
        """Per layer, ``(offset of W_i's fragments, offset of W_i^T's)`` in the packed buffer;
        each is a multiple of 64 reals (a fragment tile: 32 lanes x 2)."""
        f = self.fragment_widths
        sizes = [f[i] * f[i + 1] for i in range(self.n_layers)]
        start, total = self.fragment_start, sum(sizes)
        forward = [start + sum(sizes[:i]) for i in range(self.n_layers)]
        return [(at, at + total) for at in forward]

    @property
    def packed_numel(self) -> int:
        f = self.fragment_widths
        return self.fragment_start + sum(2 * f[i] * f[i + 1] for i in range(self.n_layers))

    def describe(self) -> str:
        return f"SiLU MLP {'->'.join(map(str, self.widths))}"


def check_layer_weights(what: str, widths: Sequence[int],
                        weights: Sequence[torch.Tensor]) -> None:
    """Raise :class:`UnsupportedModelError` unless ``weights`` are ``[widths[i], widths[i+1]]``
    for each layer of ``what`` (a description for the message)."""
    if len(weights) != len(widths) - 1:
        raise UnsupportedModelError(f"{what} has {len(widths) - 1} layers, got "
                                    f"{len(weights)} weight matrices")
    for i, w in enumerate(weights):
        want = (widths[i], widths[i + 1])
        if tuple(w.shape) != want:
            raise UnsupportedModelError(f"layer {i} of {what}: weight of shape "
                                        f"{tuple(w.shape)}, expected {want}")


def zero_padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t [r, c]`` in the top-left corner of a zero ``[rows, cols]``."""
    full = t.new_zeros((rows, cols))
    full[:t.shape[0], :t.shape[1]] = t
    return full


def fragments(b: torch.Tensor) -> torch.Tensor:
    """``[K * N]``: the B operand ``b [K, N]`` (multiples of :data:`FRAG`) of an ``mma.sync``
    m16n8k8 product in the order the DMMA kernels load it: per tile ``(kt, nt)`` (``nt``
    fastest), per lane (``g = lane // 4``, ``t = lane % 4``) the pair ``b[8 kt + 2 t, 8 nt + g]``,
    ``b[8 kt + 2 t + 1, 8 nt + g]``. The pair sits where m16n8k8 wants rows ``t`` and ``t + 4``
    of the tile: the K index is permuted within each tile of 8 so that a product's output
    fragment (columns ``2 t``, ``2 t + 1`` of each tile) is the next product's A fragment as it
    stands, with no exchange between lanes."""
    k, n = b.shape
    lane = torch.arange(32, device=b.device)
    g, t = lane // 4, lane % 4
    kt = torch.arange(k // FRAG, device=b.device).view(-1, 1, 1, 1)
    nt = torch.arange(n // FRAG, device=b.device).view(1, -1, 1, 1)
    rows = FRAG * kt + 2 * t.view(1, 1, -1, 1) + torch.arange(2, device=b.device).view(1, 1, 1, 2)
    cols = FRAG * nt + g.view(1, 1, -1, 1)
    return b[rows, cols].reshape(-1)


def pack_weights(spec: SiluMLPSpec, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The flat kernel buffer (see module docstring) of the layers' ``[w_i, w_{i+1}]`` weights
    (differentiable in ``weights``).

    Raises:
        UnsupportedModelError: the weights do not have the spec's shapes.
    """
    check_layer_weights(spec.describe(), spec.widths, weights)
    f = spec.fragment_widths
    plain, forward, backward = [], [], []
    for i, w in enumerate(weights):
        plain.append(w.reshape(-1))
        frag = zero_padded(w, f[i], f[i + 1])
        forward.append(fragments(frag))
        backward.append(fragments(frag.t()))
    gap = spec.fragment_start - sum(t.numel() for t in plain)
    return torch.cat(plain + [weights[0].new_zeros(gap)] + forward + backward).contiguous()


def unpack_weights(spec: SiluMLPSpec, packed: torch.Tensor) -> List[torch.Tensor]:
    """The layers' ``[w_i, w_{i+1}]`` weights of a packed buffer (views)."""
    w = spec.widths
    return [packed[off:off + w[i] * w[i + 1]].view(w[i], w[i + 1])
            for i, off in enumerate(spec.offsets())]
