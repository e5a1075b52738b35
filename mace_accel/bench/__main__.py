"""``python -m mace_accel.bench``: the same as ``mace-accel bench``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
