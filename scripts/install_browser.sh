#!/usr/bin/env bash
# Install headless Chromium and its WebDriver from Debian for the playground's end-to-end test.
# Skips when both are already on PATH. Needs root (or passwordless sudo) for apt-get install.
# Exit codes: 0 ready; 3 the Debian registry (or apt itself) is unreachable; 4 needs root; other: a failure.
set -euo pipefail

if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    chromium --version 2>/dev/null || true
    exit 0
fi

command -v apt-get >/dev/null || { echo "apt-get not found: install chromium and chromedriver yourself" >&2; exit 3; }
SUDO=()
if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO=(sudo -n); else
        echo "not root and no passwordless sudo: run scripts/install_browser.sh as root once" >&2; exit 4
    fi
fi

export DEBIAN_FRONTEND=noninteractive
install() { "${SUDO[@]}" apt-get install -y -q --no-install-recommends chromium chromium-driver; }
if ! install; then
    "${SUDO[@]}" apt-get update -q || { echo "apt-get update failed: Debian registry unreachable" >&2; exit 3; }
    install || { echo "apt-get install chromium chromium-driver failed" >&2; exit 1; }
fi
chromium --version
