#!/usr/bin/env bash
# Wheels for a GPU machine that reaches no package registry (scripts/device_check.sh
# installs them there when its python cannot import tiercheck): tiercheck itself, built
# from this checkout, and the dependencies that machine's image lacks, at the versions of
# this repository's .venv, for that machine's Python.
#
#   bash scripts/device_wheels.sh                 # into ./.whl, for CPython 3.12
#   PYVER=3.11 bash scripts/device_wheels.sh /some/dir
#   PACKAGES="blake3 lmdb" bash scripts/device_wheels.sh
#
# The default PACKAGES are those the lent machines' image ('cuda': torch, numpy, fsspec,
# msgpack, psutil, rich, pytest, hypothesis, safetensors already there) does not hold.
# Rebuild after every change: the tiercheck wheel is a copy of the code, not a link to it.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
py="$here/.venv/bin/python"
dest="${1:-$here/.whl}"
pyver="${PYVER:-3.12}"
packages="${PACKAGES:-blake3 xxhash lmdb zstandard bitmath tenacity tomli_w}"
mkdir -p "$dest"
rm -f "$dest"/*.whl
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
    platforms+=(--platform "$p")
done
for name in $packages; do
    version="$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")"
    "$py" -m pip download -q --no-deps --only-binary=:all: --implementation cp \
        --python-version "$pyver" "${platforms[@]}" -d "$dest" "$name==$version"
done
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" "$here"
rm -rf "$here/build"
ls -1 "$dest"
