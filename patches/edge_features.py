"""Patch kind for a MACE model's edge features: ``spherical_harmonics`` and ``radial_embedding``.

Part ``edge_features``: the model's e3nn ``SphericalHarmonics`` becomes a
:class:`FusedSphericalHarmonics` and its mace ``RadialEmbeddingBlock`` a
:class:`FusedRadialEmbedding`, each one fused op (:mod:`mace_accel.ops.edge_features`) with the
original's call signature and return values; the edge vectors and lengths the model computes
before them run as one op too (:mod:`mace_accel.patches.edge_vectors`: forward hooks on the
model, CUDA backend). The model's ``forward`` code is not touched; the originals are kept inside
(state dict unchanged, ``revert`` hands back the same objects and takes the hooks off). mace's
Agnesi and Soft distance transforms are fused with the embedding (the kernels read each edge's
``r0``, see :class:`FusedRadialEmbedding`). A module the op cannot compute (lmax > 4, a Gaussian or
Chebyshev basis, another transform, trainable Bessel frequencies, ...) is left as it is, and
the record says why.
"""

from __future__ import annotations

import weakref
from typing import Any, List, NamedTuple, Optional, Tuple

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
from mace_accel.ops import glue, species
from mace_accel.ops.graph import graph_from_edge_index
from mace_accel.ops.radial.table import order as radial_order
from mace_accel.ops.species import PairSet
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
    register_spec = staticmethod(autograd.register_sh)

    def __init__(self, original: torch.nn.Module, spec: SHSpec, options: AccelOptions) -> None:
        super().__init__(original, options)
        self._use_spec(spec)
        for attr in ("irreps_in", "irreps_out", "normalize", "normalization"):
            if hasattr(original, attr):
                setattr(self, attr, getattr(original, attr))

    def describe(self) -> str:
        return self.spec.describe()

    def start_compiles(self, dtype: torch.dtype, device: torch.device) -> None:
        from mace_accel.ops.edge_vectors import autograd as edge_vectors

        autograd.start_compiles(self._key, dtype, device)
        edge_vectors.start_compiles(dtype, device)  # fused with the edge features (its patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., (lmax+1)^2]`` spherical harmonics of ``x [..., 3]`` (e3nn's layout)."""
        _check_floating("vectors", x, 3)
        out = autograd.spherical_harmonics(self._key, x.reshape(-1, 3), self.backend)
        return out.reshape(*x.shape[:-1], self.spec.dim)


