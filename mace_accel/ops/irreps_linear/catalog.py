"""The linear maps every test and the CI compile cover: MACE-MP-like shapes (message linear with
two inputs into the scalars, the 89-element skip, the readouts and the node embedding), odd
multiplicities, an output block without inputs, more channels than threads, input blocks staged
in chunks; each with its transpose (the backward), float32 and float64. And the grouped maps of
:data:`~.grouped.GROUPED_CATALOG` on the 3xFP16 kernels (``mma.sync``, and ``wgmma`` for
sm_90)."""

from __future__ import annotations

from typing import Dict, Iterator, Tuple

from mace_accel.ops.irreps_linear import codegen, fp16x3, fp16x3_wgmma
from mace_accel.ops.irreps_linear.grouped import GROUPED_CATALOG
from mace_accel.ops.irreps_linear.spec import Block, LinearInstruction, LinearSpec
from mace_accel.ops.limits import DeviceLimits

CATALOG: Dict[str, LinearSpec] = {
    "message": LinearSpec((Block(0, 128, 1), Block(128, 128, 3), Block(512, 128, 1),
                           Block(640, 128, 5), Block(1280, 128, 7)),
                          (Block(0, 128, 1), Block(128, 128, 3), Block(512, 128, 5),
                           Block(1152, 128, 7)),
                          (LinearInstruction(0, 0, 0), LinearInstruction(1, 1, 16384),
                           LinearInstruction(2, 0, 32768), LinearInstruction(3, 2, 49152),
                           LinearInstruction(4, 3, 65536))),
    "odd": LinearSpec((Block(0, 7, 1), Block(7, 200, 3)),
                      (Block(0, 5, 1), Block(5, 3, 7), Block(26, 150, 3)),
                      (LinearInstruction(0, 0, 0), LinearInstruction(1, 2, 35))),
    "skip89": LinearSpec((Block(0, 128, 1), Block(128, 128, 3)),
                         (Block(0, 128, 1), Block(128, 128, 3)),
                         (LinearInstruction(0, 0, 0), LinearInstruction(1, 1, 89 * 128 * 128)),
                         89),
    # the readouts and the node embedding: one output channel (an energy per node), the
    # non-linear readout's 16 gate channels, the one-hot elements in
    "readout": LinearSpec((Block(0, 128, 1), Block(128, 128, 3)), (Block(0, 1, 1),),
                          (LinearInstruction(0, 0, 0),)),
    "gate_in": LinearSpec((Block(0, 128, 1),), (Block(0, 16, 1),), (LinearInstruction(0, 0, 0),)),
    "gate_out": LinearSpec((Block(0, 16, 1),), (Block(0, 1, 1),), (LinearInstruction(0, 0, 0),)),
    "embedding": LinearSpec((Block(0, 89, 1),), (Block(0, 128, 1),),
                            (LinearInstruction(0, 0, 0),)),
    # input blocks wider than one staged tile: the sum runs over chunks of input channels
    "wide": LinearSpec((Block(0, 384, 5), Block(1920, 40, 1)),
                       (Block(0, 96, 5), Block(480, 33, 1)),
                       (LinearInstruction(0, 0, 0), LinearInstruction(1, 1, 384 * 96))),
}


def catalog_sources(limits: DeviceLimits) -> Iterator[Tuple[str, str]]:
    """``(name, source)`` of every catalog map and its transpose, float32 and float64, and of
    every grouped map on the 3xFP16 kernels (``mma.sync``, and ``wgmma`` for sm_90)."""
    for name, spec in sorted(CATALOG.items()):
        for label, s in (("", spec), ("_t", spec.transposed())):
            for dtype in ("float32", "float64"):
                plan = codegen.plan_kernel(s, dtype, limits.arch)
                yield f"irreps_linear/{name}{label}_{dtype}", codegen.render_kernel(plan)
    for name, grouped in sorted(GROUPED_CATALOG.items()):
        yield (f"irreps_linear/{name}_fp16x3",
               fp16x3.render_kernel(fp16x3.plan_fp16x3(grouped, limits.arch)))
        if limits.arch == fp16x3_wgmma.DEVICE_ARCH:
            yield (f"irreps_linear/{name}_fp16x3_wgmma",
                   fp16x3_wgmma.render_kernel(fp16x3_wgmma.plan_wgmma(grouped)))
