"""The non-linear block's messages after ``linear_1`` in one kernel each way:
``y = gate(x / d + res)`` (mace's division by the density term, the residual and the gated
non-linearity, ``GatedEquivariantBlock``), template ``kernels/glue/gate.cu.j2``.

torch takes some twenty kernels for it (the division, the sum, the gate's activations,
products and ``cat``, their gradients and the division's), each a pass over MACE-MH-1's
9,728-wide rows. The kernels read ``x`` and ``res`` and write ``y`` and ``q = x / d`` (kept for
the backward); the backward reads ``g``, ``q`` and ``res`` and writes the three gradients,
``<gres, q>`` summed in float64 in a fixed order. With ``create_graph`` (training on forces)
the backward runs :func:`reference` through autograd instead, so the double backward follows.
Shapes: ``x`` ``[N, d_in]``, ``d`` ``[N, 1]``, ``y`` ``[N, d_out]``, ``res`` ``[N, r]`` with
``r <= d_in``: the residual's leading columns, the rest zero. MH-1's ``linear_res`` feeds only
the blocks of its input's irreps (0e in the first block, 0e and 1o in the second), so its other
blocks are never formed: 6,144-7,680 zero columns a node not written, read or differentiated.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterator, Tuple

import torch

from mace_accel.errors import KernelError
from mace_accel.ops import glue, registry
from mace_accel.ops.runtime import CudaKernels, i32, ptr
from mace_accel.ops.templates import literal, render
from mace_accel.options import dtype_name

Tensor = torch.Tensor
THREADS = 256
SCALAR_ACTS = ("silu", "none")
GATE_ACTS = ("sigmoid", "none")


@dataclasses.dataclass(frozen=True)
class GatedGroup:
    """``mul`` channels of dimension ``dim`` at column ``start`` of the input, gated by the
    ``mul`` gates from column ``gate``, written at column ``out`` of the output."""

    start: int
    mul: int
    dim: int
    gate: int
    out: int


@dataclasses.dataclass(frozen=True)
class GateSpec:
    """A gate's input layout (``scalars`` first, then the gates, then the gated groups) and
    activations: ``act(p) * cst`` with ``act`` one of :data:`SCALAR_ACTS` / :data:`GATE_ACTS`
    (``"none"``: ``p`` itself)."""

    scalars: int
    d_in: int
    groups: Tuple[GatedGroup, ...]
    act_scalar: str
    scalar_cst: float
    act_gate: str
    gate_cst: float

    def __post_init__(self) -> None:
        if self.act_scalar not in SCALAR_ACTS or self.act_gate not in GATE_ACTS:
            raise ValueError(f"gate activations must be one of {SCALAR_ACTS} and {GATE_ACTS}, "
                             f"got {self.act_scalar!r} and {self.act_gate!r}")
        covered = [range(0, self.scalars)]
        for grp in self.groups:
            covered += [range(grp.gate, grp.gate + grp.mul),
                        range(grp.start, grp.start + grp.mul * grp.dim)]
        columns = sorted(c for r in covered for c in r)
        if columns != list(range(self.d_in)):
            raise ValueError(f"the gate's pieces do not tile its {self.d_in} input columns")

    @property
    def d_out(self) -> int:
        return self.scalars + sum(g.mul * g.dim for g in self.groups)

    def describe(self) -> str:
        return (f"{self.scalars} scalars, {len(self.groups)} gated groups, {self.d_in} -> "
                f"{self.d_out}")

    def key(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]


def reference(spec: GateSpec, x: Tensor, d: Tensor, res: Tensor) -> Tensor:
    """``[N, d_out]`` with differentiable torch ops (mace's formulas); ``res [N, r]`` is
    the residual's leading ``r`` columns."""
    pre = x / d + pad_residual(res, spec.d_in)

    def act(p: Tensor, which: str, cst: float) -> Tensor:
        if which == "none":
            return p
        f = torch.nn.functional.silu if which == "silu" else torch.sigmoid
        return f(p) * cst

    parts = [act(pre[:, :spec.scalars], spec.act_scalar, spec.scalar_cst)]
    for g in spec.groups:
        gates = act(pre[:, g.gate:g.gate + g.mul], spec.act_gate, spec.gate_cst)
        gated = pre[:, g.start:g.start + g.mul * g.dim].reshape(-1, g.mul, g.dim)
        parts.append((gated * gates.unsqueeze(-1)).reshape(-1, g.mul * g.dim))
    return torch.cat(parts, dim=1)


def kernel_names(spec: GateSpec, dtype: str) -> Tuple[str, str]:
    key = spec.key()
    return f"mace_gate_forward_{key}_{dtype}", f"mace_gate_backward_{key}_{dtype}"


def render_kernels(spec: GateSpec, dtype: str) -> str:
    forward, backward = kernel_names(spec, dtype)
    return render("glue/gate.cu.j2", spec=spec, dtype=dtype, threads=THREADS,
                  forward_name=forward, backward_name=backward,
                  real="double" if dtype == "float64" else "float",
                  scalar_cst=literal(spec.scalar_cst), gate_cst=literal(spec.gate_cst))


class CudaGate(CudaKernels):
    """The forward and backward kernels of one :class:`GateSpec` and dtype on one device."""

    def __init__(self, spec: GateSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(dtype, device, f"gate ({spec.describe()})")
        self.spec = spec
        source = render_kernels(spec, dtype_name(dtype))
        self.forward_kernel, self.backward_kernel = (
            self._load(source, name) for name in kernel_names(spec, dtype_name(dtype)))

    def forward(self, x: Tensor, d: Tensor, res: Tensor) -> Tuple[Tensor, Tensor]:
        """``(y [N, d_out], q = x / d [N, d_in])``."""
        n = int(x.shape[0])
        self._check_tensor("x", x, (n, self.spec.d_in))
        self._check_tensor("d", d, (n, 1))
        r = self._residual_width(res, n)
        q = torch.empty_like(x)
        y = x.new_empty((n, self.spec.d_out))
        if n:
            self.forward_kernel.launch(self._blocks(n), THREADS, (
                ptr(x), ptr(d), ptr(res), ptr(q), ptr(y), i32(n), i32(r)))
        return y, q

    def backward(self, g: Tensor, q: Tensor, res: Tensor, d: Tensor
                 ) -> Tuple[Tensor, Tensor, Tensor]:
        """``(gx [N, d_in], gd [N, 1], gres [N, r])`` from ``g = dL/dy [N, d_out]``."""
        n = int(q.shape[0])
        self._check_tensor("g", g, (n, self.spec.d_out))
        self._check_tensor("q", q, (n, self.spec.d_in))
        r = self._residual_width(res, n)
        self._check_tensor("d", d, (n, 1))
        gx, gres = torch.empty_like(q), torch.empty_like(res)
        gd = q.new_empty((n, 1))
        if n:
            self.backward_kernel.launch(self._blocks(n), THREADS, (
                ptr(g), ptr(q), ptr(res), ptr(d), ptr(gx), ptr(gres), ptr(gd), i32(n),
                i32(r)))
        return gx, gd, gres

    def _residual_width(self, res: Tensor, n: int) -> int:
        """The residual's width ``r`` after checking ``res [n, r]``, ``r <= d_in``."""
        r = int(res.shape[1]) if res.dim() == 2 else -1
        if not 0 <= r <= self.spec.d_in:
            raise KernelError(f"res: expected shape [{n}, r] with r <= {self.spec.d_in}, got "
                              f"{tuple(res.shape)} ({self.what})")
        self._check_tensor("res", res, (n, r))
        return r


def kernels(spec: GateSpec, dtype: torch.dtype, device: torch.device) -> CudaGate:
    return registry.cached(("gate", spec, dtype, torch.device(device)),
                           lambda: CudaGate(spec, dtype, device))


class _GateResidual(torch.autograd.Function):
    """:func:`gate_residual` on the kernels, with its gradient written directly."""

    @staticmethod
    def forward(ctx, x: Tensor, d: Tensor, res: Tensor, spec: GateSpec) -> Tensor:
        y, q = kernels(spec, x.dtype, x.device).forward(x, d, res)
        ctx.save_for_backward(x, d, res, q)
        ctx.spec = spec
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        x, d, res, q = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: differentiable torch ops
            with torch.enable_grad():
                y = reference(ctx.spec, x, d, res)
            gx, gd, gres = torch.autograd.grad(y, (x, d, res), g, create_graph=True,
                                               allow_unused=True)
            return gx, gd, gres, None
        gx, gd, gres = kernels(ctx.spec, q.dtype, q.device).backward(g.contiguous(), q, res, d)
        return gx, gd, gres, None


def runs_on(x: Tensor, d: Tensor, res: Tensor) -> bool:
    """Whether the kernels take these: what the glue kernels take (:func:`~mace_accel.ops.glue.
    runs_on`: float32 or float64 on CUDA, outside a ``torch.compile`` trace), of one dtype,
    ``res`` as many rows as ``x`` and at most its columns, ``d`` one value per row."""
    return glue.runs_on(x) and d.dtype == res.dtype == x.dtype and x.dim() == 2 \
        and res.dim() == 2 and res.shape[0] == x.shape[0] and res.shape[1] <= x.shape[1] \
        and tuple(d.shape) == (x.shape[0], 1)


def pad_residual(res: Tensor, width: int) -> Tensor:
    """``res [N, r]`` with zero columns after it to ``[N, width]`` (differentiable; ``res``
    itself where it has them all)."""
    missing = width - int(res.shape[-1])
    return res if missing == 0 else torch.nn.functional.pad(res, (0, missing))


def gate_residual(spec: GateSpec, x: Tensor, d: Tensor, res: Tensor) -> Tensor:
    """``gate(x / d + res)`` ``[N, d_out]``, differentiable: the kernels where
    :func:`runs_on`, else :func:`reference`."""
    if not runs_on(x, d, res):
        return reference(spec, x, d, res)
    return _GateResidual.apply(x.contiguous(), d.contiguous(), res.contiguous(), spec)


# MACE-MH-1's gate: 512 scalars, 1,536 gates, 512 x (1o, 2e, 3o); silu and sigmoid with mace's
# second-moment constants
MH1_GATE = GateSpec(512, 9728, (GatedGroup(2048, 512, 3, 512, 512),
                                GatedGroup(3584, 512, 5, 1024, 2048),
                                GatedGroup(6144, 512, 7, 1536, 4608)),
                    "silu", 1.6791767923989418, "sigmoid", 1.8467055342154763)


def catalog_sources(limits) -> Iterator[Tuple[str, str]]:
    """``(name, source)`` of MACE-MH-1's gate in float32 and float64 (the CI compile and the
    pins)."""
    del limits  # any sm_80+ GPU alike
    for dtype in ("float32", "float64"):
        yield f"glue/gate_mh1_{dtype}", render_kernels(MH1_GATE, dtype)