class FusedRadialEmbedding(FusedModule):
    """mace's ``RadialEmbeddingBlock`` (Bessel basis x polynomial cutoff, with or without a
    distance transform) as one fused op, and the elements of each call's edges for the radial
    tables.

    The constants are read off the module's buffers when fused and again whenever one of them
    changes (``load_state_dict``, ``.to(dtype)``), so the op always computes what the
    original would. With a distance transform (Agnesi, Soft: MACE-MPA-0 and later) the basis
    takes ``x = T(r, r0)``, ``r0`` from the covalent radii of the edge's two elements (a few
    torch ops over the edges, the element lookup shared with the tables); the transform runs
    inside the embedding's kernels, derivatives included.

    Where the radial MLPs' weights depend on the edge's elements (a transform, the non-linear
    blocks' element embeddings), :attr:`pair_kind` is set (by :func:`~mace_accel.patches.
    radial_table.link`) and every call also gives each edge the slot of its pair's table
    (:class:`~mace_accel.ops.species.PairSet` of the call's elements: another set of elements
    gets tables of its own).

    Args:
        original: the model's ``RadialEmbeddingBlock``.
        spec: its :class:`~mace_accel.ops.edge_features.spec.RadialSpec`.
        options: backend etc.
        atomic_numbers: the model's elements (a transform's covalent radii are theirs).
    """

    part = PART
    register_spec = staticmethod(autograd.register_radial)

    def __init__(self, original: torch.nn.Module, spec: RadialSpec,
                 options: AccelOptions, atomic_numbers: Tuple[int, ...] = ()) -> None:
        super().__init__(original, options)
        self._use_spec(spec)
        self.out_dim = getattr(original, "out_dim", spec.num_basis)
        self.atomic_numbers_seen = tuple(atomic_numbers)
        self.pair_kind: Optional[str] = None
        self.pairs: Optional[PairSet] = None
        self.generation = 0  # bumped whenever the pairs change (the tables are then rebuilt)

    def describe(self) -> str:
        text = self.spec.describe()
        if self.spec.transform is not None:
            text += (" (the transform inside the kernels, each edge's r0 from its elements, "
                     "looked up once a call)")
        return text

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
        transform = self._modules.get("distance_transform")
        values = (getattr(self.bessel_fn, "bessel_weights", None),
                  getattr(self.bessel_fn, "prefactor", None),
                  getattr(self.cutoff_fn, "r_max", None), getattr(self.cutoff_fn, "p", None))
        if transform is not None:
            values += tuple(transform._buffers.values()) + tuple(transform._parameters.values())
        return tuple((id(v), v._version) if isinstance(v, torch.Tensor) else v
                     for v in values) + (self.apply_cutoff,)

    def start_compiles(self, dtype: torch.dtype, device: torch.device) -> None:
        autograd.start_compiles(self._key, dtype, device)
        if self.spec.transform is not None or self.pair_kind is not None:
            glue.start_compiles(dtype, device)  # the edges' pairs (and the blocks' densities)

    def _current_key(self) -> str:
        self._reread_spec(self._buffers_seen,
                          lambda: radial_spec_from_module(self.sync_original(),
                                                          self.atomic_numbers_seen or None),
                          "the radial embedding")
        return self._key

    def forward(self, edge_lengths: torch.Tensor, node_attrs: Optional[torch.Tensor] = None,
                edge_index: Optional[torch.Tensor] = None,
                atomic_numbers: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(radial * cutoff [..., B], None)`` or ``(radial [..., B], cutoff [..., 1])``.

        Args:
            edge_lengths: ``[n_edges, 1]`` (any leading shape ``[..., 1]``).
            node_attrs, edge_index: the atoms' one-hot elements ``[N, n]`` and the edges
                ``[2, E]`` (a distance transform and the pairs' tables need them).
            atomic_numbers: mace's signature; the elements come from ``node_attrs``.
        """
        _check_floating("edge_lengths", edge_lengths, 1)
        key = self._current_key()
        lengths = edge_lengths.reshape(-1, 1)
        r0 = slots = None
        if self.spec.transform is not None or self.pair_kind is not None:
            if node_attrs is None or edge_index is None:
                raise InputError("this radial embedding needs node_attrs and edge_index (its "
                                 "weights depend on the edges' elements), as mace passes them")
            r0, slots = self._edge_pairs(lengths, node_attrs, edge_index)
        feats, cutoff = autograd.radial_embedding(key, lengths, self.backend, r0)
        lead = edge_lengths.shape[:-1]
        feats = feats.reshape(*lead, self.spec.num_basis)
        # what the radial MLPs' tables look up (table_input): the features by identity, so no
        # tensor but this very output is taken for a function of these lengths
        self._kernels["last_call"] = (weakref.ref(feats), feats._version,
                                      TableInput(edge_lengths.reshape(-1), slots, self.pairs))
        return feats, (None if cutoff is None else cutoff.reshape(*lead, 1))

    def _radii(self, like: torch.Tensor) -> torch.Tensor:
        """The transform's per-element covalent radii as a tensor of ``like``'s dtype on its
        device (made once per spec: nothing is copied to the device in a call, so it can be
        captured in a CUDA graph)."""
        values = self.spec.transform.radii
        return self._kernel_cache(("radii", self._key, like.dtype, like.device),
                                  lambda: torch.tensor(values, dtype=like.dtype,
                                                       device=like.device))

    def _edge_pairs(self, lengths: torch.Tensor, node_attrs: torch.Tensor,
                    edge_index: torch.Tensor
                    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(r0 [E, 1], slots [E] int32)`` of the edges' pairs of elements: the transform's
        ``r0`` (None without one) and each pair's table slot (None without pair tables; the
        pairs extended first to every element of ``node_attrs``, see :meth:`cover`). One
        kernel on CUDA, torch's gathers elsewhere (the same numbers)."""
        elements = edge_vectors.element_index(node_attrs, torch.int64)
        transform = self.spec.transform
        radii = None if transform is None else self._radii(lengths)
        slot_map = None
        if self.pair_kind is not None:
            self.cover(node_attrs)
            slot_map = self._kernel_cache(("slot_map", self.pairs, node_attrs.device), lambda: (
                torch.tensor(self.pairs.slot_map(), dtype=torch.int32,
                             device=node_attrs.device)))
        n_elements = int(node_attrs.shape[1])
        if glue.runs_on(lengths):
            graph = graph_from_edge_index(edge_index, int(node_attrs.shape[0]))
            scale = 0.0 if transform is None else edge_reference.R0_SCALE[transform.kind]
            return glue.kernels(lengths.dtype, lengths.device).edge_pairs(
                elements, graph.index32("sender"), graph.index32("receiver"), radii, scale,
                slot_map, n_elements)
        r0 = None if transform is None else edge_reference.pair_r0(transform, radii, elements,
                                                                    edge_index)
        slots = None if slot_map is None else species.edge_slots(elements, edge_index,
                                                                 slot_map, n_elements)
        return r0, slots

    def cover(self, node_attrs: torch.Tensor) -> bool:
        """Make the pairs those of the elements of ``node_attrs [N, n]`` (reading them waits
        for the device: done once per attributes tensor and version, never while a CUDA graph
        is captured, where the warm-up call has covered them); whether the pairs changed (the
        tables are then built for the new ones, the old ones dropped)."""
        if self.pair_kind is None or torch.compiler.is_compiling() or (
                node_attrs.is_cuda and torch.cuda.is_current_stream_capturing()):
            return False
        covered = self._kernels.get("covered")  # (the tensor, its version, the kind) checked
        if covered is not None and covered[0]() is node_attrs \
                and covered[1:] == (node_attrs._version, self.pair_kind):
            return False
        present = species.elements_present(node_attrs)
        self._kernels["covered"] = (weakref.ref(node_attrs), node_attrs._version, self.pair_kind)
        pairs = species.PairSet(self.pair_kind, present, int(node_attrs.shape[1]))
        if pairs == self.pairs:
            return False
        self.pairs = pairs  # the elements of this call only: their tables are built for them
        self.generation += 1
        return True

    def table_input(self, feats: torch.Tensor) -> Optional["TableInput"]:
        """The lengths (and pairs' slots) of the last call if ``feats`` is the very features
        it returned, unmodified (the radial MLPs' tables then look them up instead of running
        the MLP on the features); else None."""
        last = self._kernels.get("last_call")
        if last is None or last[0]() is not feats or last[1] != feats._version:
            return None
        return last[2]

    def length_order(self, lengths: torch.Tensor, slots: Optional[torch.Tensor] = None,
                     tables: Optional[int] = None) -> torch.Tensor:
        """``[E]`` int64: the edges sorted by table slot (of ``tables``) and ``lengths`` (see
        :func:`mace_accel.ops.radial.table.order.length_order`), made once per call for every
        table that looks them up."""
        cached = self._kernels.get("length_order")
        if cached is None or cached[0] is not lengths or cached[1] is not slots \
                or cached[2] != tables:
            order = radial_order.length_order(lengths, self.spec.r_max, slots, tables)
            cached = self._kernels["length_order"] = (lengths, slots, tables, order)
        return cached[3]

    def table_function(self, pairs: Optional[List[Tuple[int, int]]] = None) -> Any:
        """``f(r [N], which [N]) -> [N, num_basis]``: this embedding's features (what the radial
        MLPs take), row ``i`` at ``r[i]`` for an edge between the elements ``pairs[which[i]]``
        (indices into ``atomic_numbers``; without a transform the features do not depend on
        them and ``pairs`` may be None), as plain torch ops (any dtype, differentiable to any
        order: the quintic tables take third derivatives), for tabulating."""
        self._current_key()  # the spec as the buffers are now
        spec = self.spec
        if spec.transform is None:
            return lambda r, which: edge_reference.radial_forward(spec, r.reshape(-1, 1))[0]
        if not pairs:
            raise ValueError("a transformed embedding is tabulated per pair of elements")
        r0 = torch.tensor([spec.transform.r0(a, b) for a, b in pairs], dtype=torch.float64)
        return lambda r, which: edge_reference.radial_forward(
            spec, r.reshape(-1, 1), r0.to(r.device, r.dtype)[which].unsqueeze(-1))[0]

    def table_cutoff(self) -> Any:
        """``c(r [N]) -> [N, 1]``: the cutoff envelope as plain torch ops (the blocks that
        multiply their weights by it themselves, ``apply_cutoff=False``)."""
        spec = self.spec
        return lambda r: edge_reference.radial_cutoff(spec, r.reshape(-1, 1))

    def __setstate__(self, state) -> None:
        state.setdefault("atomic_numbers_seen", ())  # saved before transforms were fused
        state.setdefault("pair_kind", None)
        state.setdefault("pairs", None)
        state.setdefault("generation", 0)
        super().__setstate__(state)


class TableInput(NamedTuple):
    """What a radial table looks up for a call: the edges' ``lengths [E]``, and where the
    weights depend on the edges' elements, their table ``slots [E]`` (int32) of ``pairs``."""

    lengths: torch.Tensor
    slots: Optional[torch.Tensor]
    pairs: Optional[PairSet]


def model_numbers(model: torch.nn.Module) -> Optional[Tuple[int, ...]]:
    """The model's ``atomic_numbers`` as a tuple (a buffer, tensor or list), or None."""
    z = getattr(model, "atomic_numbers", None)
    if z is None:
        return None
    return tuple(int(v) for v in (z.tolist() if torch.is_tensor(z) else z))


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
            return [PartPlan.not_asked(PART)]
        sh, radial = module.spherical_harmonics, module.radial_embedding
        sh_spec, sh_reason = sh_spec_from_module(sh)
        numbers = model_numbers(module)
        radial_spec, radial_reason = radial_spec_from_module(radial, numbers)
        children, fused, left = {}, [], []
        if sh_spec is not None:
            children["spherical_harmonics"] = lambda: FusedSphericalHarmonics(sh, sh_spec,
                                                                              options)
            fused.append(f"spherical_harmonics: {sh_spec.describe()}")
        else:
            left.append(f"spherical_harmonics left: {sh_reason}")
        if radial_spec is not None:
            children["radial_embedding"] = lambda: FusedRadialEmbedding(radial, radial_spec,
                                                                        options, numbers)
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
