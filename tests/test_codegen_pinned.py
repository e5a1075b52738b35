"""The rendered source of every catalog kernel is pinned by hash (tests/data/kernel_sources.json).

A change to generated code must be deliberate: rerun ``python scripts/pin_kernels.py`` and
commit the new pins with the change that caused them.
"""

from __future__ import annotations

import json
from pathlib import Path

from mace_accel.ops.sources import source_hashes

PINS = Path(__file__).parent / "data" / "kernel_sources.json"


def test_generated_kernel_sources_match_their_pins(rendered_catalog):
    stored = json.loads(PINS.read_text())
    current = source_hashes(sources=rendered_catalog)
    added = sorted(set(current) - set(stored))
    removed = sorted(set(stored) - set(current))
    changed = sorted(k for k in set(current) & set(stored) if current[k] != stored[k])
    assert not (added or removed or changed), (
        "generated kernels differ from their pins (run `python scripts/pin_kernels.py` if the "
        f"change is deliberate): changed {changed[:10]}, added {added[:10]}, removed "
        f"{removed[:10]}")


def test_pins_catch_a_changed_kernel(monkeypatch):
    """The check has teeth: one changed character in a template changes the pins of the
    kernels rendered from it, and only those (the convolution's family: rendering the whole
    catalog again would add nothing but time)."""
    from mace_accel.ops import templates
    from mace_accel.ops.conv_tp import codegen as conv_tp
    from mace_accel.ops.sources import PIN_LIMITS

    before = source_hashes(sources=dict(conv_tp.catalog_sources(PIN_LIMITS)))
    original = templates._source

    def edited(name: str) -> str:
        text = original(name)
        return text.replace("#define TILE", "#define TILE ") if "forward" in name else text

    templates._environment.cache_clear()
    monkeypatch.setattr(templates, "_source", edited)
    try:
        after = source_hashes(sources=dict(conv_tp.catalog_sources(PIN_LIMITS)))
    finally:
        templates._environment.cache_clear()
    assert after.keys() == before.keys()
    assert any(after[k] != before[k] for k in before if k.endswith("-fwd"))
    assert all(after[k] == before[k] for k in before if not k.endswith("-fwd"))
