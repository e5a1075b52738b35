"""The energy of an accelerated MACE model with a lean head: mace's blocks, fewer glue kernels.

mace's ``MACE.forward`` / ``ScaleShiftMACE.forward`` wrap the blocks in ~30 small torch kernels
per energy+forces call that carry no physics: the per-head indexing ``[arange(N), node_heads]``
of the atomic energies and of every readout (with a sort-based index backward each), the stack
and sum of the readouts, the scale-shift's per-head lookups, two ``scatter_sum`` of node
energies (float atomics on a GPU), the concatenation of every block's features (an output
nobody asked for), the zeroed displacement and the ``arange`` of ``prepare_graph``. At a few
hundred atoms each kernel costs more to launch than to run; in a CUDA graph they are about a
tenth of a 256-atom call.

:func:`forward` calls the same blocks in the same order with the same arguments and replaces
only that glue: a view or one ``gather`` per head selection, plain adds, one ``addcmul`` for a
one-head scale-shift, and the per-structure energies as float64 segment sums (prefix sums over
the batch's structure-sorted atoms: deterministic, no host synchronisation). Forces take the
same gradients through the blocks as mace's (the head's derivative is the scale, as there).

It applies (:func:`plan_head`) to models of the classes ``MACE`` and ``ScaleShiftMACE`` whose
children are all ones this module knows, whose blocks' ``forward`` signatures are those of
mace-torch 0.3.10-0.3.16, and that have no forward hooks but mace-accel's own. Any other model
takes mace's ``forward``; ``accelerate(verify=True)`` compares this path (through
:func:`mace_accel.models.outputs.evaluate`) with the unpatched model's own ``forward``.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from mace_accel.ops.runtime import side_stream

Tensor = torch.Tensor

HEAD_MODELS = ("MACE", "ScaleShiftMACE")
# every child module the two classes' forward uses; any other child may take part in a forward
# this module does not reproduce
KNOWN_CHILDREN = frozenset({"node_embedding", "radial_embedding", "spherical_harmonics",
                            "atomic_energies_fn", "interactions", "products", "readouts",
                            "scale_shift", "pair_repulsion_fn"})
INTERACTION_REQUIRED = ("node_attrs", "node_feats", "edge_attrs", "edge_feats", "edge_index")
INTERACTION_OPTIONAL = ("cutoff", "first_layer")
# Not an option (mace's forward to rounding, fewer kernels): tests switch it off to compare
# with mace's forward on the same accelerated model.
_LEAN = True


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """How :func:`forward` calls one model's blocks (read from their signatures).

    Attributes:
        scale_shift: the model is a ``ScaleShiftMACE`` (node energies scaled and shifted).
        pair_repulsion: the model adds a pair repulsion (ZBL) per node.
        radial_graph_args: the radial embedding takes ``(lengths, node_attrs, edge_index,
            atomic_numbers)`` (mace >= 0.3.11) rather than ``(lengths,)``.
        interaction_kwargs: the optional keyword arguments the interaction blocks take.
        readout_heads: per readout, whether it takes the node heads.
        readout_per_block: one readout per interaction (else one readout of the last block).
    """

    scale_shift: bool
    pair_repulsion: bool
    radial_graph_args: bool
    interaction_kwargs: Tuple[str, ...]
    readout_heads: Tuple[bool, ...]
    readout_per_block: bool


_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, Tuple[tuple, Optional[HeadPlan], str]]" = \
    weakref.WeakKeyDictionary()


def _parameters(module: torch.nn.Module) -> Dict[str, inspect.Parameter]:
    params = dict(inspect.signature(type(module).forward).parameters)
    params.pop("self", None)
    return params


def _structure_key(model: torch.nn.Module) -> tuple:
    """What a plan depends on: the classes of the children (surgery swaps some of them)."""
    def classes(name: str) -> tuple:
        child = model._modules.get(name)
        if isinstance(child, torch.nn.ModuleList):
            return tuple(type(m) for m in child)
        return (type(child),)
    return (type(model), tuple(model._modules), classes("radial_embedding"),
            classes("interactions"), classes("readouts"), classes("scale_shift"),
            len(model._forward_hooks), len(model._forward_pre_hooks))


def _own_hooks_only(model: torch.nn.Module) -> bool:
    from mace_accel.patches import edge_vectors

    return (all(h is edge_vectors.enter_call for h in model._forward_pre_hooks.values())
            and all(h is edge_vectors.leave_call for h in model._forward_hooks.values()))


def _make_plan(model: torch.nn.Module) -> Tuple[Optional[HeadPlan], str]:
    name = type(model).__name__
    if name not in HEAD_MODELS:
        return None, f"a {name}, not one of {', '.join(HEAD_MODELS)}"
    unknown = sorted(set(model._modules) - KNOWN_CHILDREN)
    if unknown:
        return None, f"the model has submodules the lean head does not know: {unknown}"
    for child in ("node_embedding", "radial_embedding", "spherical_harmonics",
                  "atomic_energies_fn", "interactions", "products", "readouts"):
        if child not in model._modules:
            return None, f"the model has no {child}"
    if hasattr(model, "joint_embedding") or hasattr(model, "embedding_readout"):
        return None, "the model has extra embeddings"
    if not _own_hooks_only(model):
        return None, "the model has forward hooks (mace's forward runs them)"
    interactions, products, readouts = model.interactions, model.products, model.readouts
    if len(interactions) != len(products) or len(interactions) == 0:
        return None, "interactions and products differ in number"
    if len(readouts) not in (1, len(interactions)):
        return None, "the readouts match neither every block nor the last one"
    kwargs: set = set()
    for block in interactions:
        params = _parameters(block)
        if any(p not in params for p in INTERACTION_REQUIRED):
            return None, f"{type(block).__name__}.forward takes other arguments"
        kwargs |= {p for p in INTERACTION_OPTIONAL if p in params}
    for block in interactions:  # the optional ones must be taken by every block
        if any(p not in _parameters(block) for p in kwargs):
            return None, "the interaction blocks take different arguments"
    heads: List[bool] = []
    for readout in readouts:
        params = list(_parameters(readout).values())
        if len(params) not in (1, 2):
            return None, f"{type(readout).__name__}.forward takes other arguments"
        heads.append(len(params) == 2)
    radial = list(_parameters(model.radial_embedding))
    if len(radial) not in (1, 4):
        return None, f"{type(model.radial_embedding).__name__}.forward takes other arguments"
    pair = hasattr(model, "pair_repulsion")  # mace's own test
    if pair and "pair_repulsion_fn" not in model._modules:
        return None, "the model's pair repulsion has no pair_repulsion_fn"
    scale_shift = name == "ScaleShiftMACE"
    if scale_shift and "scale_shift" not in model._modules:
        return None, "a ScaleShiftMACE without scale_shift"
    return HeadPlan(scale_shift=scale_shift, pair_repulsion=pair,
                    radial_graph_args=len(radial) == 4,
                    interaction_kwargs=tuple(sorted(kwargs)), readout_heads=tuple(heads),
                    readout_per_block=len(readouts) == len(interactions)), ""


def plan_head(model: torch.nn.Module) -> Tuple[Optional[HeadPlan], str]:
    """``(plan, "")`` if :func:`forward` reproduces ``model``'s forward, else ``(None, why)``
    (cached per model and structure)."""
    key = _structure_key(model)
    hit = _PLANS.get(model)
    if hit is not None and hit[0] == key:
        return hit[1], hit[2]
    plan, reason = _make_plan(model)
    _PLANS[model] = (key, plan, reason)
    return plan, reason


def accelerated_options(model: torch.nn.Module):
    """The :class:`~mace_accel.options.AccelOptions` ``model`` was accelerated with, or None
    (not accelerated: nothing of mace-accel changes how it runs)."""
    from mace_accel.patches.adopt import FusedModule

    for child in model._modules.values():
        if isinstance(child, FusedModule):
            return child.options
    interactions = model._modules.get("interactions")
    for block in interactions if isinstance(interactions, torch.nn.ModuleList) else ():
        for child in block._modules.values():
            if isinstance(child, FusedModule):
                return child.options
    return None


def lean_plan(model: torch.nn.Module) -> Optional[HeadPlan]:
    """The plan to evaluate ``model`` with, or None for mace's own forward: only models that
    mace-accel accelerated."""
    if not _LEAN or accelerated_options(model) is None:
        return None
    return plan_head(model)[0]


def describe(model: torch.nn.Module) -> str:
    """A report line: whether the model's energy head is the lean one, and why not."""
    if not _LEAN:
        return "energy head: mace's forward (the lean head is switched off)"
    plan, reason = plan_head(model)
    if plan is None:
        return f"energy head: mace's forward ({reason})"
    return ("energy head: lean (per-head selections as views, one scale-shift op, "
            "deterministic float64 per-structure sums)")


