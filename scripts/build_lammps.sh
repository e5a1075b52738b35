#!/usr/bin/env bash
# Build a LAMMPS with what mace-accel's ML-IAP model needs, for the Python that runs this script.
#
# Usage: bash scripts/build_lammps.sh SOURCE_DIR [BUILD_DIR]
#   SOURCE_DIR  an unpacked LAMMPS source tree (the one with src/ and cmake/); the patches in
#               scripts/lammps/ are applied to it first (skipped where already applied)
#   BUILD_DIR   where to build (default: ~/.cache/mace-accel/lammps-build)
# Packages: ML-IAP with its Python coupling (pair_style mliap unified), ML-SNAP (which ML-IAP
# needs), PYTHON; MPI; a shared library. The `lammps` Python module is installed into the
# environment of `python` on PATH: LAMMPS must be built for the Python that loads it.
# Patches, in the order of scripts/lammps/series (docs/design/lammps.md says what each does):
# the ghost atoms' exchange between a model's layers (which only the KOKKOS build has
# otherwise), a crash with 2+ ranks, the exchange moving each row's bytes, the pair arrays on
# OpenMP threads, the data object's nprocs, and the positions and box for a model that makes
# its own pairs.
# Environment: JOBS (parallel compile jobs, default: the number of cores).
set -euo pipefail

if [ $# -lt 1 ] || [ ! -f "$1/cmake/CMakeLists.txt" ]; then
  echo "build_lammps.sh: give an unpacked LAMMPS source tree (a folder with cmake/CMakeLists.txt)," \
       "got '${1:-}'" >&2
  exit 2
fi
src=$(cd "$1" && pwd)
build=${2:-$HOME/.cache/mace-accel/lammps-build}
python=$(command -v python || command -v python3)
for tool in cmake mpicxx "$python"; do
  command -v "$tool" > /dev/null || { echo "build_lammps.sh: $tool not found" \
    "(needs cmake, an MPI compiler wrapper such as Open MPI's mpicxx, and Python)" >&2; exit 2; }
done
"$python" -c "import Cython" 2> /dev/null || { echo "build_lammps.sh: the Python coupling needs" \
  "Cython in $python's environment: $python -m pip install cython" >&2; exit 2; }

patches=$(cd "$(dirname "$0")/lammps" && pwd)
# applied patches are noted in the source tree (name and checksum): a later patch may change
# lines of an earlier one, which then neither applies nor reverses on the patched tree
stamp="$src/.mace-accel-patches"
touch "$stamp"
# in the order of scripts/lammps/series
for name in $(grep -v "^#" "$patches/series"); do
  patch_file="$patches/$name"
  sum=$(sha256sum "$patch_file" | cut -c1-16)
  if grep -qx "$name $sum" "$stamp"; then
    echo "$name is applied already"
  elif patch -d "$src" -p1 -N --dry-run --silent < "$patch_file" > /dev/null 2>&1; then
    patch -d "$src" -p1 -N --silent < "$patch_file"
    echo "$name $sum" >> "$stamp"
    echo "applied $name"
  elif patch -d "$src" -p1 -R --dry-run --silent < "$patch_file" > /dev/null 2>&1; then
    echo "$name $sum" >> "$stamp"  # applied before the tree kept notes
    echo "$name is applied already"
  else
    echo "build_lammps.sh: $name does not apply to $src (another LAMMPS version, or an" \
         "earlier version of the patch: unpack the source afresh); it was written for the" \
         "4 Jul 2026 release" >&2
    exit 1
  fi
done

mkdir -p "$build"
cd "$build"
cmake "$src/cmake" -D CMAKE_BUILD_TYPE=Release -D BUILD_SHARED_LIBS=on -D BUILD_MPI=on \
  -D PKG_ML-IAP=on -D PKG_ML-SNAP=on -D PKG_PYTHON=on -D MLIAP_ENABLE_PYTHON=on \
  -D Python_EXECUTABLE="$python" -D LAMMPS_EXCEPTIONS=on > cmake.log 2>&1 \
  || { tail -n 30 cmake.log; echo "build_lammps.sh: cmake failed (log: $build/cmake.log)" >&2; exit 1; }
cmake --build . -j "${JOBS:-$(nproc)}" > build.log 2>&1 \
  || { tail -n 30 build.log; echo "build_lammps.sh: the build failed (log: $build/build.log)" >&2; exit 1; }
if ! cmake --build . --target install-python > install.log 2>&1; then
  # LAMMPS's installer makes a wheel in a fresh virtual environment, which needs the network;
  # without it, the module and the library go into site-packages as that wheel would put them
  site=$("$python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  if grep -q "No matching distribution found" install.log && [ -w "$site" ]; then
    rm -rf "$site/lammps" && cp -r "$src/python/lammps" "$site/lammps" \
      && cp -L liblammps.so "$site/lammps/liblammps.so" \
      || { echo "build_lammps.sh: copying the Python module into $site failed" >&2; exit 1; }
    echo "no network for LAMMPS's wheel installer: copied the lammps module into $site"
  else
    tail -n 30 install.log
    echo "build_lammps.sh: installing the Python module failed (log: $build/install.log)" >&2
    exit 1
  fi
fi
# the patches this build was made with, beside it (tests/test_lammps.py rebuilds a cached build
# that lacks one of scripts/lammps/series)
cp "$stamp" "$build/.mace-accel-patches"
echo "LAMMPS built in $build (lmp: $build/lmp; Python module installed for $python)"
