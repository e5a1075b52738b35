"""What the fused SiLU MLP computes, frozen: the layer widths of ``h = silu(... silu(silu(x W_1)
W_2) ... W_L)``: every layer has a SiLU, no bias (the hidden part of a MACE radial MLP whose
constants are folded into the weights, :mod:`mace_accel.ops.radial.mlp`; its last, linear layer
is applied by the convolution or by one GEMM).

The kernels read the weights as one flat buffer (:func:`pack_weights`): per layer ``W_i`` padded
to ``[Kp_i, Np_i]`` and its transpose ``[Np_i, Kp_i]`` (the backward's product), widths padded to
a multiple of :data:`PAD` with zeros; then the tensor-core section the float64 DMMA kernels read
(:mod:`.dmma`): every layer's ``W_i`` and then every layer's ``W_i^T``, padded to multiples of
:data:`FRAG` and stored as ``mma.sync`` B fragments (:func:`fragments`). A zero-padded column has
pre-activation 0 and SiLU(0) = 0, and meets zero weight rows in the next layer, so padding
changes no result.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import List, Sequence, Tuple

import torch

from mace_accel.errors import UnsupportedModelError

PAD = 4  # widths are padded to a multiple of this (the kernels' widest micro-tile)
MAX_WIDTH = 512  # wider layers stay with cuBLAS (the kernel keeps a tile of each in shared memory)


FRAG = 8  # the tensor-core section's padding: an m16n8k8 product's K and N


def padded(width: int, to: int = PAD) -> int:
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

    @property
    def padded_widths(self) -> Tuple[int, ...]:
        return tuple(padded(w) for w in self.widths)

    def offsets(self) -> List[Tuple[int, int]]:
        """Per layer, ``(offset of W_i, offset of W_i^T)`` in the packed buffer."""
        out, at = [], 0
        p = self.padded_widths
        for i in range(self.n_layers):
            size = p[i] * p[i + 1]
            out.append((at, at + size))
            at += 2 * size
        return out

    @property
    def fragment_widths(self) -> Tuple[int, ...]:
        """The widths padded to :data:`FRAG` (the tensor-core section)."""
        return tuple(padded(w, FRAG) for w in self.widths)

    @property
    def fragment_start(self) -> int:
        """Offset of the tensor-core section (after the ``W_i`` / ``W_i^T`` pairs)."""
        p = self.padded_widths
        return sum(2 * p[i] * p[i + 1] for i in range(self.n_layers))

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
    p, f = spec.padded_widths, spec.fragment_widths
    parts, forward, backward = [], [], []
    for i, w in enumerate(weights):
        full = zero_padded(w, p[i], p[i + 1])
        parts += [full.reshape(-1), full.t().contiguous().reshape(-1)]
        frag = zero_padded(w, f[i], f[i + 1])
        forward.append(fragments(frag))
        backward.append(fragments(frag.t()))
    return torch.cat(parts + forward + backward).contiguous()


def unpack_weights(spec: SiluMLPSpec, packed: torch.Tensor) -> List[torch.Tensor]:
    """The layers' unpadded ``[w_i, w_{i+1}]`` weights of a packed buffer (views)."""
    p = spec.padded_widths
    out = []
    for i, (off, _) in enumerate(spec.offsets()):
        full = packed[off:off + p[i] * p[i + 1]].reshape(p[i], p[i + 1])
        out.append(full[:spec.widths[i], :spec.widths[i + 1]])
    return out
