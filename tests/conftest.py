"""Shared fixtures: tiny MACE models, two small structures, and skipping of GPU tests."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model():
    """Factory ``make_tiny_model(interaction=..., hidden_irreps=..., heads=..., dtype=...)``.

    Builds :func:`mace_accel.models.small_test_model` (elements H, C, O, Cu; r_max 4 Å) once per
    set of arguments in the session and returns a deep copy, so tests may patch or cast it.
    The model is built with torch's default dtype set to ``dtype`` (restored right after), as
    mace trains, so its constants (CG/U matrices) are exact in that dtype: a float64 model built
    under a float32 default is only equivariant to ~1e-10.
    """
    from mace_accel.models.architectures import small_test_model

    cache = {}

    def make_tiny_model(interaction: str = "RealAgnosticResidualInteractionBlock",
                        hidden_irreps: str = "8x0e+8x1o", heads=("Default",),
                        dtype: torch.dtype = torch.float64, **kwargs) -> torch.nn.Module:
        key = (interaction, hidden_irreps, tuple(heads), dtype, tuple(sorted(kwargs.items())))
        if key not in cache:
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                cache[key] = small_test_model(interaction, hidden_irreps=hidden_irreps,
                                              heads=tuple(heads), dtype=dtype, **kwargs)
            finally:
                torch.set_default_dtype(previous)
        return copy.deepcopy(cache[key])

    return make_tiny_model


@pytest.fixture
def cu_atoms():
    """8 Cu atoms: fcc (a = 3.6 Å) 2x1x1 cubic supercell, periodic, slightly rattled."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 1, 1))
    atoms.rattle(stdev=0.05, seed=1)
    return atoms


@pytest.fixture
def molecule_atoms():
    """Methanol (H, C, O), not periodic, slightly rattled."""
    from ase.build import molecule

    atoms = molecule("CH3OH")
    atoms.rattle(stdev=0.02, seed=2)
    atoms.positions += np.array([0.1, -0.2, 0.3])
    return atoms


@pytest.fixture(scope="session")
def model_file(tmp_path_factory):
    """A tiny float64 Cu/Ni model (4x0e+4x1o, random weights, seed 5) saved to disk, for runs
    and command-line tests (modules may define their own ``model_file``)."""
    from mace_accel.models.architectures import small_test_model

    model = small_test_model("RealAgnosticResidualInteractionBlock", elements=(28, 29),
                             hidden_irreps="4x0e+4x1o", seed=5)
    path = tmp_path_factory.mktemp("model") / "cuni.model"
    torch.save(model, path)
    return path
