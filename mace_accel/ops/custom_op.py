"""Custom ops whose eager calls skip torch's dispatcher.

Every fused op is a ``torch.library`` custom op, so ``torch.compile``, ``torch.export`` and
``opcheck`` see one op with a fake implementation and an autograd formula. In eager mode a
custom op's autograd wrapper costs host time on every call in grad mode (what force evaluation
and training run in): a 2,048-atom MH-1 forces call launches its kernels faster than the
dispatcher hands them over. :func:`custom_op` keeps the registered op and adds an eager path
with the same function, the same ``setup_context`` and the same backward, run as a plain
``torch.autograd.Function``: same results and derivatives of every order, less host time.
What it saves is in ``docs/performance.md`` ("The architectures users run today").

The helpers below are what the families' autograd formulas share: the empty tensor that stands
for a tensor not there, the upstream gradients as a formula takes them, the backend check, and
the formula of an op that is not differentiated again.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Type

import torch

from mace_accel.errors import KernelError
from mace_accel.options import BACKENDS

Tensor = torch.Tensor


def custom_op(name: str) -> Callable[[Callable[..., Any]], "EagerCustomOp"]:
    """``@torch.library.custom_op(name, mutates_args=())`` for a function without mutated
    arguments; the result is called like the op (see :class:`EagerCustomOp`)."""
    return functools.partial(EagerCustomOp, name)


class EagerCustomOp:
    """A registered custom op (``.op``) called directly in eager mode.

    ``register_fake`` and ``register_autograd`` register on the op as torch's methods do. A
    call runs the op itself while ``torch.compile`` or ``torch.export`` trace or where a tensor
    is not a plain one (fake tensors, ``make_fx``'s tracing, other subclasses: they need the
    dispatcher); else the function as an autograd ``Function`` with the registered formula
    where an input needs a gradient, or the function alone."""

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.op = torch.library.custom_op(name, mutates_args=())(fn)
        self._name, self._fn = name, fn
        self._function: Optional[Type[torch.autograd.Function]] = None
        functools.update_wrapper(self, fn)

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        return self.op.register_fake(fake)

    def register_autograd(self, backward: Callable[..., Any], *,
                          setup_context: Callable[..., None]) -> None:
        self.op.register_autograd(backward, setup_context=setup_context)
        self._function = _autograd_function(self._name, self._fn, backward, setup_context)

    def __call__(self, *args: Any) -> Any:
        if self._function is None or torch.compiler.is_compiling():
            return self.op(*args)
        wants_grad = _wants_grad(args)
        if wants_grad is None:
            return self.op(*args)
        if wants_grad and torch.is_grad_enabled():
            return self._function.apply(*args)
        return self._fn(*args)


_PLAIN = (Tensor, torch.nn.Parameter)


def _wants_grad(args: Sequence[Any]) -> Optional[bool]:
    """Whether a tensor of ``args`` requires grad; None where the registered op must run: a
    tensor is not a plain one, or one in a list requires grad (a ``Function`` would not
    differentiate it; the op's autograd flattens lists, as the contraction's weights are
    passed when training)."""
    wants = False
    for a in args:
        if isinstance(a, Tensor):
            if type(a) not in _PLAIN:
                return None
            wants = wants or a.requires_grad
        elif isinstance(a, (list, tuple)):
            for t in a:
                if isinstance(t, Tensor) and (type(t) not in _PLAIN or t.requires_grad):
                    return None
    return wants


def _autograd_function(name: str, fn: Callable[..., Any], backward: Callable[..., Any],
                       setup_context: Callable[..., None]) -> Type[torch.autograd.Function]:
    """A ``torch.autograd.Function`` with the op's forward, context and backward. A custom
    op's backward returns a list of Nones for a list input; a Function wants None."""

    def forward(ctx, *args):
        out = fn(*args)
        setup_context(ctx, args, out)
        return out

    def backward_(ctx, *grads):
        result = backward(ctx, *grads)
        result = result if isinstance(result, tuple) else (result,)
        return tuple(None if isinstance(g, list) else g for g in result)

    return type(f"Eager_{name.replace('::', '_')}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward_)})


def placeholder(like: Tensor) -> Tensor:
    """The empty tensor an op takes or returns for a tensor not there (a gradient not asked
    for, an absent input): an op's arguments and results are tensors, never None."""
    return like.new_empty((0,))


def upstream_grad(a: Optional[Tensor]) -> Optional[Tensor]:
    """An upstream gradient as a formula takes it (contiguous), or None for an output nobody
    used (None, or an empty :func:`placeholder`)."""
    return None if a is None or a.numel() == 0 else a.contiguous()


def check_backend(backend: str) -> None:
    """Raise :class:`KernelError` unless ``backend`` is a fused one
    (:data:`mace_accel.options.BACKENDS`)."""
    if backend not in BACKENDS:
        raise KernelError(f"backend must be 'cuda' or 'reference', got {backend!r}")


def refuse_derivatives(op: EagerCustomOp, family: str) -> None:
    """Register on ``op``, a second derivative of the fused ``family`` ops, an autograd
    formula that raises :class:`KernelError`: energies, forces, stresses and training on forces
    need no third derivative, and the fused ops provide none."""
    def refuse(ctx, *grads):
        raise KernelError(
            f"{op._name} cannot be differentiated again: the fused {family} ops provide first "
            "and second derivatives (energy, forces, stress, training on forces); third "
            "derivatives are not supported: run the model unpatched (mace_accel.revert(model)) "
            "for them")

    op.register_autograd(refuse, setup_context=_no_context)


def _no_context(ctx, inputs, output) -> None:
    """The context of a formula that needs none."""
