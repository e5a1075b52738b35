"""The CUDA side of the edge features: the generated kernels of one spec, dtype and device.

Kernels are compiled on first use by :mod:`mace_accel.ops.runtime` and launched on torch's
current stream; launch geometry comes from the :class:`~.schedule.EdgePlan`. Every output is
allocated here with ``torch.empty`` (each kernel writes every element of it); the kernels
allocate nothing and never synchronise, so they can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch

from mace_accel.errors import KernelError, KernelSizeError
from mace_accel.ops.edge_features.codegen import kernel_name, render_radial, render_sh
from mace_accel.ops.edge_features.schedule import EdgePlan, plan_for
from mace_accel.ops.edge_features.spec import RadialSpec, SHSpec
from mace_accel.ops.runtime import INT32_MAX, CudaKernels, compile_soon, i32, ptr
from mace_accel.options import dtype_name

Tensor = torch.Tensor


class _EdgeKernels(CudaKernels):
    """The three kernels (forward, backward, double backward) of one spec, dtype and device."""

    family = ""

    def __init__(self, spec: Union[SHSpec, RadialSpec], dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(dtype, device, spec.describe())
        reason = spec.unsupported_reason()
        if reason is not None:
            raise KernelError(f"{spec.describe()} cannot be fused: {reason}")
        self.spec = spec
        self.plan: EdgePlan = plan_for(spec, dtype_name(dtype), self.limits)
        self._sources: Dict[str, str] = {}

    def _render(self, which: str) -> str:
        raise NotImplementedError

    def _source(self, which: str) -> str:
        """Kernel ``which``'s source, rendered once: the head start and the first launch both
        need it, and rendering works through the symbolic programs (tenths of a second)."""
        if which not in self._sources:
            self._sources[which] = self._render(which)
        return self._sources[which]

    def start_compiles(self) -> None:
        """Start compiling the forward and the backward
        (:func:`~mace_accel.ops.runtime.compile_soon`)."""
        for which in ("forward", "backward"):
            compile_soon(self._source(which), self.plan.arch)

    def _launch(self, which: str, n_edges: int, args: tuple) -> None:
        if n_edges == 0:
            return
        k = self._kernel(kernel_name(self.family, which), lambda: self._source(which))
        k.launch(self.plan.blocks(n_edges), self.plan.threads, args + (i32(n_edges),))

    def _check(self, n_edges: int, **tensors: Tuple[Tensor, Tuple[int, ...]]) -> None:
        """Each ``name=(tensor, expected shape)``: dtype, device, shape and contiguity."""
        if n_edges > INT32_MAX:
            raise KernelSizeError(f"{n_edges} edges exceed the kernels' int32 edge count")
        for name, (t, shape) in tensors.items():
            self._check_tensor(name, t, shape)


class CudaSphericalHarmonics(_EdgeKernels):
    """Spherical harmonics of one :class:`SHSpec` (see :mod:`.reference` for the maths)."""

    family = "sh"

    def _render(self, which: str) -> str:
        return render_sh(self.spec, self.plan, which)

    def _n(self, vectors: Tensor) -> int:
        if vectors.dim() != 2:
            raise KernelError(f"vectors: expected shape (n_edges, 3), got {tuple(vectors.shape)}")
        return int(vectors.shape[0])

    def forward(self, vectors: Tensor) -> Tensor:
        """``edge_attrs [E, dim]`` of ``vectors [E, 3]``."""
        e = self._n(vectors)
        self._check(e, vectors=(vectors, (e, 3)))
        out = self._empty(e, self.spec.dim)
        self._launch("forward", e, (ptr(vectors), ptr(out)))
        return out

    def backward(self, vectors: Tensor, grad: Tensor) -> Tensor:
        """``d vectors [E, 3]`` of ``<grad, Y(vectors)>``."""
        e = self._n(vectors)
        self._check(e, vectors=(vectors, (e, 3)), grad=(grad, (e, self.spec.dim)))
        out = self._empty(e, 3)
        self._launch("backward", e, (ptr(vectors), ptr(grad), ptr(out)))
        return out

    def double_backward(self, vectors: Tensor, grad: Tensor,
                        upstream: Tensor) -> Tuple[Tensor, Tensor]:
        """``(d vectors [E, 3], d grad [E, dim])`` for ``upstream [E, 3]``."""
        e = self._n(vectors)
        self._check(e, vectors=(vectors, (e, 3)), grad=(grad, (e, self.spec.dim)),
                    upstream=(upstream, (e, 3)))
        d_vectors, d_grad = self._empty(e, 3), self._empty(e, self.spec.dim)
        self._launch("double_backward", e,
                     (ptr(vectors), ptr(grad), ptr(upstream), ptr(d_vectors), ptr(d_grad)))
        return d_vectors, d_grad


class CudaRadialEmbedding(_EdgeKernels):
    """Bessel basis times polynomial cutoff of one :class:`RadialSpec`."""

    family = "radial"

    def _render(self, which: str) -> str:
        return render_radial(self.spec, self.plan, which)

    def _n(self, lengths: Tensor) -> int:
        if lengths.dim() != 2:
            raise KernelError(f"lengths: expected shape (n_edges, 1), got {tuple(lengths.shape)}")
        return int(lengths.shape[0])

    def _cutoff_grad(self, e: int, grad_cutoff: Optional[Tensor]) -> Dict[str, tuple]:
        if self.spec.apply_cutoff:
            return {}
        if grad_cutoff is None:
            raise KernelError("grad_cutoff is required when the cutoff is returned apart "
                              "(apply_cutoff=False)")
        return {"grad_cutoff": (grad_cutoff, (e, 1))}

    def _r0(self, e: int, r0: Optional[Tensor]) -> Dict[str, tuple]:
        if self.spec.transform is None:
            return {}
        if r0 is None:
            raise KernelError(f"{self.spec.describe()}: each edge's r0 [E, 1] is required "
                              "with a distance transform")
        return {"r0": (r0, (e, 1))}

    def _r0_ptr(self, r0: Optional[Tensor]):
        return ptr(None if self.spec.transform is None else r0)

    def forward(self, lengths: Tensor, r0: Optional[Tensor] = None
                ) -> Tuple[Tensor, Optional[Tensor]]:
        """``(feats [E, B], cutoff [E, 1])``; cutoff is None when applied (``apply_cutoff``);
        ``r0 [E, 1]``: each edge's length scale where the spec has a distance transform."""
        e = self._n(lengths)
        self._check(e, lengths=(lengths, (e, 1)), **self._r0(e, r0))
        feats = self._empty(e, self.spec.num_basis)
        cutoff = None if self.spec.apply_cutoff else self._empty(e, 1)
        self._launch("forward", e, (ptr(lengths), self._r0_ptr(r0), ptr(feats), ptr(cutoff)))
        return feats, cutoff

    def backward(self, lengths: Tensor, grad: Tensor, grad_cutoff: Optional[Tensor],
                 r0: Optional[Tensor] = None) -> Tensor:
        """``d lengths [E, 1]``; ``grad_cutoff [E, 1]`` only when the cutoff is apart."""
        e = self._n(lengths)
        self._check(e, lengths=(lengths, (e, 1)), grad=(grad, (e, self.spec.num_basis)),
                    **self._cutoff_grad(e, grad_cutoff), **self._r0(e, r0))
        out = self._empty(e, 1)
        self._launch("backward", e, (ptr(lengths), self._r0_ptr(r0), ptr(grad),
                                     ptr(None if self.spec.apply_cutoff else grad_cutoff),
                                     ptr(out)))
        return out

    def double_backward(self, lengths: Tensor, grad: Tensor, grad_cutoff: Optional[Tensor],
                        upstream: Tensor, r0: Optional[Tensor] = None
                        ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """``(d lengths [E, 1], d grad [E, B], d grad_cutoff [E, 1] or None)``."""
        e = self._n(lengths)
        self._check(e, lengths=(lengths, (e, 1)), grad=(grad, (e, self.spec.num_basis)),
                    upstream=(upstream, (e, 1)), **self._cutoff_grad(e, grad_cutoff),
                    **self._r0(e, r0))
        d_lengths, d_grad = self._empty(e, 1), self._empty(e, self.spec.num_basis)
        d_cutoff = None if self.spec.apply_cutoff else self._empty(e, 1)
        self._launch("double_backward", e,
                     (ptr(lengths), self._r0_ptr(r0), ptr(grad),
                      ptr(None if self.spec.apply_cutoff else grad_cutoff), ptr(upstream),
                      ptr(d_lengths), ptr(d_grad), ptr(d_cutoff)))
        return d_lengths, d_grad, d_cutoff
