"""Every module of a model is accounted for (mace_accel.coverage): small models of each family of
the released architectures (MACE-MP-0's Residual blocks, MPA-0's Density blocks with the
Agnesi transform and ZBL, MH-1's non-linear blocks with heads, edge irreps and the agnostic
product), accelerated on the reference backend, matching the unpatched model, each module
fused, inside a fused one, in the lean head, a container, or listed as run as mace built it."""

from __future__ import annotations

import pytest
import torch

import mace_accel
from mace_accel.coverage import CONTAINER, FUSED, INSIDE, LEAN, MACE, account
from mace_accel.models.architectures import ARCHITECTURES, NON_LINEAR, Architecture, build_model

F64 = torch.float64

SMALL = {
    "residual": Architecture("8x0e+8x1o", 4.0, (1, 6, 8, 29), max_ell=2, correlation=2,
                             num_bessel=4, radial_mlp=(16, 16), mlp_irreps="4x0e",
                             avg_num_neighbors=8.0),
    "density": Architecture("8x0e+8x1o", 4.0, (1, 6, 8, 29), max_ell=2, correlation=2,
                            num_bessel=4, radial_mlp=(16, 16), mlp_irreps="4x0e",
                            avg_num_neighbors=8.0,
                            interaction="RealAgnosticDensityResidualInteractionBlock",
                            interaction_first="RealAgnosticDensityInteractionBlock",
                            distance_transform="Agnesi", pair_repulsion=True),
    "non-linear": Architecture("16x0e+16x1o", 4.0, (1, 6, 8, 29), max_ell=2, correlation=2,
                               num_bessel=4, radial_mlp=(16, 16), mlp_irreps="4x0e",
                               avg_num_neighbors=8.0, interaction=NON_LINEAR,
                               interaction_first=NON_LINEAR, heads=("a", "b"),
                               distance_transform="Agnesi", pair_repulsion=True,
                               apply_cutoff=False, edge_irreps="8x0e+8x1o",
                               use_edge_irreps_first=True, use_agnostic_product=True),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_every_module_is_accounted_for_and_the_report_lists_the_unfused(name):
    model = build_model(SMALL[name], dtype=F64)
    report = mace_accel.accelerate(model, backend="reference")
    assert max(report.verification.values()) <= report.tolerance
    statuses = account(model)
    assert [s.path for s in statuses] == [p for p, _ in model.named_modules()]
    assert {s.status for s in statuses} <= {FUSED, INSIDE, LEAN, CONTAINER, MACE}
    listed = {m.path for m in report.mace_built}
    for s in statuses:
        if s.status == MACE:  # listed, or inside a module that is
            assert s.why and (s.path in listed or any(s.path.startswith(p + ".")
                                                      for p in listed)), s
    text = str(report)
    assert "runs as mace built it" in text or not listed
    blocks = [s for s in statuses if s.block.endswith("InteractionBlock")]
    assert blocks and all(s.status in (FUSED, CONTAINER) for s in blocks), blocks
    zbl = [s for s in statuses if s.path == "pair_repulsion_fn"]
    assert all(s.status == FUSED for s in zbl)


def test_reverted_model_runs_entirely_as_mace_built_it():
    model = build_model(SMALL["density"], dtype=F64)
    mace_accel.accelerate(model, backend="reference")
    mace_accel.revert(model)
    statuses = account(model)
    assert not [s for s in statuses if s.status in (FUSED, INSIDE, LEAN)]
    assert any(s.path == "" and s.status == MACE for s in statuses)


def test_the_architecture_table_names_the_released_models():
    for name in ("mp0-medium", "mpa0-medium", "omat0-small", "mh1", "off23-small",
                 "off23-medium", "off23-large", "off24-medium", "omol-xl",
                 "mp-medium", "off-large"):  # the earlier names stay
        assert name in ARCHITECTURES
    mh1 = ARCHITECTURES["mh1"]
    assert mh1.transformed and mh1.pair_repulsion and not mh1.apply_cutoff
    assert len(mh1.heads) == 6 and mh1.edge_irreps == "128x0e+128x1o"
    assert ARCHITECTURES["off23-large"].hidden_irreps.startswith("224x0e")
