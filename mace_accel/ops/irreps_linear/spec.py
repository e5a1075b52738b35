"""What an equivariant linear map of node features computes, frozen: the input and output irrep
blocks, and which input block feeds which output block through which weight matrix.

Covers e3nn's ``o3.Linear`` (one weight set) and the element-dependent skip connection of MACE
(e3nn ``FullyConnectedTensorProduct(node_feats, Zx0e)`` with one-hot node attributes), which is
a linear map whose weights are picked by the node's element: ``Z`` weight sets.

The op takes the *effective* weights: per instruction ``[Z, mul_in, mul_out]`` with e3nn's path
weights folded in, concatenated (:func:`effective_weights` with :func:`linear_scales` or
:func:`skip_scales`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import List, Optional, Sequence, Tuple

import torch

from mace_accel.errors import UnsupportedModelError


@dataclasses.dataclass(frozen=True)
class Block:
    """One irrep block of a feature row: ``mul`` channels of dimension ``d`` at ``offset``."""

    offset: int
    mul: int
    d: int

    @property
    def size(self) -> int:
        return self.mul * self.d


@dataclasses.dataclass(frozen=True)
class LinearInstruction:
    """Input block ``i_in`` to output block ``i_out`` through weights at ``w_offset``
    (``[Z, mul_in, mul_out]``)."""

    i_in: int
    i_out: int
    w_offset: int


@dataclasses.dataclass(frozen=True)
class LinearSpec:
    """An equivariant linear map ``[N, dim_in] -> [N, dim_out]``.

    Attributes:
        in_blocks, out_blocks: the irrep blocks (each instruction joins two of equal ``d``).
        instructions: in weight order.
        num_elements: ``Z``: 1 for shared weights, else the weight sets picked by ``elem``.
    """

    in_blocks: Tuple[Block, ...]
    out_blocks: Tuple[Block, ...]
    instructions: Tuple[LinearInstruction, ...]
    num_elements: int = 1

    def __post_init__(self) -> None:
        for ins in self.instructions:
            a, b = self.in_blocks[ins.i_in], self.out_blocks[ins.i_out]
            if a.d != b.d:
                raise UnsupportedModelError(f"instruction {ins} joins blocks of dimension "
                                            f"{a.d} and {b.d}")

    def key(self) -> str:
        """Stable hex digest of the spec (kernel names and cache keys)."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    @property
    def dim_in(self) -> int:
        return sum(b.size for b in self.in_blocks)

    @property
    def dim_out(self) -> int:
        return sum(b.size for b in self.out_blocks)

    @property
    def indexed(self) -> bool:
        return self.num_elements > 1

    def weight_shapes(self) -> List[Tuple[int, int, int]]:
        return [(self.num_elements, self.in_blocks[i.i_in].mul, self.out_blocks[i.i_out].mul)
                for i in self.instructions]

    @property
    def weight_numel(self) -> int:
        return sum(z * a * b for z, a, b in self.weight_shapes())

    def transposed(self) -> "LinearSpec":
        """The adjoint map (``[N, dim_out] -> [N, dim_in]``), whose weights are these with each
        ``[Z, mul_in, mul_out]`` transposed to ``[Z, mul_out, mul_in]``, same offsets: the
        backward of this map."""
        return LinearSpec(self.out_blocks, self.in_blocks,
                          tuple(LinearInstruction(i.i_out, i.i_in, i.w_offset)
                                for i in self.instructions), self.num_elements)

    def fed_prefix(self) -> Optional["LinearSpec"]:
        """This map without the trailing output blocks that no instruction feeds (zero in
        every output: ``[N, dim_in] -> [N, r]``, its leading ``r`` columns), or None where the
        last block is fed. The weights and their offsets are these."""
        last = max((ins.i_out for ins in self.instructions), default=-1)
        if last == len(self.out_blocks) - 1:
            return None
        return LinearSpec(self.in_blocks, self.out_blocks[:last + 1], self.instructions,
                          self.num_elements)

    def describe(self) -> str:
        kind = f"element-indexed ({self.num_elements} weight sets)" if self.indexed else "shared"
        return (f"linear {self.dim_in}->{self.dim_out}, {len(self.instructions)} paths, "
                f"{kind} weights")


def weight_block(spec: LinearSpec, ins: LinearInstruction, w: torch.Tensor) -> torch.Tensor:
    """The ``[Z, mul_in, mul_out]`` view of instruction ``ins``'s weights in the flat ``w``."""
    z, a, b = spec.num_elements, spec.in_blocks[ins.i_in].mul, spec.out_blocks[ins.i_out].mul
    return w[ins.w_offset:ins.w_offset + z * a * b].view(z, a, b)


def transpose_weights(spec: LinearSpec, w: torch.Tensor) -> torch.Tensor:
    """The weights of ``spec.transposed()`` from ``w`` (differentiable)."""
    parts = [weight_block(spec, ins, w).transpose(1, 2).reshape(-1) for ins in spec.instructions]
    return torch.cat(parts) if parts else w[:0]


def _blocks(irreps) -> Tuple[Block, ...]:
    blocks, offset = [], 0
    for mul, ir in irreps:
        blocks.append(Block(offset, int(mul), int(ir.dim)))
        offset += int(mul) * int(ir.dim)
    return tuple(blocks)


def _offsets(shapes: List[Tuple[int, int, int]]) -> List[int]:
    offsets, at = [], 0
    for z, a, b in shapes:
        offsets.append(at)
        at += z * a * b
    return offsets


