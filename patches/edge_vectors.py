"""The edge vectors and lengths of an accelerated MACE model as one fused op.

mace computes them in the model's ``forward`` with a module-level function,
``get_edge_vectors_and_lengths(positions, edge_index, shifts)``, which no submodule swap can
reach. So, for a model whose edge features are fused:

* forward hooks on the model (a pre-hook and an always-called post-hook) mark, for the duration
  of each call, that this model's calls run the fused op with its options (a context variable:
  per thread and per task, undone even when the call raises);
* mace's function is wrapped, in the namespaces that call it (``mace.modules.utils`` and
  ``mace.modules.models``), by :func:`fused_edge_vectors_and_lengths`, which runs
  :func:`mace_accel.ops.edge_vectors.autograd.edge_vectors` inside a marked call and mace's own
  function everywhere else. Every other model in the process computes exactly what it did.

The same mark carries what one call computes once for all its blocks: the element index of the
one-hot node attributes (:func:`element_index`; four argmax kernels per MACE-MP call before).

The hooks pickle with the model (module-level functions) and install the wrapper again in a new
process on the first call; :func:`remove` (on revert) takes the hooks off. The wrapper stays:
outside a marked call it is mace's function.
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from mace_accel.ops import species
from mace_accel.options import AccelOptions


@dataclasses.dataclass
class CallState:
    """One accelerated model call: its options (None when its edge features are not fused) and
    what its blocks share, per input tensor (dropped when the call ends)."""

    options: Optional[AccelOptions]
    # (id of node_attrs, dtype) -> (node_attrs, its element indices)
    elements: Dict[Tuple[int, torch.dtype], Tuple[torch.Tensor, torch.Tensor]] = \
        dataclasses.field(default_factory=dict)


# the accelerated model call that is running (None: none, mace's own function)
_ACTIVE: contextvars.ContextVar[Optional[CallState]] = contextvars.ContextVar(
    "mace_accel_call", default=None)
_TOKENS = threading.local()  # per thread: the tokens of the calls entered, innermost last
_NAMESPACES = ("mace.modules.utils", "mace.modules.models")
_FUNCTION = "get_edge_vectors_and_lengths"
_ORIGINAL: List[Callable] = []  # mace's function, once wrapped
_INSTALL_LOCK = threading.Lock()

DETAIL = ("edge vectors and lengths: one op (backward to positions: per-node sums over the "
          "edge CSRs)")


def fused_edge_vectors_and_lengths(positions: torch.Tensor, edge_index: torch.Tensor,
                                   shifts: torch.Tensor, normalize: bool = False,
                                   eps: float = 1e-9) -> Tuple[torch.Tensor, torch.Tensor]:
    """mace's ``get_edge_vectors_and_lengths``: the fused op inside an accelerated model's call
    (CUDA backend, tensors on the GPU), mace's function otherwise. Same arguments, same
    results: ``(vectors [E, 3] (divided by ``lengths + eps`` if ``normalize``), lengths
    [E, 1])``."""
    # under torch.compile: mace's ops, which dynamo traces (a context variable it cannot)
    call = None if torch.compiler.is_compiling() else _ACTIVE.get()
    options = None if call is None else call.options
    if options is None or options.backend != "cuda" or not positions.is_cuda:
        return _ORIGINAL[0](positions=positions, edge_index=edge_index, shifts=shifts,
                            normalize=normalize, eps=eps)
    from mace_accel.ops.edge_vectors.autograd import edge_vectors

    vectors, lengths = edge_vectors(positions, edge_index, shifts, "cuda",
                                    options.check_indices)
    if normalize:
        return vectors / (lengths + eps), lengths
    return vectors, lengths


def install_wrapper() -> bool:
    """Wrap mace's function in the namespaces that call it (once per process); False when mace
    has no such function (then nothing is wrapped and mace's code runs as it is)."""
    if _ORIGINAL:
        return True
    with _INSTALL_LOCK:
        if _ORIGINAL:
            return True
        try:
            utils = importlib.import_module(_NAMESPACES[0])
        except ImportError:
            return False
        original = getattr(utils, _FUNCTION, None)
        if original is None:
            return False
        for name in _NAMESPACES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            if getattr(module, _FUNCTION, None) is original:
                setattr(module, _FUNCTION, fused_edge_vectors_and_lengths)
        _ORIGINAL.append(original)
    return True


def _fused_options(model: torch.nn.Module) -> Optional[AccelOptions]:
    from mace_accel.patches.adopt import FusedModule

    for name in ("spherical_harmonics", "radial_embedding"):
        child = model._modules.get(name)
        if isinstance(child, FusedModule):
            return child.options
    return None


def enter_call(model: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook: mark the call as the accelerated model's (not while torch.compile
    traces it: the wrapper then runs mace's ops)."""
    if torch.compiler.is_compiling():
        return
    install_wrapper()
    stack = getattr(_TOKENS, "stack", None)
    if stack is None:
        stack = _TOKENS.stack = []
    stack.append(_ACTIVE.set(CallState(_fused_options(model))))


def leave_call(model: torch.nn.Module, args: Any, output: Any) -> None:
    """Forward post-hook (always called, also when the call raised): undo :func:`enter_call`."""
    if torch.compiler.is_compiling():
        return
    stack = getattr(_TOKENS, "stack", None)
    if stack:
        _ACTIVE.reset(stack.pop())


def element_index(node_attrs: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """``[N]`` int32 (or int64): the element of each node, mace's argmax of the one-hot
    ``node_attrs [N, Z]`` (:func:`~mace_accel.ops.species.node_elements`); inside an
    accelerated model's call computed once for all its blocks (they get the same tensor), so
    a captured CUDA graph computes it once per replay (the int32 copy from the int64)."""
    call = None if torch.compiler.is_compiling() else _ACTIVE.get()
    key = (id(node_attrs), dtype)
    if call is not None:
        hit = call.elements.get(key)
        if hit is not None and hit[0] is node_attrs:
            return hit[1]
    if dtype == torch.int64:
        elem = species.node_elements(node_attrs)
    else:
        elem = element_index(node_attrs, torch.int64).to(dtype)
    if call is not None:
        call.elements[key] = (node_attrs, elem)
    return elem


def is_installed(model: torch.nn.Module) -> bool:
    return any(h is enter_call for h in model._forward_pre_hooks.values())


def install(model: torch.nn.Module) -> bool:
    """Put the hooks on ``model`` (idempotent); False when mace's function cannot be wrapped."""
    if not install_wrapper():
        return False
    if not is_installed(model):
        model.register_forward_pre_hook(enter_call)
        model.register_forward_hook(leave_call, always_call=True)
    return True


def remove(model: torch.nn.Module) -> None:
    """Take the hooks off ``model``."""
    for key in [k for k, h in model._forward_pre_hooks.items() if h is enter_call]:
        del model._forward_pre_hooks[key]
    for key in [k for k, h in model._forward_hooks.items() if h is leave_call]:
        del model._forward_hooks[key]
        getattr(model, "_forward_hooks_always_called", {}).pop(key, None)
