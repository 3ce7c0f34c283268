#!/usr/bin/env bash
# Checks the alert rules (promtool check rules) and runs their unit tests (promtool test
# rules). promtool comes with Debian's prometheus package (deploy/install-deps.sh).
set -euo pipefail
cd "$(dirname "$0")"
if ! command -v promtool >/dev/null; then
  echo "promtool not found: install Debian's prometheus package (deploy/install-deps.sh does)" >&2
  exit 1
fi
promtool check rules ember-alerts.yml
promtool test rules ember-alerts.test.yml