# -- e3nn o3.Linear ------------------------------------------------------------------------------
def linear_reason(module: torch.nn.Module) -> Optional[str]:
    """Why an e3nn ``o3.Linear`` cannot run as this op, or None."""
    if getattr(module, "bias_numel", 0):
        return "the linear has biases"
    if not getattr(module, "internal_weights", True) or not getattr(module, "shared_weights",
                                                                     True):
        return "the linear takes external or per-sample weights"
    if not hasattr(module, "instructions"):
        return "not an e3nn o3.Linear (no instructions)"
    return None


def linear_spec(module: torch.nn.Module) -> LinearSpec:
    """The :class:`LinearSpec` of an e3nn ``o3.Linear``."""
    reason = linear_reason(module)
    if reason is not None:
        raise UnsupportedModelError(reason)
    ins = list(module.instructions)
    shapes = [(1, int(i.path_shape[0]), int(i.path_shape[1])) for i in ins]
    offsets = _offsets(shapes)
    return LinearSpec(_blocks(module.irreps_in), _blocks(module.irreps_out),
                      tuple(LinearInstruction(int(i.i_in), int(i.i_out), o)
                            for i, o in zip(ins, offsets)))


def linear_scales(module: torch.nn.Module) -> List[float]:
    """Per instruction of an e3nn ``o3.Linear``, the factor of its weights (the path weight)."""
    return [float(i.path_weight) for i in module.instructions]


def effective_weights(spec: LinearSpec, weight: torch.Tensor, scales: Sequence[float],
                      z_inside: bool = False) -> torch.Tensor:
    """The op's weights (flat, per instruction ``[Z, mul_in, mul_out]``) from a module's flat
    ``weight`` and per-instruction ``scales`` (tensor ops only: differentiable and traceable).

    Args:
        z_inside: the module stores each path as ``[mul_in, Z, mul_out]`` (e3nn's tensor
            product with the element one-hot as second input) instead of ``[Z, mul_in,
            mul_out]``.
    """
    parts = []
    for ins, scale in zip(spec.instructions, scales):
        block = weight_block(spec, ins, weight)
        if z_inside:  # the same numbers, read as [mul_in, Z, mul_out]
            z, a, b = block.shape
            block = block.reshape(a, z, b).transpose(0, 1)
        parts.append(block.reshape(-1) * scale)
    return torch.cat(parts) if parts else weight[:0]


# -- MACE's element-dependent skip (FullyConnectedTensorProduct with Zx0e) ---------------------
def skip_reason(module: torch.nn.Module) -> Optional[str]:
    """Why a skip tensor product cannot run as an element-indexed linear map, or None."""
    cls = type(module)
    if cls.__name__ != "FullyConnectedTensorProduct" or not cls.__module__.startswith("e3nn."):
        return f"skip_tp is {cls.__module__}.{cls.__name__}, not e3nn's FullyConnectedTensorProduct"
    in2 = module.irreps_in2
    if len(in2) != 1 or in2[0][1].l != 0 or in2[0][1].p != 1:
        return f"its second input is {in2}, not one block of scalars (the element one-hot)"
    if not module.internal_weights or not module.shared_weights:
        return "the tensor product takes external weights"
    if getattr(module, "irrep_normalization", "component") != "component":
        return f"irrep_normalization={module.irrep_normalization!r} (only 'component')"
    for i in module.instructions:
        if i.connection_mode != "uvw" or not i.has_weight:
            return f"instruction {i} is not a weighted 'uvw' path"
    return None


def skip_spec(module: torch.nn.Module) -> LinearSpec:
    """The element-indexed :class:`LinearSpec` of MACE's skip tensor product."""
    reason = skip_reason(module)
    if reason is not None:
        raise UnsupportedModelError(reason)
    z = int(module.irreps_in2[0][0])
    ins = list(module.instructions)
    shapes = [(z, int(i.path_shape[0]), int(i.path_shape[2])) for i in ins]
    offsets = _offsets(shapes)
    return LinearSpec(_blocks(module.irreps_in1), _blocks(module.irreps_out),
                      tuple(LinearInstruction(int(i.i_in1), int(i.i_out), o)
                            for i, o in zip(ins, offsets)), z)


def _cg_l0l(l: int) -> float:
    """e3nn's ``wigner_3j(l, 0, l)[m, 0, m]`` (checked to be one number for all ``m``)."""
    from mace_accel._e3nn_compat import o3

    w3j = o3().wigner_3j(l, 0, l, dtype=torch.float64)[:, 0, :]
    c = float(w3j[0, 0])
    if not torch.allclose(w3j, c * torch.eye(2 * l + 1, dtype=torch.float64), atol=1e-12):
        raise UnsupportedModelError(f"wigner_3j({l}, 0, {l}) is not a multiple of the identity")
    return c


def skip_scales(module: torch.nn.Module) -> List[float]:
    """Per path of MACE's skip tensor product, the factor of its weights: the path weight times
    the Clebsch-Gordan coefficient of ``l x 0 -> l`` (``w3j[m, 0, m]``, the same for every
    ``m``). The weights themselves are ``[mul_in, Z, mul_out]`` (``z_inside`` of
    :func:`effective_weights`)."""
    return [float(i.path_weight) * _cg_l0l(module.irreps_in1[i.i_in1][1].l)
            for i in module.instructions]
