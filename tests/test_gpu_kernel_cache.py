"""The surgery starts compiling what a model's first forces call launches (GPU): on an empty
kernel cache, every kernel the first call compiles was started in the background by
``accelerate`` (:func:`mace_accel.surgery.start_compiles`), the radial tables' lookups
included (their tables are built by the call; their kernels depend on the row width only)."""

from __future__ import annotations

import re

import pytest
import torch
from ase.build import bulk

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", [None, "mpa0-medium"])
def test_the_first_call_finds_its_kernels_started(arch, tmp_path, monkeypatch):
    from mace_accel.calculator import MACEAccelCalculator
    from mace_accel.ops import registry, runtime

    monkeypatch.setenv("MACE_ACCEL_CACHE_DIR", str(tmp_path))
    for table in ("_MEMORY_CACHE", "_PENDING"):
        monkeypatch.setattr(runtime, table, {})
    monkeypatch.setattr(registry, "_CACHE", {})  # no kernels loaded by earlier tests
    sources = {}
    key_of = runtime._cubin_key

    def recording_key(source, arch_, options):
        key = key_of(source, arch_, options)
        sources[key] = source
        return key

    monkeypatch.setattr(runtime, "_cubin_key", recording_key)
    if arch is None:
        calc = MACEAccelCalculator(verify=False, graphs=False)
    else:
        from mace_accel.models.architectures import build_architecture

        calc = MACEAccelCalculator(model=build_architecture(arch, dtype=torch.float32),
                                   verify=False, graphs=False)
    started = set(runtime._PENDING) | set(runtime._MEMORY_CACHE)
    assert started, "the surgery started no compile"
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((3, 3, 3))
    atoms.symbols[::3] = "Ni"
    atoms.calc = calc
    atoms.get_forces()
    compiled = set(runtime._MEMORY_CACHE)

    def name(key):
        found = re.search(r"\b(mace_\w+)\s*\(", sources[key])
        return found.group(1) if found else sources[key][:60]

    missed = sorted(name(k) for k in compiled - started)
    assert not missed, f"compiled by the call but not started by the surgery: {missed}"
