#!/usr/bin/env bash
# Runs one libFuzzer harness for EMBER_FUZZ_SECONDS (default 30) from its seed corpus,
# writing new inputs to a scratch directory; prints libFuzzer's final line (executions,
# coverage) so the run can be recorded. Exit status: 0, or 1 when the fuzzer found a
# crash, a leak, a timeout or ran out of memory (the input is saved as crash-*, leak-*,
# timeout-* or oom-* in the scratch directory, which is kept). Never 77: libFuzzer's
# default exit status for a crash is 77, which meson would count as a skip.
#   run-fuzzer.sh FUZZER SEED_CORPUS
set -uo pipefail
fuzzer=$(realpath "$1")
seeds=$(realpath "$2")
seconds=${EMBER_FUZZ_SECONDS:-30}
scratch=$(mktemp -d -t ember-fuzz-XXXXXX)
# undefined behaviour fails the run too (the build's UBSan only reports it by default)
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
cd "$scratch"
"$fuzzer" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
  -error_exitcode=1 -timeout_exitcode=1 \
  "$scratch" "$seeds" > log 2>&1
status=$?
grep -E "^#[0-9]+ *(DONE|INITED)|stat::number_of_executed_units|stat::peak_rss_mb|cov:" log | tail -4
if [[ $status -ne 0 ]]; then
  tail -60 log
  echo "run-fuzzer: $(basename "$fuzzer") failed (exit status $status); inputs and log kept in $scratch"
  exit 1
fi
rm -rf "$scratch"
