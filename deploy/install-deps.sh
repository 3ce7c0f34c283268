#!/usr/bin/env bash
# Installs what building, running and testing ember needs on Debian 12, using apt-get.
# Only missing packages are installed; run as root or with sudo available.
#   deploy/install-deps.sh            build, run and test
#   deploy/install-deps.sh --bench    also what the benchmarks compare against (redis-server)
#                                     and count with (valgrind: tests/bench/row_check_cost.py)
set -euo pipefail

packages=(
  build-essential pkg-config meson ninja-build
  libuv1-dev libprotobuf-c-dev protobuf-c-compiler libcjson-dev libsystemd-dev libssl-dev
  libxxhash-dev libhttp-parser-dev
  check openssl clang libclang-rt-14-dev
  prometheus systemd
  python3-dev python3-numpy python3-pytest python3-torch python3-tqdm
)
if [[ "${1:-}" == "--bench" ]]; then
  packages+=(redis-server valgrind)
fi

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi

run_as_root() {
  if [[ $(id -u) -eq 0 ]]; then
    "$@"
  elif command -v sudo >/dev/null; then
    sudo "$@"
  else
    echo "install-deps: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
}

echo "install-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
run_as_root apt-get update -q
run_as_root apt-get install -y -q --no-install-recommends "${missing[@]}"
