#!/usr/bin/env bash
# Debian packages the project needs beside its Python ones: Mooncake's wheel (the `mooncake` L3
# backend and its tests) links libibverbs and librdmacm. Installs what is missing when run as
# root with apt-get; otherwise says what to install and exits 0 (the Python install goes on,
# and the Mooncake tests then fail naming the missing library).
set -euo pipefail
packages=(libibverbs1 librdmacm1)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
else
  echo "warning: Debian packages missing: ${missing[*]} (run as root: apt-get install ${missing[*]})" >&2
fi
