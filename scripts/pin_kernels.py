"""Rewrite tests/data/kernel_sources.json: the sha256 of every generated catalog kernel.

tests/test_codegen_pinned.py fails when a rendered kernel's source changes, so a change to the
generated code is always deliberate: run this script, look at the diff of the JSON (which
kernels changed) and commit it with the change that caused it.

    python scripts/pin_kernels.py            # rewrite the pins
    python scripts/pin_kernels.py --check    # exit 1 if they are stale (what the test does)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PINS = Path(__file__).resolve().parent.parent / "tests" / "data" / "kernel_sources.json"


def main() -> int:
    from mace_accel.ops.sources import source_hashes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args()
    hashes = source_hashes()
    if args.check:
        stored = json.loads(PINS.read_text()) if PINS.is_file() else {}
        changed = sorted(k for k in set(hashes) | set(stored) if hashes.get(k) != stored.get(k))
        print("\n".join(changed) or "pins are up to date")
        return 1 if changed else 0
    PINS.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    print(f"pinned {len(hashes)} kernel sources in {PINS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
