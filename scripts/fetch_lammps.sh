#!/usr/bin/env bash
# Fetch the LAMMPS source that scripts/build_lammps.sh and its patches are written for (the
# 4 Jul 2026 release, from Debian's source archive: no other download of it is needed).
#
# Usage: bash scripts/fetch_lammps.sh DEST
#   DEST  the folder to unpack into (made; left as it is if it holds a source tree already)
# Needs apt-get (Debian or Ubuntu); uses a private apt configuration, so nothing on the
# system changes and no root is needed.
set -euo pipefail

if [ $# -ne 1 ]; then
  echo "usage: bash scripts/fetch_lammps.sh DEST (the folder to unpack the LAMMPS source into)" >&2
  exit 2
fi
dest=$1
if [ -f "$dest/cmake/CMakeLists.txt" ]; then
  echo "LAMMPS source already in $dest"
  exit 0
fi
command -v apt-get > /dev/null || { echo "fetch_lammps.sh: needs apt-get (Debian or Ubuntu);" \
  "elsewhere unpack the stable_4Jul2026 release of LAMMPS into $dest yourself" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]" \
     "http://deb.debian.org/debian sid main" > "$work/sources.list"
cat > "$work/apt.conf" <<CONF
Dir::Etc::SourceList "$work/sources.list";
Dir::Etc::SourceParts "/dev/null";
Dir::State::Lists "$work/lists";
Dir::Cache "$work/cache";
CONF
export APT_CONFIG="$work/apt.conf"
apt-get -q update > "$work/update.log" 2>&1 \
  || { tail -n 5 "$work/update.log"; echo "fetch_lammps.sh: apt-get update failed" >&2; exit 1; }
# the .orig tarball is the upstream source; Debian's packaging files are not needed
(cd "$work" && apt-get -q source --download-only lammps=20260704+dfsg-2 > download.log 2>&1) || true
tarball=$(ls "$work"/lammps_20260704*.orig.tar.* 2>/dev/null | head -n 1)
[ -n "$tarball" ] || { tail -n 5 "$work/download.log"; echo "fetch_lammps.sh: the LAMMPS" \
  "20260704 source is not in Debian's archive any more; unpack the stable_4Jul2026 release" \
  "into $dest yourself" >&2; exit 1; }
mkdir -p "$dest.partial"
tar -xf "$tarball" -C "$dest.partial"
# the tarball has no top folder
mkdir -p "$(dirname "$dest")"
rmdir "$dest" 2> /dev/null || true  # an empty folder given as DEST
mv "$dest.partial" "$dest"
echo "LAMMPS source in $dest"
