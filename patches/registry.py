"""The interface every patch kind implements, and the records it returns.

A patch kind knows one family of MACE modules (interaction blocks, product blocks, the model's
edge-feature modules) and nothing else does: :func:`mace_accel.accelerate` and the calculator
only call :meth:`PatchKind.applies_to`, :meth:`~PatchKind.describe`, :meth:`~PatchKind.apply`,
:meth:`~PatchKind.revert` / :meth:`~PatchKind.reattach` and :meth:`~PatchKind.is_applied`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, List, Optional

import torch

if TYPE_CHECKING:
    from mace_accel.options import AccelOptions

ALREADY = "already accelerated"
# the PatchRecord of an applied patch, kept on the patched module (pickles with it)
RECORD_ATTR = "_mace_accel_record"


@dataclasses.dataclass
class PartRecord:
    """One part of a block (see :data:`mace_accel.options.PARTS`): fused, or left and why.

    Attributes:
        part: ``conv``, ``radial_mlp``, ``symmetric_contraction``, ``linears``, ``skip`` or
            ``edge_features``.
        fused: whether the part runs as a fused op now (or would, for a plan).
        detail: what runs (e.g. the tensor product's spec), or why the part was left.
    """

    part: str
    fused: bool
    detail: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PatchRecord:
    """One module surgery considered: its parts, fused or left.

    Attributes:
        path: qualified name of the module in the model (``interactions.0``, ``products.1``,
            ``""`` for the model itself).
        block: the module's class name.
        kind: the patch kind's name.
        parts: what happened to each part of the module.
        backend: the backend its fused ops run (None where nothing was fused).
        spec: the convolution's tensor-product spec, for interaction blocks.
        skipped_reason: why nothing at all was done (e.g. ``"already accelerated"``).
    """

    path: str
    block: str
    kind: str
    parts: List[PartRecord] = dataclasses.field(default_factory=list)
    backend: Optional[str] = None
    spec: Any = None
    skipped_reason: Optional[str] = None

    @property
    def patched(self) -> bool:
        return self.skipped_reason is None and any(p.fused for p in self.parts)

    @property
    def skipped(self) -> Optional[str]:
        """Why the module was left as it was (None if some part was fused)."""
        if self.patched:
            return None
        if self.skipped_reason is not None:
            return self.skipped_reason
        return "; ".join(f"{p.part}: {p.detail}" for p in self.parts) or "nothing to fuse"

    def part(self, name: str) -> Optional[PartRecord]:
        return next((p for p in self.parts if p.part == name), None)

    def to_dict(self) -> dict:
        return {"path": self.path, "block": self.block, "kind": self.kind,
                "patched": self.patched, "skipped": self.skipped, "backend": self.backend,
                "tensor_product": self.spec.describe() if self.spec is not None else None,
                "parts": [p.to_dict() for p in self.parts]}


class PatchKind:
    """Base class: one family of MACE modules and how to fuse / restore it.

    Subclasses set :attr:`name` and implement every method. ``apply`` must leave a module it
    cannot fuse exactly as it was; ``revert`` must hand back the very original objects, so the
    model's ``state_dict`` and results are bit-identical afterwards.
    """

    name = "patch"

    def applies_to(self, module: torch.nn.Module) -> bool:
        """True if ``module`` is of the family this kind patches."""
        raise NotImplementedError

    def describe(self, path: str, module: torch.nn.Module,
                 options: "AccelOptions") -> PatchRecord:
        """What is fused in ``module`` now (if applied) or would be with ``options``; no changes."""
        raise NotImplementedError

    def apply(self, path: str, module: torch.nn.Module, options: "AccelOptions") -> PatchRecord:
        """Fuse what can be fused in ``module`` (in place) and say what was done."""
        raise NotImplementedError

    def revert(self, module: torch.nn.Module) -> Any:
        """Restore the originals; returns what :meth:`reattach` needs to undo the revert."""
        raise NotImplementedError

    def reattach(self, module: torch.nn.Module, state: Any) -> None:
        """Put back what :meth:`revert` returned (for temporary side-by-side comparisons)."""
        raise NotImplementedError

    def is_applied(self, module: torch.nn.Module) -> bool:
        raise NotImplementedError


class SubmodulePatch(PatchKind):
    """A patch kind that swaps named child modules of its module for fused replacements.

    Subclasses implement :meth:`plan_parts`, which returns, per part, the children to replace and
    a factory for each, or the reason the part is left. The swap, revert and reattach are shared.
    Fused replacements derive from :class:`~mace_accel.patches.adopt.FusedModule`.
    """

    # where the applied record is kept on the module (a kind that shares its module with another
    # kind, as the model's pair repulsion and edge features do, names its own)
    record_attr = RECORD_ATTR

    def plan_parts(self, module: torch.nn.Module, options: "AccelOptions") -> List["PartPlan"]:
        raise NotImplementedError

    def fused_children(self, module: torch.nn.Module) -> List[str]:
        from mace_accel.patches.adopt import FusedModule

        return [name for name, child in module.named_children() if isinstance(child, FusedModule)]

    def is_applied(self, module: torch.nn.Module) -> bool:
        return bool(self.fused_children(module))

    def describe(self, path: str, module: torch.nn.Module,
                 options: "AccelOptions") -> PatchRecord:
        record = PatchRecord(path=path, block=type(module).__name__, kind=self.name)
        if self.is_applied(module):
            return self._record_applied(record, module)
        for plan in self.plan_parts(module, options):
            record.parts.append(PartRecord(plan.part, plan.reason is None,
                                           plan.detail if plan.reason is None else plan.reason))
        record.spec = self._spec(module)
        return record

    def apply(self, path: str, module: torch.nn.Module, options: "AccelOptions") -> PatchRecord:
        record = PatchRecord(path=path, block=type(module).__name__, kind=self.name)
        if self.is_applied(module):
            record.skipped_reason = ALREADY
            return record
        plans = self.plan_parts(module, options)
        built = {}
        for plan in plans:  # build everything first: a failure leaves the module untouched
            if plan.reason is None:
                built.update({name: factory() for name, factory in plan.children.items()})
        self.reattach(module, built)
        for plan in plans:
            record.parts.append(PartRecord(plan.part, plan.reason is None,
                                           plan.detail if plan.reason is None else plan.reason))
        record.spec = self._spec(module)
        if record.patched:
            record.backend = options.backend
            module.__dict__[self.record_attr] = dataclasses.replace(record, path="")
        return record

    def revert(self, module: torch.nn.Module) -> dict:
        fused = {}
        for name in self.fused_children(module):
            child = getattr(module, name)
            setattr(module, name, child.sync_original())
            fused[name] = child
        if fused:
            fused[RECORD_ATTR] = module.__dict__.pop(self.record_attr, None)
            self.after_revert(module)
        return fused

    def reattach(self, module: torch.nn.Module, state: dict) -> None:
        state = dict(state)
        record = state.pop(RECORD_ATTR, None)
        for name, child in state.items():
            setattr(module, name, child)
        if record is not None:
            module.__dict__[self.record_attr] = record
        if state:
            self.after_reattach(module)

    # hooks for attributes beside the children (e.g. the interaction block's conv_fusion flag)
    def after_revert(self, module: torch.nn.Module) -> None:
        pass

    def after_reattach(self, module: torch.nn.Module) -> None:
        pass

    def _record_applied(self, record: PatchRecord, module: torch.nn.Module) -> PatchRecord:
        """The record stored at apply time (parts fused and left), for this path."""
        stored = module.__dict__.get(self.record_attr)
        if stored is None:  # fused children without a stored record: list what is there
            for name in self.fused_children(module):
                child = getattr(module, name)
                record.parts.append(PartRecord(child.part, True, f"{name}: {child.describe()}"))
            record.backend = "/".join(sorted({getattr(module, n).options.backend
                                              for n in self.fused_children(module)})) or None
            record.spec = self._spec(module)
            return record
        return dataclasses.replace(stored, path=record.path,
                                   parts=[dataclasses.replace(p) for p in stored.parts])

    def _spec(self, module: torch.nn.Module) -> Any:
        return None


@dataclasses.dataclass
class PartPlan:
    """How one part of a module would be fused (``children``: name -> factory), or ``reason``."""

    part: str
    children: dict = dataclasses.field(default_factory=dict)
    detail: str = ""
    reason: Optional[str] = None

    @classmethod
    def not_asked(cls, part: str) -> "PartPlan":
        """The plan of a part the options leave out (``options.parts``)."""
        return cls(part, reason="not asked for (options.parts)")