@dataclasses.dataclass
class HeadOutputs:
    """One call's results before the gradients.

    Attributes:
        energy: ``[S]`` per-structure energy (model dtype, summed in float64).
        node_energy: ``[N]`` per-atom energy (as mace returns it: float64 for a
            ``ScaleShiftMACE``, the model dtype for a ``MACE``).
        differentiable: ``[N]`` the per-atom part that depends on positions (its sum is what
            forces and stress differentiate).
        vectors, lengths: ``[E, 3]``, ``[E, 1]`` the edge vectors and lengths the model saw.
        ready: on CUDA, recorded on the side stream that computes ``energy`` and
            ``node_energy``: :meth:`wait` before reading them.
    """

    energy: Tensor
    node_energy: Tensor
    differentiable: Tensor
    vectors: Tensor
    lengths: Tensor
    ready: Optional["torch.cuda.Event"] = None

    def wait(self) -> None:
        """Make the current stream wait for ``energy`` and ``node_energy``."""
        if self.ready is not None:
            torch.cuda.current_stream(self.energy.device).wait_event(self.ready)


def _select(values: Tensor, heads: Optional[Tensor]) -> Tensor:
    """``[N]`` from ``[N]``, ``[N, 1]`` (a view) or ``[N, H]`` (each node's head column)."""
    if values.dim() == 1:
        return values
    if values.shape[-1] == 1:
        return values.reshape(values.shape[0])
    if heads is None:  # a one-head batch of a multi-head model: mace's head 0
        return values[:, 0]
    return values.gather(1, heads.view(-1, 1)).view(-1)


