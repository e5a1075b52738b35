"""The CUDA side of the symmetric contraction: the generated kernels of one spec, dtype, device.

Kernels are compiled on first use by :mod:`mace_accel.ops.runtime` and launched on torch's
current stream; the launch geometry comes from the :class:`~.codegen.SCPlan`. Every output is
allocated here with ``torch.empty`` (each kernel writes every element of it); the kernels
allocate nothing and never synchronise, so they can be captured in a CUDA graph. The weight
gradients are per-node sums ``Q [N, K_total, C]`` from a kernel, then ``onehot(elem)^T Q`` as one
GEMM (deterministic, no atomics).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from mace_accel.errors import KernelError, KernelSizeError
from mace_accel.ops.runtime import INT32_MAX, CudaKernels, Kernel, compile_soon, i32, ptr
from mace_accel.ops.symmetric_contraction import codegen
from mace_accel.ops.symmetric_contraction.spec import SCSpec
from mace_accel.options import dtype_name

Tensor = torch.Tensor


class CudaSymmetricContraction(CudaKernels):
    """Forward, backward, weight-gradient and double-backward kernels of one :class:`SCSpec`.

    Args:
        spec: the contraction.
        dtype: ``torch.float32`` or ``torch.float64``.
        device: a CUDA device.
    """

    def __init__(self, spec: SCSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(dtype, device, spec.describe())
        self.spec = spec
        self.plan = codegen.plan_kernels(spec, dtype_name(dtype), self.limits)
        self.k_total = sum(k for _, k, _ in spec.weight_shapes)

    # -- plumbing ----------------------------------------------------------------------------
    def _load(self, source: str, name: str, dynamic_shared: int = 0) -> Kernel:
        """As :meth:`CudaKernels._load`, with the plan's accumulators where ``source`` declares
        dynamic shared memory (the float64 gradient accumulators live there)."""
        if "extern __shared__" in source:
            dynamic_shared = self.plan.accumulator_bytes
        return super()._load(source, name, dynamic_shared)

    def start_compiles(self) -> None:
        """Start compiling (:func:`~mace_accel.ops.runtime.compile_soon`) what a forces call
        launches: the forward and the backward to the features."""
        compile_soon(codegen.render_forward(self.plan, self.spec), self.plan.arch)
        compile_soon(codegen.render_backward(self.plan, self.spec), self.plan.arch)

    def _launch(self, name: str, render, n_nodes: int, args: tuple) -> None:
        if n_nodes == 0:
            return
        self._kernel(name, render).launch(self.plan.blocks(n_nodes), self.plan.threads,
                                          args + (i32(n_nodes),))

    def _check(self, x: Tensor, elem: Tensor, weights: Optional[Sequence[Tensor]] = None,
               **others: Tuple[Tensor, Tuple[int, ...]]) -> int:
        """Dtype, device, shape and contiguity of every input; returns the node count."""
        s = self.spec
        if x.dim() != 3:
            raise KernelError(f"x: expected shape (n_nodes, {s.num_features}, "
                              f"{s.num_components}), got {tuple(x.shape)}")
        n = int(x.shape[0])
        # the largest per-node buffer of inference: x / dx [C, D], out / dg [dim_out]
        per_node = max(s.num_features * s.num_components, s.dim_out)
        if n > INT32_MAX // max(1, per_node):
            raise KernelSizeError(f"{n} nodes exceed the kernels' int32 index range (at most "
                                  f"{INT32_MAX // max(1, per_node)} for this block)")
        tensors = dict(x=(x, (n, s.num_features, s.num_components)), **others)
        if weights is not None:
            if len(weights) != len(s.weight_shapes):
                raise KernelError(f"expected {len(s.weight_shapes)} weight tensors, got "
                                  f"{len(weights)} ({s.describe()})")
            tensors.update({f"weights[{j}]": (w, shape)
                            for j, (w, shape) in enumerate(zip(weights, s.weight_shapes))})
        for name, (t, shape) in tensors.items():
            self._check_tensor(name, t, shape)
        self._check_tensor("elem", elem, (n,), torch.int32)
        return n

    # -- the passes --------------------------------------------------------------------------
    def forward(self, x: Tensor, elem: Tensor, weights: Sequence[Tensor]) -> Tensor:
        """``out [N, dim_out]`` of ``x [N, C, D]``, ``elem [N]`` int32, weights ``[Z, K, C]``."""
        n = self._check(x, elem, weights)
        out = self._empty(n, self.spec.dim_out)
        self._launch(codegen.forward_name(self.plan),
                     lambda: codegen.render_forward(self.plan, self.spec), n,
                     (ptr(x), ptr(elem), *map(ptr, weights), ptr(out)))
        return out

    def backward_x(self, x: Tensor, elem: Tensor, weights: Sequence[Tensor],
                   g: Tensor) -> Tensor:
        """``d x [N, C, D]`` of ``<g, out>`` for ``g [N, dim_out]``."""
        n = self._check(x, elem, weights, g=(g, (x.shape[0], self.spec.dim_out)))
        gx = self._empty(n, self.spec.num_features, self.spec.num_components)
        self._launch(codegen.backward_name(self.plan),
                     lambda: codegen.render_backward(self.plan, self.spec), n,
                     (ptr(x), ptr(elem), *map(ptr, weights), ptr(g), ptr(gx)))
        return gx

    def weight_grads(self, x: Tensor, elem: Tensor, g: Tensor,
                     v: Optional[Tensor] = None) -> List[Tensor]:
        """``d W_j [Z, K_j, C]`` of ``<g, out>`` (or, with ``v [N, C, D]``, of ``<g, J_x(out) v>``:
        the double backward's weight term)."""
        s = self.spec
        others = dict(g=(g, (x.shape[0], s.dim_out)))
        if v is not None:
            others["v"] = (v, tuple(x.shape))
        n = self._check(x, elem, None, **others)
        if n > INT32_MAX // (self.k_total * s.num_features):  # q [N, K_total, C] (training)
            raise KernelSizeError(
                f"{n} nodes exceed the weight-gradient kernel's int32 index range (at most "
                f"{INT32_MAX // (self.k_total * s.num_features)} for this block); train on "
                "smaller batches")
        directional = v is not None
        q = self._empty(n, self.k_total, s.num_features)
        args = (ptr(x),) + ((ptr(v),) if directional else ()) + (ptr(g), ptr(q))
        self._launch(codegen.weight_grad_name(self.plan, directional),
                     lambda: codegen.render_weight_grad(self.plan, s, directional), n, args)
        onehot = torch.nn.functional.one_hot(elem.long(), s.num_elements).to(self.dtype)
        summed = (onehot.t() @ q.reshape(n, self.k_total * s.num_features)).reshape(
            s.num_elements, self.k_total, s.num_features)
        # separate tensors: a custom op's outputs may not alias each other
        return [t.clone() for t in torch.split(summed, [k for _, k, _ in s.weight_shapes], dim=1)]

    def double_backward(self, x: Tensor, v: Tensor, elem: Tensor, weights: Sequence[Tensor],
                        g: Tensor, need_x: bool, need_g: bool
                        ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """For an upstream ``v [N, C, D]`` of ``backward_x``: ``(d x [N, C, D], d g [N, dim_out])``
        (each None when not asked for)."""
        s = self.spec
        n = self._check(x, elem, weights, v=(v, tuple(x.shape)), g=(g, (x.shape[0], s.dim_out)))
        if not (need_x or need_g):
            return None, None
        dx = self._empty(n, s.num_features, s.num_components) if need_x else None
        dg = self._empty(n, s.dim_out) if need_g else None
        self._launch(codegen.double_backward_name(self.plan, need_x, need_g),
                     lambda: codegen.render_double_backward(self.plan, s, need_x, need_g), n,
                     (ptr(x), ptr(v), ptr(elem), *map(ptr, weights), ptr(g), ptr(dx), ptr(dg)))
        return dx, dg
