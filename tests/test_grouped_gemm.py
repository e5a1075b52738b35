"""The grouped GEMMs of the equivariant linear maps on the CPU: grouped specs and what they
refuse, the 3xFP16 kernels' plans and sources (``mma.sync`` and Hopper's ``wgmma``), the
weights' split and wgmma packing, the checks before launch; and which blocks
:mod:`mace_accel.ops.irreps_linear.gemm` groups into one launch and which float32 maps take the
GEMM path."""

from __future__ import annotations

import pytest
import torch

from mace_accel.ops.irreps_linear.grouped import GROUPED_CATALOG, E3nnBlock, GroupedSpec


def test_grouped_specs_refuse_blocks_the_kernels_cannot_read():
    """A grouped map's blocks must fit the rows, scalars start on 16-byte (x) and 8-byte (out)
    bounds, weights on 16-byte bounds."""
    spec = GROUPED_CATALOG["e3nn_grouped_ragged"]
    assert spec.weight_numel == 524288 + 32 * 64 and spec.key() != GROUPED_CATALOG[
        "e3nn_grouped"].key()
    with pytest.raises(ValueError, match="do not fit"):
        GroupedSpec((E3nnBlock(3, 512, 512, 512, 512, 0),), 1024, 2048)
    with pytest.raises(ValueError, match="aligned"):
        GroupedSpec((E3nnBlock(1, 512, 512, 2, 0, 0),), 1024, 2048)
    with pytest.raises(ValueError, match="aligned"):
        GroupedSpec((E3nnBlock(1, 512, 512, 0, 3, 0),), 1024, 2048)
    with pytest.raises(ValueError, match="weights at float 2"):
        GroupedSpec((E3nnBlock(1, 512, 512, 0, 0, 2),), 1024, 2048)
    with pytest.raises(ValueError, match="at least one"):
        GroupedSpec((), 4, 4)


def test_fp16x3_plan_source_and_refusals():
    """The grouped 3xFP16 kernel: its tiles (64 x 128, eight warps), every block's tile
    function in the source, its grid, and specs it cannot take refused."""
    from mace_accel.ops.irreps_linear import fp16x3

    spec = GROUPED_CATALOG["e3nn_grouped_ragged"]
    plan = fp16x3.plan_fp16x3(spec)
    assert (plan.bm, plan.bn, plan.threads, plan.mi, plan.ni) == (64, 128, 256, 2, 4)
    assert plan.grid(100) == (2 * 4 + 5 * 4 + 8 * 1, 1)  # ceil(100 d / 64) x ceil(n / 128)
    assert plan.shared_bytes == 8 * (64 + 128) * 40 + 2 * 4 * 8  # stages, scales
    src = fp16x3.render_kernel(plan)
    assert fp16x3.kernel_name(plan) in src and "m16n8k16" in src
    for i, b in enumerate(spec.blocks):
        assert (f"tile<{b.k}, {b.n}, {b.d}>(X + {b.x_col}, WHI + {b.w_offset},\n"
                f"          WLO + {b.w_offset}, WINV[{i}]") in src
    odd = GroupedSpec((E3nnBlock(3, 48, 64, 0, 0, 0),), 144, 192)
    assert "multiple of 32" in fp16x3.misfit(odd)
    with pytest.raises(ValueError, match="multiple of 32"):
        fp16x3.plan_fp16x3(odd)


def test_fp16x3_wgmma_plan_source_and_refusals():
    """The grouped 3xFP16 wgmma kernel: one warpgroup of 64 x 128 outputs a block, its grid
    (a block's column tiles padded to whole tiles of 128), shared memory (four stages of the
    weights' hi and lo slices), every block's tile function at its packed weights' offset,
    sm_90a's wgmma in the source, and specs it cannot take refused."""
    from mace_accel.ops.irreps_linear import fp16x3_wgmma as wg

    spec = GROUPED_CATALOG["e3nn_grouped_ragged"]  # n = 512, 512, 32
    plan = wg.plan_wgmma(spec)
    assert (plan.bm, plan.bn, plan.threads, plan.bk, plan.arch) == (64, 128, 128, 32, "sm_90a")
    assert plan.packed_offsets == (0, 512 * 512, 2 * 512 * 512)
    assert plan.packed_numel == 2 * 512 * 512 + 128 * 64  # the 32 columns padded to 128
    assert plan.grid(100) == (5 * 4 + 2 * 4 + 8 * 1, 1)  # ceil(100 d / 64) x ceil(n / 128)
    assert plan.shared_bytes == 4 * 2 * 128 * 32 * 2
    src = wg.render_kernel(plan)
    assert wg.kernel_name(plan) in src and "wgmma.mma_async.sync.aligned.m64n128k16" in src
    for i, (b, at) in enumerate(zip(spec.blocks, plan.packed_offsets)):
        assert f"tile<{b.k}, {b.n}, {b.d}>(X + {b.x_col}, WHI + {at}," in src
    odd = GroupedSpec((E3nnBlock(3, 48, 64, 0, 0, 0),), 144, 192)
    with pytest.raises(ValueError, match="multiple of 32"):
        wg.plan_wgmma(odd)
    assert not wg.runs_on(odd, torch.device("cpu"))
    assert not wg.runs_on(spec, torch.device("cpu"))


