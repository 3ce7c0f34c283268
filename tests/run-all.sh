#!/usr/bin/env bash
# The whole test suite: installs dependencies, builds, runs every suite, then builds
# again with AddressSanitizer + UndefinedBehaviorSanitizer and reruns the unit and
# integration suites there, then runs each libFuzzer harness for EMBER_FUZZ_SECONDS
# (30 by default) in a clang build. Build trees: build/, build-asan/ and build-fuzz/.
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh

setup() {
  local dir=$1
  shift
  if [[ -f "$dir/build.ninja" ]]; then
    meson setup --reconfigure "$dir" "$@" >/dev/null
  else
    meson setup "$dir" "$@" >/dev/null
  fi
}

echo "== build (build/)"
setup build
meson compile -C build
echo "== tests"
meson test -C build --print-errorlogs --num-processes 2

echo "== build with ASan + UBSan (build-asan/)"
setup build-asan -Dcuda=disabled -Dpython=disabled -Db_sanitize=address,undefined -Db_lundef=false \
  -Dc_args=-fno-sanitize-recover=all
meson compile -C build-asan
echo "== unit and integration tests under ASan + UBSan"
EMBER_CRASH_ITERATIONS=${EMBER_CRASH_ITERATIONS:-40} ASAN_OPTIONS=abort_on_error=1:detect_leaks=1 \
  UBSAN_OPTIONS=print_stacktrace=1 \
  meson test -C build-asan --print-errorlogs --num-processes 2 --timeout-multiplier 4 \
  --suite unit --suite integration
echo "== fuzzers (build-fuzz/, clang + libFuzzer, ${EMBER_FUZZ_SECONDS:-30} s each)"
CC=clang setup build-fuzz -Dcuda=disabled -Dpython=disabled -Dfuzz=enabled -Db_sanitize=address,undefined \
  -Db_lundef=false -Dc_args=-fsanitize=fuzzer-no-link
meson compile -C build-fuzz fuzz_config fuzz_frames fuzz_requests fuzz_checkpoint fuzz_npy fuzz_backends
meson test -C build-fuzz --no-rebuild --print-errorlogs --num-processes 2 --suite fuzz
echo "== all tests passed"
