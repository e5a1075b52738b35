"""mace's gated non-linearity (``GatedEquivariantBlock``, the non-linear block's
``equivariant_nonlin``) with one split of its input instead of a slice per group.

mace's forward ``narrow``s its input once for the scalars, once for the gates and once per gated
group, and the activated gates once more per gated group. Each slice's gradient is a zero
tensor of the whole input with the slice copied in, added to the others. Here the input is
split once (its gradient is one ``cat``) and the activated gates once: for MACE-MH-1's gate (a
9,728-wide message, three gated groups) a forward and backward takes 31 torch ops instead of 51,
each a kernel launch on a GPU (counted with torch's profiler on the CPU). Every value is
computed by the same elementwise ops on the same pieces as mace's, so the results are bit for
bit mace's, forward and backward. (The scalars and the gates could share one activation call
where they take the same function; on the CPU a call over another width rounds some elements
differently, so they keep one each.)

:class:`SplitGate` is installed as the module's ``forward`` (an instance attribute, removed by
``revert``) by :func:`install`, which the non-linear block's fused forward calls where it is
installed; a gate laid out otherwise (``ir_mul``, groups that do not tile the input) keeps
mace's forward.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from mace_accel.ops.gate import GATE_ACTS, SCALAR_ACTS, GatedGroup, GateSpec

Tensor = torch.Tensor
FORWARD_ATTR = "forward"
# mace's GatedEquivariantBlock attributes the split reads (mace-torch >= 0.3.15)
_ATTRS = ("_s_start", "_s_len", "_g_start", "_g_len", "_gated_info", "_act_scalar",
          "_scalar_cst", "_act_gate", "_gate_cst", "_layout_is_ir_mul")


@dataclasses.dataclass(frozen=True)
class GateLayout:
    """Where the pieces of a gate's input ``[..., D]`` sit, in input order.

    Attributes:
        sizes: widths of the input's pieces: the scalars, the gates, then each gated group.
        gate_sizes: widths of the activated gates' pieces, in gate order.
        gated: per gated group (input order), ``(mul, ir_dim, index of its gates' piece)``.
    """

    sizes: Tuple[int, ...]
    gate_sizes: Tuple[int, ...]
    gated: Tuple[Tuple[int, int, int], ...]


def layout_of(gate: torch.nn.Module) -> Optional[GateLayout]:
    """The :class:`GateLayout` of mace's ``GatedEquivariantBlock`` ``gate``, or None where one
    split cannot take its input (another class or mace version, the ``ir_mul`` layout, no gated
    groups, pieces that do not tile the input in the order scalars, gates, gated)."""
    cls = type(gate)
    if cls.__name__ != "GatedEquivariantBlock" or not cls.__module__.startswith("mace.") \
            or any(not hasattr(gate, a) for a in _ATTRS) or gate._layout_is_ir_mul \
            or not gate._gated_info:
        return None
    s_start, s_len, g_start, g_len = gate._s_start, gate._s_len, gate._g_start, gate._g_len
    gated = sorted(gate._gated_info)  # (start, length, ir_dim, mul, gate offset)
    if s_start != 0 or s_len == 0 or g_start != s_len or gated[0][0] != g_start + g_len:
        return None
    at = gated[0][0]
    for start, length, ir_dim, mul, _ in gated:
        if start != at or length != mul * ir_dim:
            return None
        at += length
    offsets = sorted(g_off for *_, g_off in gated)  # each group's gates, in gate order
    gate_sizes = [b - a for a, b in zip(offsets, offsets[1:] + [g_len])]
    if offsets[0] != 0 or any(size != mul for size, (*_, mul, g_off) in
                              zip(gate_sizes, sorted(gated, key=lambda g: g[4]))):
        return None
    return GateLayout(tuple([s_len, g_len] + [length for _, length, *_ in gated]),
                      tuple(gate_sizes),
                      tuple((mul, ir_dim, offsets.index(g_off))
                            for _, _, ir_dim, mul, g_off in gated))


def _activated(x: Tensor, act, cst: float) -> Tensor:
    """mace's ``act(x) * cst`` (``x`` itself where there is no activation)."""
    return x if act is None else act(x) * cst


def _act_name(act) -> Optional[str]:
    """The kernels' name of mace's activation ``act`` (None: one they do not have)."""
    if act is None:
        return "none"
    if act is torch.nn.functional.silu:
        return "silu"
    if act in (torch.sigmoid, torch.nn.functional.sigmoid):
        return "sigmoid"
    return None


def kernel_spec(gate: torch.nn.Module, layout: GateLayout) -> Optional[GateSpec]:
    """The :class:`~mace_accel.ops.gate.GateSpec` of ``gate`` (laid out as ``layout``) for the
    kernels that also divide and add the residual, or None where its activations are not
    theirs (silu or none for the scalars, sigmoid or none for the gates)."""
    act_scalar, act_gate = _act_name(gate._act_scalar), _act_name(gate._act_gate)
    if act_scalar not in SCALAR_ACTS or act_gate not in GATE_ACTS:
        return None
    scalars, n_gates = layout.sizes[0], layout.sizes[1]
    gate_at = [scalars + sum(layout.gate_sizes[:i]) for i in range(len(layout.gate_sizes))]
    groups, start, out = [], scalars + n_gates, scalars
    for mul, ir_dim, which in layout.gated:
        groups.append(GatedGroup(start, mul, ir_dim, gate_at[which], out))
        start += mul * ir_dim
        out += mul * ir_dim
    return GateSpec(scalars, start, tuple(groups), act_scalar, float(gate._scalar_cst),
                    act_gate, float(gate._gate_cst))


class SplitGate:
    """The forward of one ``GatedEquivariantBlock`` (see the module docstring):
    ``[..., D] -> [..., D - gates]``; ``spec``: its kernels' layout where they take it (see
    :func:`kernel_spec`), else None."""

    def __init__(self, gate: torch.nn.Module, layout: GateLayout) -> None:
        self.gate, self.layout = gate, layout
        self.spec = kernel_spec(gate, layout)

    def __call__(self, features: Tensor) -> Tensor:
        g, lay = self.gate, self.layout
        pieces = features.split(lay.sizes, dim=-1)
        scalars = _activated(pieces[0], g._act_scalar, g._scalar_cst)
        gates = _activated(pieces[1], g._act_gate, g._gate_cst)
        gated = pieces[2:]
        gate_pieces = gates.split(lay.gate_sizes, dim=-1)
        batch = features.shape[:-1]
        parts = [scalars]
        for piece, (mul, ir_dim, which) in zip(gated, lay.gated):
            product = piece.reshape(*batch, mul, ir_dim) * gate_pieces[which].unsqueeze(-1)
            parts.append(product.reshape(*batch, mul * ir_dim))
        return torch.cat(parts, dim=-1)


def install(gate: Optional[torch.nn.Module]) -> None:
    """Give ``gate`` the :class:`SplitGate` forward where its layout allows one split."""
    layout = None if gate is None else layout_of(gate)
    if layout is not None:
        gate.__dict__[FORWARD_ATTR] = SplitGate(gate, layout)


def spec_of(gate: Optional[torch.nn.Module]) -> Optional[GateSpec]:
    """The kernels' :class:`~mace_accel.ops.gate.GateSpec` of an installed gate, or None."""
    forward = None if gate is None else gate.__dict__.get(FORWARD_ATTR)
    return forward.spec if isinstance(forward, SplitGate) else None


def remove(gate: Optional[torch.nn.Module]) -> None:
    """Put mace's own forward back."""
    if gate is not None and isinstance(gate.__dict__.get(FORWARD_ATTR), SplitGate):
        del gate.__dict__[FORWARD_ATTR]
