#!/usr/bin/env bash
# Put the Debian `prometheus` and `promtool` binaries under .cache/prometheus/ without installing the
# package: `apt-get download` + `dpkg -x` need only the Debian registry, no root beyond reading the
# apt lists. Idempotent: a second run with the binaries present does nothing.
# Prints the directory holding `prometheus` and `promtool` on its last line.
# Exit codes: 0 ready; 3 the registry (or apt itself) is unreachable; other: a real failure.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${TSERVE_PROMETHEUS_CACHE:-$ROOT/.cache/prometheus}"
BIN="$CACHE/root/usr/bin"

if [[ -x "$BIN/prometheus" && -x "$BIN/promtool" ]]; then
    echo "$BIN"
    exit 0
fi

command -v apt-get >/dev/null && command -v dpkg >/dev/null || { echo "apt-get/dpkg not found" >&2; exit 3; }
mkdir -p "$CACHE/deb"
cd "$CACHE/deb"

download() { apt-get download -q prometheus >&2; }
if ! download; then
    # The apt lists may be missing (fresh container) or stale (a superseded .deb): refresh once.
    if [[ $(id -u) -eq 0 ]]; then
        apt-get update -q >&2 || { echo "apt-get update failed: Debian registry unreachable" >&2; exit 3; }
    fi
    download || { echo "apt-get download prometheus failed: Debian registry unreachable" >&2; exit 3; }
fi

deb=$(ls -t prometheus_*.deb | head -n1)
rm -rf "$CACHE/root.tmp"
dpkg -x "$deb" "$CACHE/root.tmp"
test -x "$CACHE/root.tmp/usr/bin/prometheus" -a -x "$CACHE/root.tmp/usr/bin/promtool"
rm -rf "$CACHE/root"
mv "$CACHE/root.tmp" "$CACHE/root"
rm -f "$CACHE"/deb/*.deb
"$BIN/prometheus" --version >&2
echo "$BIN"
