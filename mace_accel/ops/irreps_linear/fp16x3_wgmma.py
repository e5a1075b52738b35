"""The grouped 3xFP16 kernel on Hopper's warpgroup tensor-core instructions (``wgmma``,
sm_90a): the plan, the weights' packing, the CUDA side of
``kernels/irreps_linear/fp16x3_wgmma.cu.j2`` and its entry point
(:func:`mm_grouped_fp16x3_wgmma`).

Same contract, the same split and the same accuracy as the ``mma.sync`` kernel of
:mod:`.fp16x3` (``x = (hi + lo) / s``, three FP16 products per step, one scale per K slice of
32 and 16 rows of the input (8 there), each slice summed on the tensor cores and added in
float32); another design:

* a warpgroup (4 warps) takes 64 rows and 128 columns, one ``wgmma.m64n128k16`` per product
  and k16 step, issued asynchronously; two blocks an SM;
* the input never goes through shared memory: each thread loads its values of wgmma's A
  fragment straight from global memory, two slices ahead, and scales and splits them in its
  registers (one scale per warp, 16 rows, and slice), the next slice while this one's
  products run on the tensor cores (two sets of fragments);
* the weights' hi and lo parts are packed once on the host per tile of 128 columns and K slice
  in wgmma's canonical K-major layout (:func:`pack_weights`): a stage is one contiguous copy
  (``cp.async``, ``stages - 1`` slices ahead);
* a row tile's column tiles run side by side, so that the input comes from DRAM once.

On MH-1's maps (``scripts/bench_kernels.py grouped-linear``) it takes 0.44-0.60x the
``mma.sync`` kernel's time at 256 to 6,912 nodes, with the same errors; on linear_2 at 6,912
nodes about 360 TFLOP/s of FP16 products, against cuBLAS's 500 for one FP16 pass. It is bound by
the instructions around the products (the split, the float32 sums of the slices, the loads),
two warpgroups an SM (255 registers a thread): the tensor cores are busy ~45% of the time.
Tried and slower: the input through shared memory by ``cp.async`` (0.72x the ``mma.sync``
kernel's time where this design then took 0.61x), the input split once per block for two
warpgroups of 128 columns each (0.72x: their barrier each slice), two warpgroups sharing the
weights' stages, 64-column tiles (three blocks an SM), the column halves summed apart, the
input loaded one slice ahead; slices of 64 are up to 10% faster and 1.1-1.6x less accurate (a
twice longer chain of products summed by the tensor cores, which truncate).

Canonical K-major layout (no swizzle) of a ``[128, BK]`` slice of FP16 weights (rows: output
channels; columns: the reduced dimension): element ``(r, c)`` at ``((r / 8) * (BK / 8) + c / 8)
* 64 + (r % 8) * 8 + c % 8``: core matrices of 8 rows x 16 bytes, consecutive along K (leading
byte offset 128), then along the rows (stride byte offset ``BK * 16``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Tuple

import torch

from mace_accel.errors import KernelError
from mace_accel.ops import registry
from mace_accel.ops.irreps_linear import fp16x3
from mace_accel.ops.irreps_linear.grouped import GroupedSpec
from mace_accel.ops.runtime import device_limits
from mace_accel.ops.templates import render

Tensor = torch.Tensor
ARCH = "sm_90a"  # wgmma exists only on sm_90a (H100/H200), not on later architectures
DEVICE_ARCH = "sm_90"  # the devices it runs on
# (bk, stages, ahead): K in slices of 32, four stages of the weights, the input loaded two
# slices ahead (one ahead: 4-20% slower at 256 to 6,912 nodes)
TILES = (32, 4, 2)
BM, BN, THREADS = 64, 128, 128  # a block: one warpgroup


class Packed(NamedTuple):
    """The weights as the kernel reads them (:func:`pack_weights`): FP16 ``hi`` and ``lo``
    ``[packed_numel]``, float32 inverse scales ``inv [blocks]``."""

    hi: Tensor
    lo: Tensor
    inv: Tensor


@dataclasses.dataclass(frozen=True)
class WgmmaFp16x3Plan:
    """Tile geometry of one grouped 3xFP16 wgmma kernel: blocks of :data:`BM` x :data:`BN`
    outputs, K in slices of ``bk``, ``stages`` weight slices in shared memory, the input
    loaded ``ahead`` slices ahead."""

    spec_key: str
    arch: str
    bk: int
    stages: int
    ahead: int
    groups: tuple
    lda: int
    ldc: int
    packed_offsets: Tuple[int, ...]  # block b's packed weights start here (halves)
    packed_numel: int
    bm: int = BM
    bn: int = BN
    threads: int = THREADS

    @property
    def shared_bytes(self) -> int:
        """``stages`` slices of the weights, hi and lo, ``bn x bk`` FP16 each."""
        return self.stages * 2 * self.bn * self.bk * 2

    def grid(self, nodes: int) -> Tuple[int, int]:
        return max(1, sum(-(-nodes * b.d // self.bm) * -(-b.n // self.bn)
                          for b in self.groups)), 1


def plan_wgmma(spec: GroupedSpec) -> WgmmaFp16x3Plan:
    """The plan of ``spec``: :data:`TILES` (its slices divide every k that
    :func:`.fp16x3.misfit` lets through).

    Raises:
        ValueError: a spec the kernel cannot take (:func:`.fp16x3.misfit`).
    """
    why = fp16x3.misfit(spec)
    if why is not None:
        raise ValueError(why)
    offsets, at = [], 0
    for b in spec.blocks:
        offsets.append(at)
        at += -(-b.n // BN) * BN * b.k
    return WgmmaFp16x3Plan(spec.key(), ARCH, *TILES, spec.blocks, spec.lda, spec.ldc,
                           tuple(offsets), at)


def runs_on(spec: GroupedSpec, device: torch.device) -> bool:
    """Whether the wgmma kernel takes ``spec`` on ``device`` (a CUDA device of
    :data:`DEVICE_ARCH`)."""
    return device.type == "cuda" and fp16x3.misfit(spec) is None \
        and device_limits(device).arch == DEVICE_ARCH


def wgmma_function(name: str, n: int, shape_types: str, immediates: str) -> str:
    """C++ of ``name(d, a, b, scale_d)``: ``d [64 x n] (+)= A B^T`` for one K step of
    ``wgmma.mma_async.sync.aligned.m64n<n><shape_types>`` (e.g. ``k16.f32.f16.f16``), ``d``
    the thread's ``n / 2`` float32 accumulators, ``A`` the thread's fragment (4 32-bit
    registers), ``B`` a shared-memory descriptor; ``scale_d`` 0 overwrites ``d``;
    ``immediates``: the instruction's operands after the predicate (the scales of A and B, and
    the transposes its types allow)."""
    regs = n // 2
    outs = ", ".join(f"%{r}" for r in range(regs))
    binds = ", ".join(f'"+f"(d[{r}])' for r in range(regs))
    a_operand = "{" + ", ".join(f"%{regs + i}" for i in range(4)) + "}"
    a_binds = "".join(f'"r"(a[{i}]), ' for i in range(4))
    b = regs + 4  # the operand after the accumulators and A's four registers
    return (
        f"__device__ __forceinline__ void {name}(float (&d)[{regs}], const unsigned (&a)[4], "
        f"const u64 b, const int scale_d) {{\n"
        f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{b + 1}, 0;\\n"\n'
        f'               "wgmma.mma_async.sync.aligned.m64n{n}{shape_types} "\n'
        f'               "{{{outs}}}, {a_operand}, %{b}, p, {immediates};\\n}}\\n"\n'
        f"               : {binds}\n"
        f'               : {a_binds}"l"(b), "r"(scale_d));\n'
        f"}}\n")


def kernel_name(plan: WgmmaFp16x3Plan) -> str:
    return f"mace_fp16x3_wgmma_{plan.spec_key}_k{plan.bk}s{plan.stages}a{plan.ahead}"


def render_kernel(plan: WgmmaFp16x3Plan) -> str:
    return render("irreps_linear/fp16x3_wgmma.cu.j2", plan=plan, name=kernel_name(plan),
                  wgmma_function=wgmma_function("wgmma_f16", plan.bn, "k16.f32.f16.f16",
                                                "1, 1, 0"))


def pack_weights(plan: WgmmaFp16x3Plan, split: Tuple[Tensor, Tensor, Tensor]) -> Packed:
    """``(hi, lo, inv)`` of :func:`.fp16x3.split_weights` with ``hi`` and ``lo`` packed for the
    kernel: per block, its ``[n, k]`` rows zero-padded to whole tiles of :data:`BN`, then per
    tile and K slice of ``bk`` one ``[BN, bk]`` matrix in the canonical layout (module
    docstring). FP16 ``[packed_numel]`` each."""
    hi, lo, inv = split
    packed = []
    for part in (hi, lo):
        out = part.new_zeros(plan.packed_numel)
        for b, at in zip(plan.groups, plan.packed_offsets):
            nt, kt = -(-b.n // plan.bn), b.k // plan.bk
            m = part.new_zeros(nt * plan.bn, b.k)
            m[:b.n] = part[b.w_offset:b.w_offset + b.n * b.k].view(b.n, b.k)
            tiles = m.view(nt, plan.bn // 8, 8, kt, plan.bk // 8, 8).permute(0, 3, 1, 4, 2, 5)
            out[at:at + m.numel()] = tiles.reshape(-1)
        packed.append(out)
    return Packed(packed[0], packed[1], inv)


class CudaFp16x3Wgmma(fp16x3.CudaFp16x3):
    """The grouped 3xFP16 wgmma kernel of one :class:`GroupedSpec` on one Hopper device."""

    label = "3xFP16, wgmma"
    _render = staticmethod(render_kernel)
    _name = staticmethod(kernel_name)

    def _plan(self, arch: str) -> WgmmaFp16x3Plan:
        if arch != DEVICE_ARCH:
            raise ValueError(f"the 3xFP16 wgmma kernel runs on {DEVICE_ARCH} devices (H100, "
                             f"H200), not {arch}")
        return plan_wgmma(self.spec)

    def _weights_numel(self) -> int:
        return self.plan.packed_numel

    def apply(self, x: Tensor, weights: Packed, out: Tensor) -> None:
        """:meth:`.fp16x3.CudaFp16x3.apply` with the weights packed by :func:`pack_weights`.

        Raises:
            KernelError: weights not packed by :func:`pack_weights` (the split weights have
                the same size in another layout), or a tensor of the wrong shape, dtype,
                device or alignment.
        """
        if not isinstance(weights, Packed):
            raise KernelError(f"{self.what}: the weights must come from "
                              "fp16x3_wgmma.pack_weights (wgmma's tile layout), not split_weights")
        super().apply(x, weights, out)


def mm_grouped_fp16x3_wgmma(spec: GroupedSpec, x: Tensor, packed: Packed, out: Tensor) -> None:
    """:func:`.fp16x3.mm_grouped_fp16x3` on Hopper's wgmma, the weights ``packed`` by
    :func:`pack_weights`."""
    kernel = registry.cached(("irreps_linear", "fp16x3_wgmma", spec, x.device),
                             lambda: CudaFp16x3Wgmma(spec, x.device))
    kernel.apply(x, packed, out)
