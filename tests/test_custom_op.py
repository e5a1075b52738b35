"""The eager path of :mod:`mace_accel.ops.custom_op` against the registered op: same values
and derivatives to the second order, list inputs, no-grad calls, and the registered op where
tensors are not plain (fake tensors) or torch.compile traces."""

from __future__ import annotations

from typing import List

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mace_accel.ops.custom_op import EagerCustomOp, custom_op

Tensor = torch.Tensor
CALLS = {"forward": 0}


@custom_op("mace_accel_test::weighted_cube")
def cube_op(x: Tensor, scale: List[Tensor], power: int) -> Tensor:
    """``scale[0] * x ** power`` (a list input, as the conv's graph is)."""
    CALLS["forward"] += 1
    return scale[0] * x.pow(power)


@cube_op.register_fake
def _(x, scale, power):
    return torch.empty_like(x)


@custom_op("mace_accel_test::weighted_cube_backward")
def cube_backward_op(x: Tensor, g: Tensor, scale: List[Tensor], power: int) -> Tensor:
    return g * scale[0] * power * x.pow(power - 1)


@cube_backward_op.register_fake
def _(x, g, scale, power):
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:
    x, scale, power = inputs
    ctx.save_for_backward(x)
    ctx.scale, ctx.power = scale, power


def _backward(ctx, g):
    (x,) = ctx.saved_tensors
    return cube_backward_op(x, g, ctx.scale, ctx.power), [None], None


def _setup_backward(ctx, inputs, output) -> None:
    x, g, scale, power = inputs
    ctx.save_for_backward(x, g)
    ctx.scale, ctx.power = scale, power


def _backward_of_backward(ctx, a):
    x, g = ctx.saved_tensors
    dx = a * g * ctx.scale[0] * ctx.power * (ctx.power - 1) * x.pow(ctx.power - 2)
    dg = cube_backward_op(x, a, ctx.scale, ctx.power)
    return dx, dg, [None], None


cube_op.register_autograd(_backward, setup_context=_setup)
cube_backward_op.register_autograd(_backward_of_backward, setup_context=_setup_backward)


def _derivatives(call):
    x = torch.linspace(-1.5, 2.0, 7, dtype=torch.float64).requires_grad_(True)
    scale = [torch.tensor(0.7, dtype=torch.float64)]
    y = call(x, scale, 3)
    (gx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    (ggx,) = torch.autograd.grad(gx.sin().sum(), x)
    return y, gx, ggx


def test_eager_path_equals_the_registered_op_to_the_second_derivative():
    assert isinstance(cube_op, EagerCustomOp) and cube_op.__name__ == "cube_op"
    eager, registered = _derivatives(cube_op), _derivatives(cube_op.op)
    x = torch.linspace(-1.5, 2.0, 7, dtype=torch.float64)
    assert torch.allclose(eager[0], 0.7 * x ** 3, rtol=1e-14)
    assert torch.allclose(eager[1], 2 * (0.7 * x ** 3) * 2.1 * x ** 2, rtol=1e-14)
    for a, b in zip(eager, registered):
        assert torch.equal(a, b)


def test_the_eager_path_is_a_plain_autograd_function():
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    scale = [torch.tensor(2.0, dtype=torch.float64)]
    assert type(cube_op(x, scale, 2).grad_fn).__name__.startswith("Eager")
    assert "Eager" not in type(cube_op.op(x, scale, 2).grad_fn).__name__
    with torch.no_grad():
        before = CALLS["forward"]
        out = cube_op(x, scale, 2)
        assert out.grad_fn is None and CALLS["forward"] == before + 1
    assert cube_op(x.detach(), scale, 2).grad_fn is None


def test_fake_tensors_and_compile_take_the_registered_op():
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.ones(4))
        assert cube_op(fake, [mode.from_tensor(torch.tensor(1.0))], 2).shape == (4,)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    x = torch.randn(5)
    compiled = torch.compile(lambda t: cube_op(t, [torch.tensor(1.5)], 3) + 1.0,
                             backend=backend, fullgraph=True)
    assert torch.allclose(compiled(x), 1.5 * x ** 3 + 1.0)
    assert any("weighted_cube" in s for s in seen), seen


def test_a_list_tensor_that_requires_grad_takes_the_registered_op():
    """A ``Function`` does not differentiate tensors inside a list argument: such a call (the
    contraction's weights when training) runs the registered op."""
    x = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64)
    scale = [torch.tensor(0.5, dtype=torch.float64, requires_grad=True)]
    y = cube_op(x, scale, 3)
    assert "Eager" not in type(y.grad_fn).__name__
