"""Which packages setuptools builds: found, not listed (the metadata is in pyproject.toml).

The top-level folders ``kernels/`` (the CUDA templates) and ``patches/`` install as
``mace_accel.kernels`` and ``mace_accel.patches``. pyproject.toml's ``packages.find`` names a
package after its folder, so it cannot find these: the mapping and the search live here.
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
MAPPED = {"mace_accel.kernels": "kernels", "mace_accel.patches": "patches"}

packages = find_packages(ROOT, include=["mace_accel", "mace_accel.*"])
for name, folder in MAPPED.items():
    packages += [name + found[len(folder):]
                 for found in find_packages(ROOT, include=[folder, folder + ".*"])]

setup(packages=packages, package_dir=MAPPED)
