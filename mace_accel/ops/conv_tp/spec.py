"""Frozen, hashable description of one e3nn tensor product (the problem a kernel solves).

``TPSpec`` holds everything the kernels and the reference path need, as plain Python values:
the three irreps, the instructions with e3nn's final path weights, the per-edge weight layout
and the Clebsch-Gordan (Wigner 3j) nonzeros of every path in float64. Building one from an e3nn
``TensorProduct`` is the only step that imports e3nn; everything downstream (schedule, codegen,
reference) is pure Python/torch and runs on CPU.

Layouts are e3nn's:
    in1 (node_feats)  [n_nodes, irreps_in1.dim]   segment i = mul_i x (2l_i+1), channel-major
    in2 (edge_attrs)  [n_edges, irreps_in2.dim]
    out (message)     [n_nodes, irreps_out.dim]
    weights           [n_edges, weight_numel]     instruction k occupies
                                                  [weight_offset_k, weight_offset_k + mul1*mul2)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, Tuple

from mace_accel.errors import UnsupportedModelError

DTYPES = ("float32", "float64")


@dataclasses.dataclass(frozen=True)
class Irrep:
    """One segment ``mul x l p`` of an irreps string (p = +1 even, -1 odd)."""

    mul: int
    l: int  # noqa: E741 - e3nn's name
    p: int

    @property
    def ir_dim(self) -> int:
        return 2 * self.l + 1

    @property
    def dim(self) -> int:
        return self.mul * self.ir_dim

    def __str__(self) -> str:
        return f"{self.mul}x{self.l}{'e' if self.p == 1 else 'o'}"


@dataclasses.dataclass(frozen=True)
class Path:
    """One instruction of the tensor product, with its CG nonzeros.

    Attributes:
        i_in1, i_in2, i_out: segment indices into the three irreps.
        mode: e3nn connection mode (only ``"uvu"`` is accelerated).
        has_weight: whether the path takes a weight per edge.
        path_weight: e3nn's final normalisation coefficient for the path.
        weight_offset: first column of this path in the per-edge weight matrix.
        cg: nonzero Wigner 3j entries ``(i, j, k, value)`` for (l1, l2, l_out), float64 values.
    """

    i_in1: int
    i_in2: int
    i_out: int
    mode: str
    has_weight: bool
    path_weight: float
    weight_offset: int
    weight_numel: int
    cg: Tuple[Tuple[int, int, int, float], ...]


@dataclasses.dataclass(frozen=True)
class TPSpec:
    """A tensor product with per-edge weights, as MACE's interaction blocks use it."""

    irreps_in1: Tuple[Irrep, ...]
    irreps_in2: Tuple[Irrep, ...]
    irreps_out: Tuple[Irrep, ...]
    paths: Tuple[Path, ...]
    weight_numel: int
    shared_weights: bool = False

    # ----- derived sizes -------------------------------------------------------------------
    @staticmethod
    def _offsets(irreps: Tuple[Irrep, ...]) -> Tuple[int, ...]:
        out, acc = [], 0
        for ir in irreps:
            out.append(acc)
            acc += ir.dim
        return tuple(out)

    @property
    def dim_in1(self) -> int:
        return sum(ir.dim for ir in self.irreps_in1)

    @property
    def dim_in2(self) -> int:
        return sum(ir.dim for ir in self.irreps_in2)

    @property
    def dim_out(self) -> int:
        return sum(ir.dim for ir in self.irreps_out)

    @property
    def offsets_in1(self) -> Tuple[int, ...]:
        return self._offsets(self.irreps_in1)

    @property
    def offsets_in2(self) -> Tuple[int, ...]:
        return self._offsets(self.irreps_in2)

    @property
    def offsets_out(self) -> Tuple[int, ...]:
        return self._offsets(self.irreps_out)

    def irreps_str(self, which: str) -> str:
        """``"in1" | "in2" | "out"`` as an e3nn irreps string."""
        irreps = {"in1": self.irreps_in1, "in2": self.irreps_in2, "out": self.irreps_out}[which]
        return "+".join(str(ir) for ir in irreps)

    def describe(self) -> str:
        return (
            f"TPSpec({self.irreps_str('in1')} x {self.irreps_str('in2')} -> "
            f"{self.irreps_str('out')}, {len(self.paths)} paths, weight_numel={self.weight_numel})"
        )

    def key(self) -> str:
        """Stable hex digest of the spec (used in kernel names and cache keys)."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    # ----- what the CUDA kernels support ------------------------------------------------------
    def unsupported_reason(self) -> str | None:
        """Why the fused kernels cannot run this spec, or ``None`` if they can."""
        if self.shared_weights:
            return "shared (per-model) weights; the fused kernels take one weight row per edge"
        outs_seen: set[int] = set()
        for p in self.paths:
            if p.mode != "uvu":
                return f"connection mode {p.mode!r} (only 'uvu' is fused)"
            if not p.has_weight:
                return "a path without weights"
            if self.irreps_in2[p.i_in2].mul != 1:
                return "edge attributes with multiplicity > 1"
            if p.i_out in outs_seen:
                return "two paths write the same output segment"
            outs_seen.add(p.i_out)
        return None


def _irreps_tuple(irreps: Any) -> Tuple[Irrep, ...]:
    return tuple(Irrep(int(mul), int(ir.l), int(ir.p)) for mul, ir in irreps)


def cg_nonzeros(l1: int, l2: int, l3: int, tol: float = 1e-14,
               w3j: Any = None) -> Tuple[Tuple[int, int, int, float], ...]:
    """Nonzero entries of the real Wigner 3j symbol ``(l1, l2, l3)`` as float64 values.

    Args:
        w3j: the ``[2l1+1, 2l2+1, 2l3+1]`` tensor a model actually uses, if it holds one;
            by default e3nn's exact float64 table.
    """
    import torch

    from mace_accel._e3nn_compat import o3

    if w3j is None:
        w3j = o3().wigner_3j(l1, l2, l3, dtype=torch.float64)
    w3j = w3j.detach().to("cpu", torch.float64)
    idx = (w3j.abs() > tol).nonzero().tolist()
    return tuple((i, j, k, float(w3j[i, j, k])) for i, j, k in idx)


def _path_cg(l1: int, l2: int, l3: int, model_w3j: dict) -> Tuple[Tuple[int, int, int, float], ...]:
    return cg_nonzeros(l1, l2, l3, w3j=model_w3j.get(f"_w3j_{l1}_{l2}_{l3}"))


def spec_from_e3nn(tp: Any) -> TPSpec:
    """Freeze an e3nn ``o3.TensorProduct`` into a :class:`TPSpec`.

    Args:
        tp: an ``e3nn.o3.TensorProduct`` (any subclass); path weights are read from its
            instructions, where e3nn stores the final normalisation coefficient.

    Raises:
        UnsupportedModelError: ``tp`` is not an e3nn tensor product.
    """
    for attr in ("irreps_in1", "irreps_in2", "irreps_out", "instructions", "weight_numel"):
        if not hasattr(tp, attr):
            raise UnsupportedModelError(
                f"expected an e3nn o3.TensorProduct, got {type(tp).__name__} (no {attr!r})"
            )
    # e3nn keeps the 3j symbols it multiplies with as buffers of its generated code, in the dtype
    # the model was built in. Taking them from there (instead of the exact table) makes the
    # accelerated model compute exactly what the plain one does, also for a float32-built model
    # later cast to float64, whose buffers carry float32-rounded values.
    model_w3j = {name.rsplit(".", 1)[-1]: buf for name, buf in tp.named_buffers()
                 if name.rsplit(".", 1)[-1].startswith("_w3j_")}
    in1, in2, out = (_irreps_tuple(tp.irreps_in1), _irreps_tuple(tp.irreps_in2),
                     _irreps_tuple(tp.irreps_out))
    paths, offset = [], 0
    for ins in tp.instructions:
        numel = 0
        if ins.has_weight:
            numel = 1
            for s in ins.path_shape:
                numel *= int(s)
        paths.append(Path(
            i_in1=int(ins.i_in1), i_in2=int(ins.i_in2), i_out=int(ins.i_out),
            mode=str(ins.connection_mode), has_weight=bool(ins.has_weight),
            path_weight=float(ins.path_weight), weight_offset=offset, weight_numel=numel,
            cg=_path_cg(in1[ins.i_in1].l, in2[ins.i_in2].l, out[ins.i_out].l, model_w3j),
        ))
        offset += numel
    return TPSpec(in1, in2, out, tuple(paths), int(tp.weight_numel),
                  shared_weights=bool(getattr(tp, "shared_weights", False)))


def make_spec(irreps_in1: str, irreps_in2: str, irreps_target: str) -> TPSpec:
    """Build the MACE conv-TP spec for the given irreps (as MACE's blocks do), via e3nn.

    ``irreps_target`` filters the outputs exactly like MACE's ``tp_out_irreps_with_instructions``.
    Used by tests, benchmarks and the kernel catalog. Built once per arguments and torch default
    dtype (e3nn makes its 3j buffers, hence the spec's CG values, in that dtype): e3nn's tensor
    product with its generated code is most of the time the kernel catalog takes to render.
    """
    import torch

    return _make_spec(irreps_in1, irreps_in2, irreps_target, torch.get_default_dtype())


@functools.lru_cache(maxsize=None)
def _make_spec(irreps_in1: str, irreps_in2: str, irreps_target: str, dtype: Any) -> TPSpec:
    del dtype  # part of the cache key only
    return spec_from_e3nn(make_e3nn_conv_tp(irreps_in1, irreps_in2, irreps_target))


def make_e3nn_conv_tp(irreps_in1: str, irreps_in2: str, irreps_target: str) -> Any:
    """An e3nn ``TensorProduct`` configured exactly like MACE's ``conv_tp``."""
    from mace_accel._e3nn_compat import o3 as e3nn_o3

    o3 = e3nn_o3()
    from mace_accel._e3nn_compat import import_mace

    import_mace()
    from mace.modules.irreps_tools import tp_out_irreps_with_instructions

    irreps_mid, instructions = tp_out_irreps_with_instructions(
        o3.Irreps(irreps_in1), o3.Irreps(irreps_in2), o3.Irreps(irreps_target)
    )
    return o3.TensorProduct(
        o3.Irreps(irreps_in1), o3.Irreps(irreps_in2), irreps_mid, instructions=instructions,
        shared_weights=False, internal_weights=False,
    )