def segment_sums(values: Tensor, ptr: Tensor) -> Tensor:
    """``[S, ...]`` float64: the sums of ``values [N, ...]`` over the row ranges
    ``ptr[s]:ptr[s+1]``, as differences of float64 prefix sums (deterministic, no host
    synchronisation: CUDA-graph safe). Each column is scanned along the contiguous dimension
    (``[k, N]``: a scan down ``[N, k]`` runs ``k`` threads long)."""
    columns = values.to(torch.float64).reshape(values.shape[0], -1).t().contiguous()
    prefix = torch.cumsum(columns, dim=1)
    prefix = torch.cat([prefix.new_zeros((prefix.shape[0], 1)), prefix], dim=1)
    ptr = ptr.long()
    sums = prefix[:, ptr[1:]] - prefix[:, ptr[:-1]]
    return sums.t().reshape(-1, *values.shape[1:])


def _scale_shift(module: torch.nn.Module, x: Tensor, heads: Optional[Tensor]) -> Tensor:
    scale, shift = getattr(module, "scale", None), getattr(module, "shift", None)
    if (torch.is_tensor(scale) and torch.is_tensor(shift) and scale.numel() == 1
            and shift.numel() == 1 and scale.dtype == x.dtype == shift.dtype):
        # mace's scale[head] * x + shift[head] with one head: one kernel, no lookups
        return torch.addcmul(shift.reshape(()), scale.reshape(()), x)
    if heads is None:
        heads = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    return module(x, heads)


def _node_heads(model: torch.nn.Module, data: Dict[str, Tensor]) -> Optional[Tensor]:
    """``[N]`` int64 head of each node for a multi-head model (mace's ``node_heads``: head 0
    without a ``head`` field), else None (no kernel; no one-head block reads it)."""
    if len(getattr(model, "heads", ()) or ()) <= 1:
        return None
    if "head" not in data:
        return torch.zeros_like(data["batch"], dtype=torch.long)
    return data["head"][data["batch"]].long()