def test_fp16x3_wgmma_packing_is_canonical_tiles_of_the_split():
    """The packed weights are the split weights, each block zero-padded to whole tiles of
    128 rows and laid out per (column tile, K slice) in wgmma's canonical K-major layout:
    element (r, c) of a [128, bk] slice at ((r / 8) (bk / 8) + c / 8) 64 + (r % 8) 8 + c % 8;
    the inverse scales pass through."""
    from mace_accel.ops.irreps_linear import fp16x3, fp16x3_wgmma as wg

    spec = GROUPED_CATALOG["e3nn_grouped_ragged"]
    w = torch.randn(spec.weight_numel, generator=torch.Generator().manual_seed(5))
    split = fp16x3.split_weights(spec, w)
    plan = wg.plan_wgmma(spec)
    bk = plan.bk
    packed = wg.pack_weights(plan, split)
    assert isinstance(packed, wg.Packed) and packed.inv is split[2]
    for part, whole in ((packed.hi, split[0]), (packed.lo, split[1])):
        assert part.dtype == torch.float16 and part.shape == (plan.packed_numel,)
        for b, at in zip(spec.blocks, plan.packed_offsets):
            m = whole[b.w_offset:b.w_offset + b.n * b.k].view(b.n, b.k)
            kt = b.k // bk
            for r, c in ((0, 0), (b.n - 1, b.k - 1), (b.n // 3, b.k // 2 + 3), (9, 17)):
                tile, row = divmod(r, 128)
                sl, col = divmod(c, bk)
                i = at + (tile * kt + sl) * 128 * bk + ((row // 8) * (bk // 8) + col // 8) \
                    * 64 + (row % 8) * 8 + col % 8
                assert part[i] == m[r, c]
            if b.n % 128:  # the last tile holds the remaining rows and zeros
                pad = at + (b.n // 128) * kt * 128 * bk
                assert part[pad:pad + 128 * b.k].double().abs().sum() == \
                    m[b.n // 128 * 128:].double().abs().sum()


def test_fp16x3_kernels_check_their_inputs_before_launch():
    """Both grouped 3xFP16 kernels refuse wrong shapes and dtypes (of the input, the weights'
    parts and their inverse scales) before any launch, the wgmma one also weights not packed
    for it (the split weights have the same size in another layout); no rows is no launch."""
    from mace_accel.errors import KernelError
    from mace_accel.ops.irreps_linear import fp16x3, fp16x3_wgmma as wg

    spec = GROUPED_CATALOG["e3nn_grouped"]
    split = fp16x3.split_weights(spec, torch.randn(spec.weight_numel))
    mma = object.__new__(fp16x3.CudaFp16x3)
    mma.plan = fp16x3.plan_fp16x3(spec)
    wgmma = object.__new__(wg.CudaFp16x3Wgmma)
    wgmma.plan = wg.plan_wgmma(spec)
    for kernel, weights in ((mma, split), (wgmma, wg.pack_weights(wgmma.plan, split))):
        kernel.spec, kernel.device, kernel.dtype = spec, torch.device("cpu"), torch.float32
        kernel.what, kernel._kernels = kernel.label, {}
        x, out = torch.zeros(3, spec.lda), torch.zeros(3, spec.ldc)
        with pytest.raises(KernelError, match="shape"):
            kernel.apply(x[:, 4:].contiguous(), weights, out)
        hi, lo, inv = weights
        for bad, match in (((hi.float(), lo, inv), "float16"),
                           ((hi, lo, inv[:1]), "inv: expected shape")):
            with pytest.raises(KernelError, match=match):
                kernel.apply(x, wg.Packed(*bad) if kernel is wgmma else bad, out)
        kernel.apply(x[:0], weights, out[:0])  # nothing to do
        assert not kernel._kernels
    with pytest.raises(KernelError, match="pack_weights"):
        wgmma.apply(x, split, out)


def test_fp16x3_weight_split_keeps_float32_accuracy():
    """Each block's weights come back from their FP16 hi and lo parts and inverse scale to
    2^-22 of the block's largest (a zero block, a tiny one and a huge one included), and
    the scale puts every block's largest in [2^14, 2^15)."""
    from mace_accel.ops.irreps_linear import fp16x3

    blocks = (E3nnBlock(1, 32, 8, 0, 0, 0), E3nnBlock(3, 32, 8, 32, 8, 256),
              E3nnBlock(5, 32, 8, 128, 32, 512), E3nnBlock(7, 32, 8, 288, 72, 768))
    spec = GroupedSpec(blocks, 512, 128)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(spec.weight_numel, generator=gen)
    w[256:512] = 0.0
    w[512:768] *= 1e-30
    w[768:] *= 1e30
    hi, lo, inv = fp16x3.split_weights(spec, w)
    assert hi.dtype == lo.dtype == torch.float16 and inv.shape == (4,)
    back = (hi.double() + lo.double())
    for b, s in zip(blocks, inv.double()):
        part = slice(b.w_offset, b.w_offset + b.n * b.k)
        top = float(w[part].abs().max())
        assert float((back[part] * s - w[part].double()).abs().max()) <= 2.0 ** -22 * top
        if top:
            assert 2.0 ** 14 <= float(back[part].abs().max()) <= 2.0 ** 15
    tops = torch.tensor([0.0, 1e-30, 1.0, 3e4, 1e30])
    scaled = tops * fp16x3.power_of_two_scale(tops)
    assert bool(((scaled >= 2.0 ** 14) & (scaled < 2.0 ** 15))[1:].all()) and scaled[0] == 0


def test_linear_blocks_side_by_side_are_found():
    """The input blocks feeding one output block are one e3nn block when each follows the one
    before (in the weights' order)."""
    from mace_accel.ops.irreps_linear import gemm
    from mace_accel.ops.irreps_linear.spec import Block, LinearInstruction, LinearSpec

    spec = LinearSpec((Block(0, 8, 1), Block(8, 4, 1), Block(12, 4, 3), Block(24, 8, 1)),
                      (Block(0, 8, 1), Block(8, 4, 3)),
                      (LinearInstruction(0, 0, 0), LinearInstruction(1, 0, 64),
                       LinearInstruction(2, 1, 96)))
    assert gemm._side_by_side(spec, [spec.instructions[0], spec.instructions[1]]) == 0
    assert gemm._side_by_side(spec, [spec.instructions[2]]) == 12
    apart = LinearInstruction(3, 0, 0)
    assert gemm._side_by_side(spec, [spec.instructions[0], apart]) is None
    assert gemm._side_by_side(spec, [spec.instructions[1], spec.instructions[0]]) is None


def test_float32_maps_take_the_gemm_path_only_whole_on_the_grouped_kernel():
    """A float32 map runs as GEMMs (from enough nodes and weights) only where every fed output
    block goes in the grouped 3xFP16 launch: inputs side by side, k a multiple of 32; a map
    with blocks apart or k = 100 keeps the generated kernel. float64 maps from 2^18 weights take
    cuBLAS from their node threshold whatever their layout; smaller ones keep the kernel."""
    from mace_accel.ops.irreps_linear import gemm
    from mace_accel.ops.irreps_linear.spec import Block, LinearInstruction, LinearSpec

    def spec(mul_in, apart=False):
        """Two scalar blocks into 256 scalars, one vector block into 256 vectors; ``apart``:
        the vectors between the two scalar blocks."""
        if apart:
            ins = (Block(0, mul_in, 1), Block(mul_in, mul_in, 3), Block(4 * mul_in, mul_in, 1))
            order = (0, 2, 1)
        else:
            ins = (Block(0, mul_in, 1), Block(mul_in, mul_in, 1), Block(2 * mul_in, mul_in, 3))
            order = (0, 1, 2)
        return LinearSpec(ins, (Block(0, 256, 1), Block(256, 256, 3)),
                          (LinearInstruction(order[0], 0, 0),
                           LinearInstruction(order[1], 0, mul_in * 256),
                           LinearInstruction(order[2], 1, 2 * mul_in * 256)))

    n = 1000
    whole, apart, odd = spec(128), spec(128, apart=True), spec(100)
    grouped, members = gemm.grouping(whole)
    assert [b.d for b in grouped.blocks] == [3, 1] and members == [1, 0]
    assert gemm.grouped_in_float32(whole) and gemm.grouped_in_float32(whole.transposed())
    assert not gemm.grouped_in_float32(apart) and gemm.grouping(apart)[1] == [1]
    assert not gemm.grouped_in_float32(odd)  # k = 200 and 100: not multiples of 32
    for s in (whole, apart, odd):
        fits = gemm.grouped_in_float32(s)
        assert gemm.takes(s, torch.float32, n, gemm.MIN_NODES_FLOAT64, fits) == fits
        assert not gemm.takes(s, torch.float32, gemm.MIN_NODES_FLOAT32 - 1,
                              gemm.MIN_NODES_FLOAT64, fits)
        assert not gemm.takes(s, torch.float64, gemm.MIN_NODES_FLOAT64,
                              gemm.MIN_NODES_FLOAT64, fits)  # under 2^18 weights
    wide = spec(512)  # 3.9e5 weights: float64 on cuBLAS from its node threshold
    assert gemm.takes(wide, torch.float64, gemm.MIN_NODES_FLOAT64, gemm.MIN_NODES_FLOAT64, False)
    assert not gemm.takes(wide, torch.float64, gemm.MIN_NODES_FLOAT64 - 1,
                          gemm.MIN_NODES_FLOAT64, False)
    assert whole.weight_numel >= gemm.MIN_WEIGHTS_FLOAT32
