"""The SiLU MLPs every test and the CI compile cover: MACE's radial MLPs (hidden part of
``[8, 64, 64, 64, W]``, MACE-OFF's and small models' widths), odd widths that need padding, a
deeper net, one layer."""

from __future__ import annotations

from typing import Dict

from mace_accel.ops.radial.silu_mlp.spec import SiluMLPSpec

CATALOG: Dict[str, SiluMLPSpec] = {
    "mace": SiluMLPSpec((8, 64, 64, 64)),
    "small": SiluMLPSpec((8, 16, 16, 16)),
    "odd": SiluMLPSpec((10, 23, 17)),
    "deep": SiluMLPSpec((6, 32, 32, 32, 32)),
    "one_layer": SiluMLPSpec((5, 7)),
}
