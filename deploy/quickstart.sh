#!/usr/bin/env bash
# Sets up ember on a Debian 12 machine and runs emberd on the embedded default
# (configs/default.json: CPU backend, loopback listeners) in the foreground.
# Stop it with Ctrl-C (it drains and exits 0).
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh
if [[ ! -f build/build.ninja ]]; then
  meson setup build
fi
meson compile -C build
exec build/daemon/emberd --config configs/default.json
