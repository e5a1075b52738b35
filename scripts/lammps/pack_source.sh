#!/usr/bin/env bash
# Pack the part of a LAMMPS source tree that scripts/build_lammps.sh builds (cmake/, the core of
# src/ with ML-IAP, ML-SNAP and PYTHON, python/, third_party/): about 3 MB as xz instead of the
# 200 MB tree, for a machine without network (unpack it there, then run build_lammps.sh on it).
#
# Usage: bash scripts/lammps/pack_source.sh SOURCE_DIR OUT.tar.xz
set -euo pipefail
if [ $# -ne 2 ] || [ ! -f "$1/cmake/CMakeLists.txt" ]; then
  echo "pack_source.sh: give an unpacked LAMMPS source tree (a folder with cmake/CMakeLists.txt)" \
       "and the archive to write, got '$*'" >&2
  exit 2
fi
src=$(cd "$1" && pwd)
out=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/lammps/src" "$stage/lammps/doc" "$stage/lammps/potentials"
cp -r "$src/cmake" "$src/third_party" "$stage/lammps/"
cp "$src"/LICENSE "$src"/README "$stage/lammps/" 2> /dev/null || true
# the note of the patches applied to it (scripts/build_lammps.sh)
cp "$src"/.mace-accel-patches "$stage/lammps/" 2> /dev/null || true
cp "$src"/doc/lammps.1 "$stage/lammps/doc/" 2> /dev/null || true
# the Python module without its examples (links into tools/, which is left out)
mkdir -p "$stage/lammps/python" && cp -r "$src/python/lammps" "$stage/lammps/python/"
find "$src/python" -maxdepth 1 -type f -exec cp {} "$stage/lammps/python/" \;
find "$src/src" -maxdepth 1 -type f -exec cp {} "$stage/lammps/src/" \;
for folder in fmt nlohmann ML-IAP ML-SNAP PYTHON; do
  cp -r "$src/src/$folder" "$stage/lammps/src/"
done
tar -cJf "$out.part" -C "$stage" lammps && mv "$out.part" "$out"
echo "packed $(du -h "$out" | cut -f1) into $out (unpack: tar -xJf $(basename "$out"); build:" \
     "bash scripts/build_lammps.sh lammps)"
