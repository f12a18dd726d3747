#!/usr/bin/env bash
# mypy --strict over src/, backends/ and formats/ as the one package they install as.
# backends/ and formats/ become tiercheck.backends and tiercheck.formats only through the
# package-dir mapping in pyproject.toml, which mypy cannot see; so the package is laid out
# as installed in a temporary tree of symlinks, and reported paths are mapped back.
set -euo pipefail
cd "$(dirname "$0")/.."
here="$PWD"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir -p "$tree/tiercheck"
for f in src/tiercheck/*; do ln -s "$here/$f" "$tree/tiercheck/$(basename "$f")"; done
ln -s "$here/backends" "$tree/tiercheck/backends"
ln -s "$here/formats" "$tree/tiercheck/formats"
cd "$tree"
set +e
"$here/.venv/bin/mypy" --config-file "$here/pyproject.toml" --cache-dir "$here/.mypy_cache" \
    -p tiercheck 2>&1 | sed -e "s#^tiercheck/backends/#backends/#" -e "s#^tiercheck/formats/#formats/#" \
    -e "s#^tiercheck/#src/tiercheck/#"
status="${PIPESTATUS[0]}"
exit "$status"
