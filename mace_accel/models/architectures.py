"""MACE models with random weights: the foundation-model architectures, and small test models.

Weights are random (seeded), architectures are those of the released models, so speed and
kernel coverage match the real thing without downloading anything. Models are built in torch's
current default dtype and then cast, so the global default dtype is never changed.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from mace_accel.errors import ConfigError

# 89 elements of MACE-MP-0 (H..Pu without the noble-gas gaps of MPtrj's table are all included)
MP_ELEMENTS = tuple(list(range(1, 84)) + list(range(89, 95)))
OFF_ELEMENTS = (1, 6, 7, 8, 9, 15, 16, 17, 35, 53)


@dataclasses.dataclass(frozen=True)
class Architecture:
    """Hyper-parameters of one MACE architecture (what ``mace_run_train`` would be given).

    Attributes beyond mace's names: ``interaction`` / ``interaction_first`` are mace's
    interaction-block class names; ``edge_irreps`` the irreps the non-linear blocks convolve
    (None: the hidden irreps); ``embedding_specs`` mace's joint embedding of per-structure
    features (OMOL's total charge and spin).
    """

    hidden_irreps: str
    r_max: float
    elements: Sequence[int]
    max_ell: int = 3
    correlation: int = 3
    num_interactions: int = 2
    num_bessel: int = 10
    num_polynomial_cutoff: int = 5
    radial_mlp: Sequence[int] = (64, 64, 64)
    mlp_irreps: str = "16x0e"
    interaction: str = "RealAgnosticResidualInteractionBlock"
    interaction_first: str = "RealAgnosticResidualInteractionBlock"
    avg_num_neighbors: float = 60.0
    heads: Sequence[str] = ("Default",)
    distance_transform: str = "None"
    pair_repulsion: bool = False
    apply_cutoff: bool = True
    edge_irreps: Optional[str] = None
    use_edge_irreps_first: bool = False
    use_agnostic_product: bool = False
    embedding_specs: Optional[Tuple[Tuple[str, Tuple[Tuple[str, object], ...]], ...]] = None

    @property
    def transformed(self) -> bool:
        """Whether the radial basis sees a distance transform of the length (Agnesi, Soft)."""
        return self.distance_transform not in ("None", None)


def _density(hidden: str, **more) -> Architecture:
    """The Density-block materials models (MPA-0, MP-0b3, OMAT-0, MATPES, MH-0)."""
    return Architecture(hidden, 6.0, MP_ELEMENTS,
                        interaction="RealAgnosticDensityResidualInteractionBlock",
                        interaction_first="RealAgnosticDensityInteractionBlock",
                        distance_transform="Agnesi", pair_repulsion=True, **more)


def _off(hidden: str, r_max: float = 5.0, **more) -> Architecture:
    """The MACE-OFF organic force fields (10 elements, 8 Bessel functions)."""
    return Architecture(hidden, r_max, OFF_ELEMENTS, num_bessel=8, avg_num_neighbors=25.0,
                        interaction_first="RealAgnosticInteractionBlock", **more)


NON_LINEAR = "RealAgnosticResidualNonLinearInteractionBlock"
MH1_HEADS = ("matpes_r2scan", "mp_pbe_refit_add", "spice_wB97M", "oc20_usemppbe", "omol",
             "omat_pbe")
# OMOL's per-structure features (mace's GenericJointEmbedding): total spin 2S+1 and charge
OMOL_EMBEDDINGS = (
    ("total_spin", (("type", "categorical"), ("num_classes", 101), ("emb_dim", 64),
                    ("per", "graph"))),
    ("total_charge", (("type", "categorical"), ("num_classes", 201), ("emb_dim", 64),
                      ("per", "graph"), ("offset", 100))),
)

# the architectures of the released foundation models (random weights, exact shapes); the
# names of the first six are kept from earlier releases (``mp-medium`` is ``mp0-medium``)
ARCHITECTURES = {
    "mp-small": Architecture("128x0e", 6.0, MP_ELEMENTS),
    "mp-medium": Architecture("128x0e+128x1o", 6.0, MP_ELEMENTS),
    "mp-large": Architecture("128x0e+128x1o+128x2e", 6.0, MP_ELEMENTS),
    "off-small": Architecture("96x0e", 5.0, OFF_ELEMENTS, avg_num_neighbors=25.0,
                              interaction_first="RealAgnosticInteractionBlock"),
    "off-medium": Architecture("128x0e+128x1o", 5.0, OFF_ELEMENTS, avg_num_neighbors=25.0,
                               interaction_first="RealAgnosticInteractionBlock"),
    "off-large": Architecture("192x0e+192x1o+192x2e", 5.0, OFF_ELEMENTS, avg_num_neighbors=25.0,
                              interaction_first="RealAgnosticInteractionBlock"),
    "mp0-medium": Architecture("128x0e+128x1o", 6.0, MP_ELEMENTS),
    "mpa0-medium": _density("128x0e+128x1o"),
    "omat0-small": _density("128x0e"),
    "mh1": Architecture("512x0e+512x1o", 6.0, MP_ELEMENTS, interaction=NON_LINEAR,
                        interaction_first=NON_LINEAR, heads=MH1_HEADS,
                        distance_transform="Agnesi", pair_repulsion=True, apply_cutoff=False,
                        edge_irreps="128x0e+128x1o", use_edge_irreps_first=True,
                        use_agnostic_product=True),
    "off23-small": _off("96x0e"),
    "off23-medium": _off("128x0e+128x1o"),
    "off23-large": _off("224x0e+224x1o+224x2e"),
    "off24-medium": _off("128x0e+128x1o", r_max=6.0),
    "omol-xl": Architecture("1024x0e+1024x1o+1024x2e", 6.0, tuple(range(1, 84)), num_bessel=8,
                            correlation=2, num_interactions=3, interaction=NON_LINEAR,
                            interaction_first=NON_LINEAR, apply_cutoff=False,
                            edge_irreps="128x0e+128x1o+128x2e", use_edge_irreps_first=True,
                            use_agnostic_product=True, embedding_specs=OMOL_EMBEDDINGS),
}


def build_model(arch: Architecture, dtype: torch.dtype = torch.float64, seed: int = 0,
                device: str | torch.device = "cpu", scale_shift: bool = True) -> torch.nn.Module:
    """A ``ScaleShiftMACE`` (or plain ``MACE``) of ``arch`` with random weights.

    Random weights are scaled up from MACE's near-identity initialisation so every path
    (including the radial MLP and the higher-L channels) carries signal in tests.
    """
    from mace_accel._e3nn_compat import import_mace, o3

    import_mace()
    from mace import modules

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    n_el = len(arch.elements)
    kwargs = dict(
        r_max=float(arch.r_max), num_bessel=arch.num_bessel,
        num_polynomial_cutoff=arch.num_polynomial_cutoff, max_ell=arch.max_ell,
        interaction_cls=modules.interaction_classes[arch.interaction],
        interaction_cls_first=modules.interaction_classes[arch.interaction_first],
        num_interactions=arch.num_interactions, num_elements=n_el,
        hidden_irreps=o3().Irreps(arch.hidden_irreps), MLP_irreps=o3().Irreps(arch.mlp_irreps),
        atomic_energies=rng.normal(-2.0, 0.5, size=(len(arch.heads), n_el)) if len(arch.heads) > 1
        else rng.normal(-2.0, 0.5, size=n_el),
        avg_num_neighbors=arch.avg_num_neighbors, atomic_numbers=list(arch.elements),
        correlation=arch.correlation, gate=torch.nn.functional.silu,
        radial_MLP=list(arch.radial_mlp), heads=list(arch.heads),
    )
    if arch.transformed:
        kwargs["distance_transform"] = arch.distance_transform
    if arch.pair_repulsion:
        kwargs["pair_repulsion"] = True
    if not arch.apply_cutoff:
        kwargs["apply_cutoff"] = False
    if arch.edge_irreps is not None:
        kwargs["edge_irreps"] = o3().Irreps(arch.edge_irreps)
        kwargs["use_edge_irreps_first"] = arch.use_edge_irreps_first
    if arch.use_agnostic_product:
        kwargs["use_agnostic_product"] = True
    if arch.embedding_specs is not None:
        kwargs["embedding_specs"] = {name: dict(spec) for name, spec in arch.embedding_specs}
    if scale_shift:
        n_heads = len(arch.heads)
        scale, shift = ([1.0] * n_heads, [0.0] * n_heads) if n_heads > 1 else (1.0, 0.0)
        model = modules.ScaleShiftMACE(atomic_inter_scale=scale, atomic_inter_shift=shift,
                                       **kwargs)
    else:
        model = modules.MACE(**kwargs)
    return model.to(device=device, dtype=dtype).eval()


def build_architecture(name: str, dtype: torch.dtype = torch.float64, seed: int = 0,
                       device: str | torch.device = "cpu") -> torch.nn.Module:
    """One of :data:`ARCHITECTURES` by name (``mpa0-medium``, ``mh1``, ``off23-medium``, ...)."""
    if name not in ARCHITECTURES:
        raise ConfigError(f"unknown architecture {name!r}; choose one of {sorted(ARCHITECTURES)}")
    return build_model(ARCHITECTURES[name], dtype=dtype, seed=seed, device=device)


def small_test_model(interaction: str, hidden_irreps: str = "8x0e+8x1o",
                     heads: Sequence[str] = ("Default",), dtype: torch.dtype = torch.float64,
                     elements: Sequence[int] = (1, 6, 8, 29), max_ell: int = 2,
                     correlation: int = 2, seed: int = 0,
                     interaction_first: Optional[str] = None) -> torch.nn.Module:
    """A tiny model of one interaction-block class, for CPU tests."""
    arch = Architecture(hidden_irreps=hidden_irreps, r_max=4.0, elements=tuple(elements),
                        max_ell=max_ell, correlation=correlation, num_bessel=4,
                        radial_mlp=(16, 16), mlp_irreps="4x0e", interaction=interaction,
                        interaction_first=interaction_first or interaction,
                        avg_num_neighbors=8.0, heads=tuple(heads))
    return build_model(arch, dtype=dtype, seed=seed)
