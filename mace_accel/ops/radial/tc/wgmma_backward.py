"""The radial MLP's input gradient on Hopper's ``wgmma`` (sm_90a), the backward of the
:mod:`.wgmma` forward: the launch plan, the weights' layout and the CUDA source
(``kernels/radial_tc/wgmma_backward.cu.j2``).

``d x = ((g W_L^T * silu'(z_{L-1})) W_{L-1}^T * ... * silu'(z_0)) W_0^T`` for ``g [E, n_out]``
(the gradient of the per-edge TP weights) and the forward's pre-activations ``z``: all that
forces and stress need. One kernel instead of one 3xTF32 GEMM per layer, and nothing but ``d x``
is written: ``g W_L^T`` (``[E, 64]``) and the hidden layers' gradients stay in registers.

* A warpgroup takes 64 edges through every layer. ``A`` comes from registers (wgmma's
  register-sourced form): the last layer's from ``g``, copied into shared memory (``cp.async``,
  ``stages`` chunks deep) and read as a float4 per row and group of 16 columns, split into TF32
  parts in registers; each hidden layer's from the accumulator of the layer above, scaled by
  ``silu'(z)``, with no memory round trip.
* ``B`` (the weights) comes from shared memory: the last layer's streamed in chunks of
  :data:`CK` of its ``n_out`` rows, ``stages`` deep, shared by the block's warpgroups; the
  hidden layers' copied into the same region after the last layer, for every tile of edges.
  All are split into TF32 big/small parts on the host, in the canonical K-major layout
  (:mod:`.wgmma`), with ``K`` permuted to the order in which the registers hold ``A``
  (:func:`chunk_order`, :func:`step_order`).
* K is summed in slices of 32 on the tensor cores, the slices added in float32 (the forward's
  accuracy); blocks stride over the tiles of edges (``sm_share``).
* The pre-activations each ``silu'`` reads are loaded while the GEMM before it runs (their
  load latency was the largest stall in Nsight Compute's samples).

About two thirds of the time of the 3xTF32 layer kernels it replaces, on small and large graphs
and both of MACE-MP's output widths (``scripts/bench_kernels.py radial-tc --backward``, its
10-64-64-64 nets). Still latency-bound (Nsight Compute, two warpgroups a block: on small graphs
most cycles have no eligible warp). Tried and slower: ``g`` read straight into registers one pair
of chunks ahead (no shared memory for it; only two stages of weights then fit the registers
left); two warpgroups sharing each chunk of weights (one block per SM); the hidden layers'
weights kept in shared memory for the whole launch (fewer stages, one block per SM).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch

from mace_accel.ops.limits import OPTIN_SHARED, RESERVED_SHARED, SM_REGISTERS, SM_SHARED
from mace_accel.ops.radial.tc import wgmma
from mace_accel.ops.radial.tc.spec import RadialSpec
from mace_accel.ops.radial.silu_mlp.spec import check_layer_weights, zero_padded
from mace_accel.ops.templates import render
from mace_accel.ops.wgmma_asm import wgmma_function

CK = 32  # last-layer rows per chunk: one K slice of 4 k8 steps
G_PAD = 4  # floats of padding per row of g in shared memory (spreads a warp's reads over banks)
# the default: one warpgroup, two pairs of chunks in flight, two blocks per SM (102 KB of shared
# memory and 250 registers each with MACE-MP's nets): independent blocks beat two warpgroups
# sharing each chunk of weights, and deeper stages (six, eight) gained nothing
# (scripts/bench_kernels.py radial-tc --backward)
WG, STAGES = 1, 4
DEFAULT_VARIANT = (WG, STAGES)
# (wg, stages) besides the default that the GPU tests run (and CI compiles)
TESTED_VARIANTS = ((1, 2), (2, 4))
FLOAT = 4


def chunk_order(width: int) -> List[int]:
    """The column of ``g`` behind each K index of a chunk's wgmma steps (``width`` a multiple of
    16): a thread reads columns ``4t .. 4t + 3`` of each group of 16 as one float4; k8 step
    ``2q + u`` takes ``4t + 2u`` as its column ``t`` and ``4t + 2u + 1`` as ``t + 4``."""
    out = []
    for k in range(width):
        q, u, c = k // 16, (k % 16) // 8, k % 8
        out.append(16 * q + 4 * (c % 4) + 2 * u + (c >= 4))
    return out


def step_order(width: int) -> List[int]:
    """The accumulator column behind each K index of a hidden layer's wgmma steps (``width`` a
    multiple of 8): a thread holds columns ``8j + 2t`` and ``8j + 2t + 1``, k8 step ``j``'s
    columns ``t`` and ``t + 4``."""
    return [8 * (k // 8) + 2 * (k % 4) + ((k % 8) >= 4) for k in range(width)]


@dataclasses.dataclass(frozen=True)
class BackwardPlan(wgmma.WarpgroupBlocks):
    """Offsets in floats. ``layers``: per GEMM after the last layer's, top down, a dict ``what``,
    ``n``, ``k`` (padded output and input widths), ``big``, ``small`` (its split weight in the
    packed buffer, which the kernel copies as is into shared memory), ``z`` (the hidden layer
    whose ``silu'`` scales its output; None for ``d x``) and ``z_width``; the last layer's
    output (``kh`` wide) is scaled by ``silu'(z[last_z])`` (``last_width`` wide). The last
    layer's chunks start at ``hidden_floats``, each ``stage_floats`` long (big then small)."""

    spec_key: str
    arch: str
    wg: int
    stages: int
    h0: int
    kh: int
    n_out: int
    ck: int
    n_chunks: int
    last_z: int
    last_width: int
    layers: tuple
    zw: int
    hidden_floats: int
    stage_floats: int
    g_ld: int

    @property
    def packed_numel(self) -> int:
        return self.hidden_floats + self.n_chunks * self.stage_floats

    @property
    def shared_bytes(self) -> int:
        """The chunks' stages and the warpgroups' rows of ``g``, the same region later holding
        the hidden layers' weights."""
        g_floats = self.wg * self.stages * wgmma.ROWS * self.g_ld
        return max(self.hidden_floats, self.stages * self.stage_floats + g_floats) * FLOAT

    @property
    def min_blocks(self) -> int:
        """Blocks per SM the launch bounds ask for: two where shared memory and ~200 registers a
        thread allow (one warpgroup), else one."""
        by_registers = SM_REGISTERS // (self.threads * 256)
        return max(1, min(2, by_registers, SM_SHARED // (self.shared_bytes + RESERVED_SHARED)))

    @property
    def n_sizes(self) -> Tuple[int, ...]:
        """The ``N`` of every wgmma shape the kernel issues."""
        return tuple(sorted({layer["n"] for layer in self.layers} | {self.kh}))

    def grid(self, m: int, max_blocks: Optional[int] = None) -> int:
        return self.row_blocks(m, max_blocks)


def plan_backward(spec: RadialSpec, wg: int = WG, stages: int = STAGES) -> BackwardPlan:
    """The plan of ``spec``'s backward kernel: ``wg`` warpgroups per block, ``stages`` chunks of
    the last layer (its weights, and each warpgroup's rows of ``g``) in shared memory, a pair in
    use and the rest loading.

    Raises:
        ValueError: bad knobs, or the layout does not fit the opt-in shared memory of a block.
    """
    if wg < 1 or stages < 2 or stages % 2:
        raise ValueError(f"wgmma radial backward: wg {wg} (>= 1), stages {stages} (even, >= 2)")
    w = spec.widths
    p = [wgmma.padded(v) for v in w[:-1]]
    n_hidden = len(w) - 2
    layers, at = [], 0
    for i in range(n_hidden - 1, -1, -1):  # W_i^T: [64, p_{i+1}] -> [64, p_i]
        n, k = p[i], p[i + 1]
        layers.append(dict(what=f"layer {i}" + (" (d x)" if i == 0 else ""), n=n, k=k, big=at,
                           small=at + n * k, z=i - 1 if i else None,
                           z_width=w[i] if i else None))
        at += 2 * n * k
    kh, n_out = p[-1], w[-1]
    stage = 2 * kh * CK
    n_chunks = 2 * -(-n_out // (2 * CK))  # pairs of chunks
    plan = BackwardPlan(spec.key(), wgmma.ARCH, wg, stages, w[0], kh, n_out, CK, n_chunks,
                        n_hidden - 1, w[-2], tuple(layers), spec.hidden_width, at, stage,
                        CK + G_PAD)
    if plan.shared_bytes > OPTIN_SHARED:
        raise ValueError(f"{spec.describe()}: the wgmma backward needs {plan.shared_bytes} "
                         f"bytes of shared memory, over the {OPTIN_SHARED} a block can "
                         "have")
    return plan


def kernel_name(plan: BackwardPlan) -> str:
    return f"mace_radial_wgmma_bwd_{plan.spec_key}_w{plan.wg}s{plan.stages}"


def render_backward(plan: BackwardPlan) -> str:
    return render("radial_tc/wgmma_backward.cu.j2", plan=plan, name=kernel_name(plan),
                  wgmma_functions="\n".join(
                      wgmma_function(f"wgmma_rs_n{n}", n, "k8.f32.tf32.tf32", True, "1, 1")
                      for n in plan.n_sizes))


def _split_canonical(m: torch.Tensor) -> List[torch.Tensor]:
    big, small = wgmma.split_tf32(m.contiguous())
    return [wgmma.canonical(big), wgmma.canonical(small)]


def pack_backward(plan: BackwardPlan, spec: RadialSpec, weights: Sequence[torch.Tensor]
                  ) -> torch.Tensor:
    """The flat float32 buffer of the layers' ``[w_i, w_{i+1}]`` folded weights for the
    backward: per GEMM of ``plan.layers`` its weight ``W_i`` ``[p_i, p_{i+1}]`` zero-padded,
    columns in :func:`step_order`, split and canonical (big, then small); then per chunk of
    :data:`CK` of the last layer's output columns ``W_L [kh, CK]`` the same way, columns in
    :func:`chunk_order`.

    Raises:
        UnsupportedModelError: the weights do not have the spec's shapes.
    """
    check_layer_weights(spec.describe(), spec.widths, weights)
    parts: List[torch.Tensor] = []
    n_hidden = len(spec.widths) - 2
    for layer, i in zip(plan.layers, range(n_hidden - 1, -1, -1)):
        m = zero_padded(weights[i].float(), layer["n"], layer["k"])
        parts += _split_canonical(m[:, step_order(layer["k"])])
    last = zero_padded(weights[-1].float(), plan.kh, plan.n_chunks * CK)
    order = torch.tensor(chunk_order(CK), device=last.device)
    for c in range(plan.n_chunks):
        parts += _split_canonical(last[:, c * CK:(c + 1) * CK][:, order])
    out = torch.cat(parts).contiguous()
    assert out.numel() == plan.packed_numel
    return out
