"""Patch kind for a MACE model's edge features: ``spherical_harmonics`` and ``radial_embedding``.

Part ``edge_features``: the model's e3nn ``SphericalHarmonics`` becomes a
:class:`FusedSphericalHarmonics` and its mace ``RadialEmbeddingBlock`` a
:class:`FusedRadialEmbedding`, each one fused op (:mod:`mace_accel.ops.edge_features`) with the
original's call signature and return values; the edge vectors and lengths the model computes
before them run as one op too (:mod:`mace_accel.patches.edge_vectors`: forward hooks on the
model, CUDA backend). The model's ``forward`` code is not touched; the originals are kept inside
(state dict unchanged, ``revert`` hands back the same objects and takes the hooks off). A module
the kernels cannot compute (lmax > 4, a Gaussian or Chebyshev basis, a distance transform,
trainable Bessel frequencies, ...) is left as it is, and the record says why.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Optional, Tuple

import torch

from mace_accel.errors import InputError
from mace_accel.ops.edge_features import autograd
from mace_accel.ops.edge_features import reference as edge_reference
from mace_accel.ops.edge_features.spec import (
    RadialSpec,
    SHSpec,
    radial_spec_from_module,
    sh_spec_from_module,
)
from mace_accel.ops.radial_table import order as radial_order
from mace_accel.options import AccelOptions
from mace_accel.patches import edge_vectors
from mace_accel.patches.adopt import FusedModule
from mace_accel.patches.registry import PartPlan, SubmodulePatch

PART = "edge_features"


def _check_floating(name: str, t: torch.Tensor, last: int) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise InputError(f"{name} must be a floating-point tensor, got "
                         f"{getattr(t, 'dtype', type(t).__name__)}")
    if t.dim() < 1 or t.shape[-1] != last:
        raise InputError(f"{name} must have shape [..., {last}], got {tuple(t.shape)}")
    if t.dtype not in (torch.float32, torch.float64):
        raise InputError(f"{name} must be float32 or float64, got {t.dtype}")


class FusedSphericalHarmonics(FusedModule):
    """e3nn's ``SphericalHarmonics`` of a MACE model as one fused op.

    Args:
        original: the model's ``o3.SphericalHarmonics`` (orders ``0..lmax``).
        spec: its :class:`~mace_accel.ops.edge_features.spec.SHSpec`.
        options: backend etc.
    """

    part = PART

    def __init__(self, original: torch.nn.Module, spec: SHSpec, options: AccelOptions) -> None:
        super().__init__(original, options)
        self.spec = spec
        for attr in ("irreps_in", "irreps_out", "normalize", "normalization"):
            if hasattr(original, attr):
                setattr(self, attr, getattr(original, attr))
        self._key = autograd.register_sh(spec)

    def describe(self) -> str:
        return self.spec.describe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., (lmax+1)^2]`` spherical harmonics of ``x [..., 3]`` (e3nn's layout)."""
        _check_floating("vectors", x, 3)
        out = autograd.spherical_harmonics(self._key, x.reshape(-1, 3), self.backend)
        return out.reshape(*x.shape[:-1], self.spec.dim)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._key = autograd.register_sh(self.spec)  # a new process has an empty registry


