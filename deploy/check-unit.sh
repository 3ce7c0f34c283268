#!/usr/bin/env bash
# Checks a systemd unit with `systemd-analyze verify`: any complaint fails, warnings
# included (an unknown setting is only a warning to systemd, which then ignores it).
set -euo pipefail
unit="$1"
if ! command -v systemd-analyze >/dev/null; then
  echo "systemd-analyze not found: install Debian's systemd package (deploy/install-deps.sh does)" >&2
  exit 1
fi
output=$(systemd-analyze verify "$unit" 2>&1) || { echo "$output" >&2; exit 1; }
if [[ -n "$output" ]]; then
  echo "$output" >&2
  exit 1
fi
echo "$unit: systemd-analyze verify found nothing"
