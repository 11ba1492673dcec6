#!/usr/bin/env bash
# Installs Mesa's software Vulkan driver (lavapipe) and the Vulkan loader from Debian's packages,
# unless they are there: vt-wgpu's tests (part of `cargo test --workspace`) run on it where there
# is no GPU. Run as root or with sudo.
set -euo pipefail
if ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1 && ldconfig -p | grep -q 'libvulkan\.so\.1'; then
    exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo=sudo
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends mesa-vulkan-drivers libvulkan1