class FusedRadialEmbedding(FusedModule):
    """mace's ``RadialEmbeddingBlock`` (Bessel basis x polynomial cutoff) as one fused op.

    The constants are read off the module's buffers when fused and again whenever one of them
    changes (``load_state_dict``, ``.to(dtype)``), so the op always computes what the
    original would.

    Args:
        original: the model's ``RadialEmbeddingBlock``.
        spec: its :class:`~mace_accel.ops.edge_features.spec.RadialSpec`.
        options: backend etc.
    """

    part = PART

    def __init__(self, original: torch.nn.Module, spec: RadialSpec,
                 options: AccelOptions) -> None:
        super().__init__(original, options)
        self.spec = spec
        self.out_dim = getattr(original, "out_dim", spec.num_basis)
        self._key = autograd.register_radial(spec)

    def describe(self) -> str:
        return self.spec.describe()

    @property
    def apply_cutoff(self) -> bool:
        """The original's ``apply_cutoff`` (True for old checkpoints without it)."""
        return bool(getattr(self.original, "apply_cutoff", True))

    @apply_cutoff.setter
    def apply_cutoff(self, value: bool) -> None:
        self.original.apply_cutoff = value  # picked up by the next call (see _current_key)

    def _buffers_seen(self) -> Tuple[Any, ...]:
        """What the spec was read from: each buffer's identity and version (an in-place change
        bumps it, ``.to()`` makes a new tensor) and ``apply_cutoff``."""
        values = (getattr(self.bessel_fn, "bessel_weights", None),
                  getattr(self.bessel_fn, "prefactor", None),
                  getattr(self.cutoff_fn, "r_max", None), getattr(self.cutoff_fn, "p", None))
        return tuple((id(v), v._version) if isinstance(v, torch.Tensor) else v
                     for v in values) + (self.apply_cutoff,)

    def _current_key(self) -> str:
        if torch.compiler.is_compiling():  # no _version guards in a graph: the spec as fused
            return self._key
        seen = self._buffers_seen()
        if self._kernels.get("seen") != seen:  # first call, or the buffers changed
            if "seen" in self._kernels:
                self.sync_original()
                spec, reason = radial_spec_from_module(self.original)
                if spec is None:
                    raise InputError(f"the radial embedding changed since it was fused and "
                                     f"cannot be fused any more: {reason}; revert the model")
                self.spec, self._key = spec, autograd.register_radial(spec)
            self._kernels["seen"] = seen
        return self._key

    def forward(self, edge_lengths: torch.Tensor, node_attrs: Optional[torch.Tensor] = None,
                edge_index: Optional[torch.Tensor] = None,
                atomic_numbers: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(radial * cutoff [..., B], None)`` or ``(radial [..., B], cutoff [..., 1])``.

        Args:
            edge_lengths: ``[n_edges, 1]`` (any leading shape ``[..., 1]``).
            node_attrs, edge_index, atomic_numbers: mace's signature; unused (they only feed a
                distance transform, which is never fused).
        """
        _check_floating("edge_lengths", edge_lengths, 1)
        key = self._current_key()
        feats, cutoff = autograd.radial_embedding(key, edge_lengths.reshape(-1, 1), self.backend)
        lead = edge_lengths.shape[:-1]
        feats = feats.reshape(*lead, self.spec.num_basis)
        # what the radial MLPs' tables look up (lengths_for): the features by identity, so no
        # tensor but this very output is taken for a function of these lengths
        self._kernels["last_call"] = (weakref.ref(feats), feats._version,
                                      edge_lengths.reshape(-1))
        return feats, (None if cutoff is None else cutoff.reshape(*lead, 1))

    def lengths_for(self, feats: torch.Tensor) -> Optional[torch.Tensor]:
        """The edge lengths ``[E]`` of the last call if ``feats`` is the very features it
        returned, unmodified (the radial MLPs' tables then look the lengths up instead of
        running the MLP on the features); else None."""
        last = self._kernels.get("last_call")
        if last is None or last[0]() is not feats or last[1] != feats._version:
            return None
        return last[2]

    def length_order(self, lengths: torch.Tensor) -> torch.Tensor:
        """``[E]`` int64: the edges sorted by ``lengths`` (from :meth:`lengths_for`; see
        :func:`mace_accel.ops.radial_table.order.length_order`), made once per call for every
        table that looks them up."""
        cached = self._kernels.get("length_order")
        if cached is None or cached[0] is not lengths:
            order = radial_order.length_order(lengths, self.spec.r_max)
            cached = self._kernels["length_order"] = (lengths, order)
        return cached[1]

    def table_function(self) -> Any:
        """``f(r [N]) -> [N, num_basis]``: this embedding's features (what the radial MLPs
        take) as plain torch ops (any dtype, differentiable to any order: the quintic tables
        take third derivatives), for tabulating."""
        self._current_key()  # the spec as the buffers are now
        spec = self.spec
        return lambda r: edge_reference.radial_forward(spec, r.reshape(-1, 1))[0]

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._key = autograd.register_radial(self.spec)


class EdgeFeaturesPatch(SubmodulePatch):
    """Fuses a MACE model's ``spherical_harmonics`` and ``radial_embedding``."""

    name = "edge_features"
    CHILDREN = ("spherical_harmonics", "radial_embedding")
    FUSED = (FusedSphericalHarmonics, FusedRadialEmbedding)

    def applies_to(self, module: torch.nn.Module) -> bool:
        return hasattr(module, "interactions") and all(
            isinstance(module._modules.get(name), torch.nn.Module) for name in self.CHILDREN)

    def fused_children(self, module: torch.nn.Module) -> List[str]:
        return [name for name, cls in zip(self.CHILDREN, self.FUSED)
                if isinstance(module._modules.get(name), cls)]

    def plan_parts(self, module: torch.nn.Module, options: AccelOptions) -> List[PartPlan]:
        if not options.fuses(PART):
            return [PartPlan(PART, reason="not asked for (options.parts)")]
        sh, radial = module.spherical_harmonics, module.radial_embedding
        sh_spec, sh_reason = sh_spec_from_module(sh)
        radial_spec, radial_reason = radial_spec_from_module(radial)
        children, fused, left = {}, [], []
        if sh_spec is not None:
            children["spherical_harmonics"] = lambda: FusedSphericalHarmonics(sh, sh_spec,
                                                                              options)
            fused.append(f"spherical_harmonics: {sh_spec.describe()}")
        else:
            left.append(f"spherical_harmonics left: {sh_reason}")
        if radial_spec is not None:
            children["radial_embedding"] = lambda: FusedRadialEmbedding(radial, radial_spec,
                                                                        options)
            fused.append(f"radial_embedding: {radial_spec.describe()}")
        else:
            left.append(f"radial_embedding left: {radial_reason}")
        if not children:
            return [PartPlan(PART, reason="; ".join(left))]
        if options.backend == "cuda":
            fused.append(edge_vectors.DETAIL)
        return [PartPlan(PART, children=children, detail="; ".join(fused + left))]

    def after_revert(self, module: torch.nn.Module) -> None:
        edge_vectors.remove(module)

    def after_reattach(self, module: torch.nn.Module) -> None:
        edge_vectors.install(module)

    def _spec(self, module: torch.nn.Module) -> Any:
        return None  # the record's ``spec`` is the interaction blocks' tensor product


PATCHES = (EdgeFeaturesPatch(),)
