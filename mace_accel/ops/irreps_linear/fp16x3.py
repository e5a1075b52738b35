"""An equivariant linear map's blocks in one launch on the FP16 tensor cores with float32's
accuracy (3xFP16): the plan, the weights' split, the CUDA side of
``kernels/irreps_linear/fp16x3.cu.j2`` and its entry point (:func:`mm_grouped_fp16x3`).

Each operand is split as ``x = (hi + lo) / s``: ``hi`` = FP16 of ``x s``, ``lo`` = FP16 of the
rest, ``s`` a power of two that puts the largest magnitude of its group in [2^14, 2^15)
(FP16's range ends at 65,504). ``hi lo + lo hi + hi hi`` on ``mma.m16n8k16`` is as accurate as
3xTF32 (22 of float32's 24 bits per operand; what is dropped, ``lo lo``, is 2^-22 of the
product) at twice the tensor cores' rate per instruction. The weights are split once, on the
host (:func:`split_weights`, one scale per block); the inputs as the kernel loads them, one
scale per group of 8 rows (:data:`TILES`) and K slice of 32, each slice's sum rescaled as it
is added in float32.
Values far below their group's largest (2^-17 of it and less) keep an absolute error of 2^-39
of it, not a relative one.

The problem is a :class:`~.grouped.GroupedSpec` (e3nn's layout read and written in place);
every block's ``k`` a multiple of 32 (:func:`misfit`). On Hopper the same maps run on
``wgmma`` (:mod:`.fp16x3_wgmma`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from mace_accel.ops import registry
from mace_accel.ops.irreps_linear.grouped import GroupedSpec
from mace_accel.ops.runtime import CudaKernels, check_aligned, check_rows, i32, ptr
from mace_accel.ops.templates import render

Tensor = torch.Tensor
K_ALIGN = 32  # every block's k is a multiple of the K slices (two or four k16 steps)
# (bm, bn, warps_m, warps_n, bk, prefetch, min_blocks, group_rows, chunk): 64 x 128 tiles of
# eight warps of 32 x 32, K in slices of 32, A's loaded one slice ahead, two blocks an SM (128
# registers a thread), one scale per 8 rows of A and slice, a warp's slice summed for all its
# n8 tiles at once (chunks of two spilled under the 128 registers). On MH-1's maps at 864 and
# 6,912 nodes 0.51-0.59x the time of the 3xTF32 kernel they replaced (0.78x for linear_1's
# transpose at 864), ahead of 64 x 64 tiles (three blocks an SM), 128 x 128 tiles, one scale
# per 16 rows, slices of 64 and A loaded two slices ahead; at 256 nodes 0.48-1.04x
# (scripts/bench_kernels.py grouped-linear)
TILES = (64, 128, 2, 4, 32, 1, 2, 8, 4)
TOP_EXPONENT = 14  # a group's largest magnitude is scaled into [2^14, 2^15)


@dataclasses.dataclass(frozen=True)
class Fp16x3Plan:
    """Tile geometry of one grouped 3xFP16 kernel: ``bm x bn`` outputs per block,
    ``warps_m x warps_n`` warps of ``mi x ni`` mma tiles (16 x 8)."""

    spec_key: str
    arch: str
    bm: int
    bn: int
    warps_m: int
    warps_n: int
    bk: int
    prefetch: int
    min_blocks: int
    group_rows: int
    chunk: int
    groups: tuple
    lda: int
    ldc: int

    @property
    def mi(self) -> int:
        return self.bm // (16 * self.warps_m)

    @property
    def ni(self) -> int:
        return self.bn // (8 * self.warps_n)

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def shared_bytes(self) -> int:
        """Two stages of A's and the weights' hi and lo slices (rows of ``BK + 8`` halves),
        and the scales."""
        return 2 * 2 * 2 * (self.bm + self.bn) * (self.bk + 8) + 2 * 4 * (self.bm //
                                                                         self.group_rows)

    def grid(self, nodes: int) -> Tuple[int, int]:
        return max(1, sum(-(-nodes * b.d // self.bm) * -(-b.n // self.bn)
                          for b in self.groups)), 1


def misfit(spec: GroupedSpec) -> Optional[str]:
    """Why ``spec`` cannot run on the 3xFP16 kernel, or None."""
    for b in spec.blocks:
        if b.k % K_ALIGN or b.w_offset % 8:
            return (f"the 3xFP16 kernel needs every block's k to be a multiple of {K_ALIGN} "
                    f"and its weights 16-byte aligned, got k={b.k} at {b.w_offset}")
    return None


def plan_fp16x3(spec: GroupedSpec, arch: str = "sm_90") -> Fp16x3Plan:
    """The plan of ``spec``: :data:`TILES` (its slices divide every k that :func:`misfit` lets
    through).

    Raises:
        ValueError: a spec the kernel cannot take (:func:`misfit`).
    """
    why = misfit(spec)
    if why is not None:
        raise ValueError(why)
    return Fp16x3Plan(spec.key(), arch, *TILES, spec.blocks, spec.lda, spec.ldc)


def kernel_name(plan: Fp16x3Plan) -> str:
    return (f"mace_fp16x3_gemm_{plan.spec_key}_{plan.bm}x{plan.bn}x{plan.bk}"
            f"_w{plan.warps_m}x{plan.warps_n}_p{plan.prefetch}_b{plan.min_blocks}"
            f"_g{plan.group_rows}_c{plan.chunk}")


def render_kernel(plan: Fp16x3Plan) -> str:
    return render("irreps_linear/fp16x3.cu.j2", plan=plan, name=kernel_name(plan))


def power_of_two_scale(top: Tensor) -> Tensor:
    """``2^(14 - e)`` for the largest magnitudes ``top`` (``e`` their float32 exponent, ``top``
    = 0 taken as 1): ``top`` times it lies in [2^14, 2^15) (the scale kept a normal float32).
    Shape of ``top``, float32."""
    exponent = torch.frexp(torch.where(top > 0, top, torch.ones_like(top)))[1] - 1
    return torch.ldexp(torch.ones_like(top), (TOP_EXPONENT - exponent).clamp(-126, 127))


def split_weights(spec: GroupedSpec, w: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``(hi, lo, inverse scales)`` of the blocks' weights ``w [weight_numel]`` (float32, block
    ``b``'s ``[n, k]`` at ``b.w_offset``): FP16 ``[weight_numel]`` each and float32
    ``[blocks]``; block ``b``'s weights are ``(hi + lo) * inv[b]`` to 2^-22."""
    scaled = torch.empty_like(w)
    scales = []
    for b in spec.blocks:
        part = w[b.w_offset:b.w_offset + b.n * b.k]
        s = power_of_two_scale(part.abs().max())
        scaled[b.w_offset:b.w_offset + b.n * b.k] = part * s
        scales.append(s)
    hi = scaled.half()
    lo = (scaled - hi.float()).half()
    return hi, lo, 1.0 / torch.stack(scales).float()


