#!/usr/bin/env bash
# The size on disk of each install of gpufail, every one into a fresh venv from requirements.lock
# (the versions the tests ran with): `bash deploy/install-sizes.sh [EXTRA...]`, from the
# repository root after `make install` (uv comes from .venv; packages from its cache when there).
# Prints one line per install: its extras and the venv's size in MB (du -sm).
set -euo pipefail
cd "$(dirname "$0")/.."
UV=.venv/bin/uv
[ -x "$UV" ] || { echo "run 'make install' first (uv comes from .venv)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
installs=("${@:-collect serve train collect,serve,train,dev}")
for extras in ${installs[@]}; do
    venv="$work/${extras//,/-}"
    "$UV" venv --quiet --python python3 "$venv"
    "$UV" pip install --quiet --python "$venv/bin/python" --constraint requirements.lock ".[$extras]"
    printf '%-28s %6s MB\n' "gpufail[$extras]" "$(du -sm "$venv" | cut -f1)"
done
