"""``FusedModule``: the base of every fused replacement module.

A fused module keeps the original mace/e3nn module inside (``.original``, not a child) and
*adopts* its parameters, buffers and children under the same names, so the model's
``state_dict`` keys and values do not change, ``.to()`` / ``.double()`` reach them, and
``sync_original()`` hands back the very same original object for ``revert``. Compiled kernels are
never pickled (subclasses keep them in ``_kernels``, emptied on pickling); they are rebuilt on
first use after loading.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from mace_accel.errors import InputError
from mace_accel.options import AccelOptions


def grads_wanted(params: List[torch.Tensor]) -> bool:
    """Whether autograd will want a gradient of any of ``params`` (training), not inference."""
    return torch.is_grad_enabled() and any(p.requires_grad for p in params)


def set_link(module: torch.nn.Module, name: str, value: Any) -> None:
    """Give ``module`` a plain reference ``name`` to ``value`` (another module of the same
    model, such as the radial embedding whose lengths its tables are looked up by, or a group of
    modules): not a child, so no second state-dict entry and no second move or cast. Read it
    as ``module.name``."""
    object.__setattr__(module, name, value)


class FusedModule(torch.nn.Module):
    """Base of the fused replacements: adopts ``original``'s tensors and children.

    Args:
        original: the mace/e3nn module being replaced.
        options: the acceleration options (backend, determinism, ...).

    Class attributes:
        part: the :data:`~mace_accel.options.PARTS` entry this module fuses.
        register_spec: where the module's op takes its spec as a registry key, the op
            family's registration of a spec (a staticmethod, e.g. of
            :func:`mace_accel.ops.conv_tp.autograd.register_spec`): :meth:`_use_spec` then
            keeps ``_key`` the key of ``spec``, and unpickling registers it again (a new
            process has an empty registry).
    """

    part = "conv"
    register_spec: Optional[Callable[[Any], str]] = None

    def __init__(self, original: torch.nn.Module, options: AccelOptions) -> None:
        super().__init__()
        object.__setattr__(self, "original", original)  # kept, but not as a child module
        for name, p in original._parameters.items():
            self._parameters[name] = p
        for name, b in original._buffers.items():
            self._buffers[name] = b
        self._non_persistent_buffers_set.update(original._non_persistent_buffers_set)
        for name, m in original._modules.items():
            self._modules[name] = m
        self.options = options
        self._kernels: Dict[Any, Any] = {}

    @property
    def backend(self) -> str:
        return self.options.backend

    def describe(self) -> str:
        """One line: what this module computes (for reports)."""
        return type(self).__name__

    def start_compiles(self, dtype: torch.dtype, device: torch.device) -> None:
        """Start compiling, on background threads, the CUDA kernels a forces call of this
        module launches (:func:`~mace_accel.ops.runtime.compile_soon`), so that a model's first
        call does not compile them one after another; modules without kernels of their own do
        nothing."""

    def extra_repr(self) -> str:
        return f"{self.describe()}, backend={self.backend!r}"

    # -- state -------------------------------------------------------------------------------
    def sync_original(self) -> torch.nn.Module:
        """Write adopted tensors (possibly moved/cast since) back into the original module."""
        for name in list(self.original._parameters):
            self.original._parameters[name] = self._parameters[name]
        for name in list(self.original._buffers):
            self.original._buffers[name] = self._buffers[name]
        for name in list(self.original._modules):
            self.original._modules[name] = self._modules[name]
        return self.original

    def __getstate__(self) -> Dict[str, Any]:
        self.sync_original()
        state = self.__dict__.copy()
        state["_kernels"] = {}  # binaries never travel; rebuilt on first call
        # e3nn's generated submodules only pickle through the original's own __getstate__;
        # re-adopt them on load
        state["_modules"] = {k: v for k, v in self._modules.items()
                             if k not in self.original._modules}
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name, m in self.original._modules.items():
            self._modules[name] = m
        if self.register_spec is not None:
            self._key = self.register_spec(self.spec)

    def _use_spec(self, spec: Any) -> None:
        """Make ``spec`` this module's, with its registry key ``_key`` where the op takes one
        (:attr:`register_spec`)."""
        self.spec = spec
        if self.register_spec is not None:
            self._key = self.register_spec(spec)

    def _derived(self, name: str, params: List[torch.Tensor], dtype: torch.dtype,
                 build: Callable[[torch.dtype], Any]) -> Any:
        """``build(dtype)``: tensors derived from ``params`` (folded weights, say). Cached under
        ``name`` per dtype while the parameters are the same unmodified tensors and nobody needs
        their gradient (inference); rebuilt on every call while a gradient is needed (training:
        differentiable) or dynamo traces (it cannot guard on ``_version``)."""
        if grads_wanted(params) or torch.compiler.is_compiling():
            return build(dtype)
        key = (dtype, tuple((p.data_ptr(), p._version, p.device) for p in params))
        cached = self._kernels.get(name)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = self._kernels[name] = (key, build(dtype))
        return cached[1]

    def _reread_spec(self, seen: Callable[[], Tuple],
                     read: Callable[[], Tuple[Any, Optional[str]]], what: str) -> None:
        """Keep ``spec`` as the module is now: while ``seen()`` (what the spec was read from:
        its tensors' identities and versions, ``load_state_dict`` or ``copy_`` bumps them,
        ``.to()`` makes new ones) is as at the last call (the first call records it), the spec
        stays; else the one ``read()`` makes of the module becomes the module's
        (:meth:`_use_spec`) instead of the stale one. Inside ``torch.compile`` the spec stays as
        fused: a graph has no guards on tensor versions, so ``seen`` is not read there.

        Raises:
            InputError: ``read()`` says ``what`` cannot be fused any more (``(None, reason)``).
        """
        if torch.compiler.is_compiling():
            return
        seen = seen()
        if self._kernels.get("seen") == seen:
            return
        if "seen" in self._kernels:
            spec, reason = read()
            if spec is None:
                raise InputError(f"{what} changed since it was fused and cannot be fused any "
                                 f"more: {reason}; revert the model")
            self._use_spec(spec)
        self._kernels["seen"] = seen

    def live_parameters(self, *others: torch.nn.Module) -> List[torch.Tensor]:
        """The parameters of this module and of the modules ``others``, as
        ``Module.parameters()`` gives them (a tensor shared by two of them twice), read
        afresh on every call (a parameter assigned anew is seen) from where they sit, which is
        found once: the modules of a fused module do not change, and walking them on every
        call cost tens of microseconds of host time a call."""
        key = ("parameter_slots",) + tuple(id(m) for m in others)
        slots = self._kernels.get(key)
        if slots is None:
            slots = self._kernels[key] = [
                (root.get_submodule(path.rpartition(".")[0]), path.rpartition(".")[2])
                for root in (self, *others) for path, _ in root.named_parameters()]
        # getattr, not _parameters: a scripted submodule (e3nn's) keeps them elsewhere
        found = (getattr(m, name, None) for m, name in slots)
        return [p for p in found if p is not None]

    def _kernel_cache(self, key: Any, build) -> Any:
        """``self._kernels[key]``, built once by ``build()`` (per dtype and device)."""
        value = self._kernels.get(key)
        if value is None:
            value = self._kernels[key] = build()
        return value