class CudaFp16x3(CudaKernels):
    """The grouped 3xFP16 kernel of one :class:`GroupedSpec` on one device (``mma.sync``; the
    checks and launch of its wgmma form too)."""

    label = "3xFP16"
    _render = staticmethod(render_kernel)
    _name = staticmethod(kernel_name)

    def __init__(self, spec: GroupedSpec, device: torch.device) -> None:
        super().__init__(torch.float32, device, f"{spec.describe()} ({self.label})")
        self.spec = spec
        self.plan = self._plan(self.arch)
        self.arch = self.plan.arch  # the wgmma kernel's is sm_90a, not the device's sm_90

    def _plan(self, arch: str) -> Fp16x3Plan:
        return plan_fp16x3(self.spec, arch)

    def _weights_numel(self) -> int:
        """Halves of each of the weights' hi and lo parts the kernel reads."""
        return self.spec.weight_numel

    def apply(self, x: Tensor, weights: Tuple[Tensor, Tensor, Tensor], out: Tensor) -> None:
        """Writes every block into ``out [N, ldc]`` from ``x [N, lda]`` and the split weights
        of :func:`split_weights`; the other columns of ``out`` are left alone. ``x`` and
        ``out`` contiguous float32, 16-byte aligned.

        Raises:
            KernelError: a tensor of the wrong shape, dtype, device or alignment.
        """
        s, hi, lo, inv = self.spec, *weights
        nodes = int(x.shape[0]) if x.dim() == 2 else -1
        self._check_tensor("x", x, (nodes, s.lda))
        self._check_tensor("out", out, (nodes, s.ldc))
        for name, t in (("hi", hi), ("lo", lo)):
            self._check_tensor(name, t, (self._weights_numel(),), torch.float16)
            check_aligned(name, t, self.what)
        self._check_tensor("inv", inv, (len(s.blocks),))
        for name, t in (("x", x), ("out", out)):
            check_aligned(name, t, self.what)
        check_rows(nodes * max(b.d for b in s.blocks), self.plan.bm, self.what)
        if nodes == 0:
            return
        kernel = self._kernel(self._name(self.plan), lambda: self._render(self.plan),
                              self.plan.shared_bytes)
        kernel.launch(self.plan.grid(nodes), self.plan.threads,
                      (ptr(x), ptr(hi), ptr(lo), ptr(inv), ptr(out), i32(nodes)))


def mm_grouped_fp16x3(spec: GroupedSpec, x: Tensor, split: Tuple[Tensor, Tensor, Tensor],
                      out: Tensor) -> None:
    """Writes the blocks of ``spec`` into ``out [N, ldc]`` from ``x [N, lda]`` in one launch,
    in place (no copies), no autograd, on the FP16 tensor cores (3xFP16), the weights ``split``
    by :func:`split_weights`."""
    kernel = registry.cached(("irreps_linear", "fp16x3", spec, x.device),
                             lambda: CudaFp16x3(spec, x.device))
    kernel.apply(x, split, out)