def forward(model: torch.nn.Module, plan: HeadPlan, data: Dict[str, Tensor]) -> HeadOutputs:
    """``model``'s energy of the mace batch ``data`` (positions set to require grad, as mace
    does), calling its blocks exactly as its own forward would."""
    from mace_accel.patches import edge_vectors

    positions = data["positions"]
    if not torch.compiler.is_compiling():
        positions.requires_grad_(True)
    node_attrs, edge_index = data["node_attrs"], data["edge_index"]
    heads = _node_heads(model, data)
    marked = edge_vectors.is_installed(model)
    if marked:
        edge_vectors.enter_call(model, ())
    try:
        # (mace is imported: the model is one of its classes)
        from mace.modules import utils as mace_utils  # its function: wrapped once installed

        vectors, lengths = mace_utils.get_edge_vectors_and_lengths(
            positions=positions, edge_index=edge_index, shifts=data["shifts"])
        node_feats = model.node_embedding(node_attrs)
        edge_attrs = model.spherical_harmonics(vectors)
        if plan.radial_graph_args:
            radial = model.radial_embedding(lengths, node_attrs, edge_index,
                                            getattr(model, "atomic_numbers", None))
        else:
            radial = model.radial_embedding(lengths)
        edge_feats, cutoff = radial if isinstance(radial, tuple) else (radial, None)
        overlap = _overlap(model)
        if overlap is not None:  # every block's radial MLP from here, beside the node work
            overlap.start(edge_feats)
        if cutoff is not None and "cutoff" not in plan.interaction_kwargs:
            raise RuntimeError("the radial embedding gives a cutoff the blocks do not take")
        pair = (model.pair_repulsion_fn(lengths, node_attrs, edge_index,
                                        getattr(model, "atomic_numbers", None))
                if plan.pair_repulsion else None)
        features: List[Tensor] = []
        for i, (interaction, product) in enumerate(zip(model.interactions, model.products)):
            kwargs = dict(node_attrs=node_attrs, node_feats=node_feats, edge_attrs=edge_attrs,
                          edge_feats=edge_feats, edge_index=edge_index)
            if "cutoff" in plan.interaction_kwargs:
                kwargs["cutoff"] = cutoff
            if "first_layer" in plan.interaction_kwargs:
                kwargs["first_layer"] = i == 0
            node_feats, sc = interaction(**kwargs)
            node_feats = product(node_feats=node_feats, sc=sc, node_attrs=node_attrs)
            features.append(node_feats)
        readout_energies: List[Tensor] = []
        for i, readout in enumerate(model.readouts):
            feats = features[i] if plan.readout_per_block else features[-1]
            out = readout(feats, heads) if plan.readout_heads[i] else readout(feats)
            readout_energies.append(_select(out, heads))
    finally:
        if marked:
            edge_vectors.leave_call(model, (), None)
    terms = ([pair] if pair is not None else []) + readout_energies
    inter = terms[0]
    for term in terms[1:]:
        inter = inter + term
    if plan.scale_shift:
        inter = _scale_shift(model.scale_shift, inter, heads)
    inputs = (node_attrs, heads, inter.detach(), data["ptr"])
    if not (inter.is_cuda and not torch.compiler.is_compiling()):
        node_energy, energy = _energies(model, plan, *inputs, vectors.dtype)
        return HeadOutputs(energy, node_energy, inter, vectors, lengths)
    # the energies feed no gradient: they run on a side stream beside the backward
    main = torch.cuda.current_stream(inter.device)
    side = side_stream("energies", inter.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        node_energy, energy = _energies(model, plan, *inputs, vectors.dtype)
    for tensor in inputs:
        if tensor is not None:
            tensor.record_stream(side)
    for tensor in (node_energy, energy):  # made on the side stream, read on the main one
        tensor.record_stream(main)
    ready = torch.cuda.Event()
    ready.record(side)
    return HeadOutputs(energy, node_energy, inter, vectors, lengths, ready)


_OVERLAPS: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()


def _overlap(model: torch.nn.Module):
    """The model's radial-MLP overlap group (:mod:`mace_accel.patches.radial.overlap`), or
    None; looked up once per model and surgery (``accelerate`` links the group; a walk over
    every module on each call of a model without one cost host time) while it stays linked."""
    from mace_accel.state import epoch

    seen = _OVERLAPS.get(model)
    if seen is not None and seen[0] == epoch(model):
        group = seen[1]
        if group is None or (group.members
                             and getattr(group.members[0], "overlap", None) is group):
            return group
    from mace_accel.patches.radial.overlap import group_of

    group = group_of(model)
    _OVERLAPS[model] = (epoch(model), group)
    return group


def _energies(model: torch.nn.Module, plan: HeadPlan, node_attrs: Tensor,
              heads: Optional[Tensor], inter: Tensor, ptr: Tensor,
              dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """``(node_energy [N], energy [S])`` from the atomic energies and the interaction part
    ``inter [N]`` (no gradient: forces differentiate ``inter`` alone)."""
    with torch.no_grad():
        node_e0 = _select(model.atomic_energies_fn(node_attrs), heads)
        if plan.scale_shift:  # as mace: float64 node energies
            node_energy = node_e0.double() + inter.double()
        else:
            node_energy = node_e0 + inter
        return node_energy, segment_sums(node_energy, ptr).to(dtype)
