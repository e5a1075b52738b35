"""``python -m mace_accel.bench [options]``: the same as ``mace-accel bench [options]``."""

import sys

from mace_accel.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
