#!/usr/bin/env bash
# First contact with a GPU: runs, in one go and within 10 minutes, the gpu suite, the
# daemon's integration suites (checkpoints too) on the cuda backend, bench_gpu,
# bench_server --backend cuda, bench_checkpoint --backend cuda and bench_eviction
# --backend cuda, and writes everything
# into one report file (default: $OUT/gpu-report.txt when $OUT is set, else
# gpu-report.txt), ending with a table of each step's exit status and time, and sampled
# profiles of bench_checkpoint's loads and bench_eviction's pushes in profiles/ beside the
# report (read them where the programs were built: tests/bench/profile-report.py FILE
# --binaries build). Exits 0 only when every step passed.
#
#     tests/gpu/run-on-gpu.sh [REPORT]
#
# The programs come from .gpu-runtime/ (tests/gpu/stage.sh, on the Debian machine that
# built them), else from the build tree EMBER_BUILD names (default build/), else from a
# build made here when meson, ninja and nvcc are installed. NCCL is found on the machine:
# the linker's cache, /usr/local/cuda, or the nvidia-nccl Python package.
#
# Environment: EMBER_GPU_QUICK=1 runs the benchmarks shorter (about 2 minutes less);
# EMBER_GPU_MEMCHECK=1 also runs the gpu suite under compute-sanitizer's memcheck (about
# 130 s on an H200 with the suite of 2026-11-27; the suite of 2026-11-29 ran past 190 s
# there), when compute-sanitizer is installed; EMBER_GPU_SYNCCHECK=1 likewise runs it
# under synccheck.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
default_report=gpu-report.txt
[[ -n "${OUT:-}" ]] && default_report=$OUT/gpu-report.txt
report=$(realpath -m "${1:-$default_report}")
mkdir -p "$(dirname "$report")"
: >"$report"
summary=()
failures=0
last_rc=0

say() { echo "$*" | tee -a "$report"; }

# step NAME SECONDS COMMAND...: runs COMMAND with a time limit, its output into the
# report (and the terminal), and records its status and duration for the summary.
step() {
  local name=$1 limit=$2
  shift 2
  say ""
  say "== $name (limit ${limit} s): $*"
  local began=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$report"
  local rc=${PIPESTATUS[0]}
  local took=$((SECONDS - began))
  local verdict=passed
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    verdict="TIMED OUT"
  elif [[ $rc -eq 77 ]]; then
    verdict="SKIPPED (no GPU visible)"
  elif [[ $rc -ne 0 ]]; then
    verdict=FAILED
  fi
  [[ $verdict == passed ]] || failures=$((failures + 1))
  last_rc=$rc
  summary+=("$(printf '%-28s %-26s rc %-4s %5d s' "$name" "$verdict" "$rc" "$took")")
}

finish() {
  say ""
  say "== summary"
  for line in "${summary[@]}"; do
    say "$line"
  done
  say "report: $report"
  exit $((failures == 0 ? 0 : 1))
}

# ---- programs -------------------------------------------------------------------------
runtime=$root/.gpu-runtime
if [[ -x $runtime/bin/emberd ]]; then
  bin=$runtime/bin
  gpu_suite=$bin/test_gpu_backend
  integration=$bin
  emberd=$bin/emberd emberctl=$bin/emberctl train_logreg=$bin/train_logreg
  bench_gpu=$bin/bench_gpu bench_server=$bin/bench_server bench_checkpoint=$bin/bench_checkpoint
  bench_eviction=$bin/bench_eviction
  export LD_LIBRARY_PATH=$runtime/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PATH=$bin:$PATH
  origin="carried programs ($(head -2 "$runtime/STAGED" 2>/dev/null | tr '\n' ' '))"
else
  build=${EMBER_BUILD:-build}
  if [[ ! -x $build/daemon/emberd ]]; then
    if command -v meson >/dev/null && command -v ninja >/dev/null && command -v nvcc >/dev/null; then
      step "build ($build)" 400 bash -c "meson setup '$build' -Dcuda=enabled -Dpython=disabled >/dev/null && meson compile -C '$build'"
    else
      say "no .gpu-runtime/, no $build/ and no meson, ninja and nvcc to build one: run"
      say "tests/gpu/stage.sh on the machine that built ember and copy .gpu-runtime/ here"
      failures=1
      finish
    fi
  fi
  gpu_suite=$build/tests/gpu/test_gpu_backend
  integration=$build/tests/integration
  emberd=$build/daemon/emberd emberctl=$build/clients/emberctl
  train_logreg=$build/clients/examples/train_logreg
  bench_gpu=$build/tests/bench/bench_gpu bench_server=$build/tests/bench/bench_server
  bench_checkpoint=$build/tests/bench/bench_checkpoint
  bench_eviction=$build/tests/bench/bench_eviction
  origin="build tree $build"
fi

# NCCL, when the loader does not know it already.
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl.so.2 '; then
  for dir in /usr/local/cuda/lib64 /usr/local/cuda/lib \
             "$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)"; do
    if [[ -n $dir && -f $dir/libnccl.so.2 ]]; then
      export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$dir
      break
    fi
  done
fi

# ---- the machine ----------------------------------------------------------------------
say "ember on a GPU: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(uname -srm)"
say "programs: $origin"
say "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap --format=csv 2>&1 |
    tee -a "$report"
else
  say "nvidia-smi: not installed"
fi
say "CPUs: $(nproc), memory: $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)"
missing=$(ldd "$emberd" "$gpu_suite" "$bench_gpu" 2>&1 | grep "not found" | sort -u)
if [[ -n $missing ]]; then
  say "libraries not found:"
  say "$missing"
fi

step "emberd --list-devices" 60 "$emberd" --list-devices
if [[ $last_rc -ne 0 ]]; then
  [[ $last_rc -eq 3 ]] && say "no GPU is visible here: nothing else is run" ||
    say "a GPU or a driver is there but cannot be used (above): nothing else is run"
  finish
fi

# ---- suites ---------------------------------------------------------------------------
# Each test case of the suite at most 60 s (its own limit is 600 s, sized for the
# emulated kernels on a small CPU), so that one that hangs leaves time for the rest;
# verbose: every case's verdict in the report.
step "gpu suite" 200 env CK_TIMEOUT_MULTIPLIER=0.1 CK_VERBOSITY=verbose "$gpu_suite"
# The gpu suite under one of compute-sanitizer's tools, where its variable is 1:
# EMBER_GPU_MEMCHECK, memcheck; EMBER_GPU_SYNCCHECK, synccheck (the warp-level and
# block-level code: the shards' find counting a warp's absent keys per shard with
# __match_any_sync, the choice's counts in shared memory that the last block to arrive
# turns into the digit; a barrier or a warp intrinsic some of its lanes skip fails the
# step with its kernel and line).
for tool in memcheck synccheck; do
  variable=EMBER_GPU_${tool^^}
  [[ ${!variable:-0} == 1 ]] || continue
  if command -v compute-sanitizer >/dev/null; then
    step "gpu suite under $tool" 360 env CK_TIMEOUT_MULTIPLIER=0.3 compute-sanitizer \
      --tool "$tool" --target-processes all --error-exitcode 9 "$gpu_suite"
  else
    say "$variable=1: compute-sanitizer is not installed here; $tool not run"
  fi
done
for suite in client_daemon protocol serving; do
  step "${suite}_cuda" 45 env EMBER_TEST_BACKEND=cuda EMBERD="$emberd" EMBERCTL="$emberctl" \
    TRAIN_LOGREG="$train_logreg" "$integration/test_$suite"
done
# Saves, kill -9 and restores, the save at SIGTERM and a short crash loop, with the
# table's rows on the GPU (each iteration starts emberd, so 20 rather than 200).
step "checkpoints_cuda" 150 env EMBER_TEST_BACKEND=cuda EMBER_CRASH_ITERATIONS=20 \
  EMBERD="$emberd" EMBERCTL="$emberctl" TRAIN_LOGREG="$train_logreg" \
  "$integration/test_checkpoints"

# ---- benchmarks -----------------------------------------------------------------------
if [[ ${EMBER_GPU_QUICK:-0} == 1 ]]; then
  step "bench_gpu" 120 "$bench_gpu" --repeat 3 --seconds 1
  step "bench_server --backend cuda" 120 "$bench_server" --emberd "$emberd" --backend cuda --quick
else
  step "bench_gpu" 150 "$bench_gpu" --seconds 1
  step "bench_server --backend cuda" 100 "$bench_server" --emberd "$emberd" --backend cuda \
    --seconds 1
fi
# Where the host's time goes in the timed loads and pushes (tests/bench/sampler.h): the
# samples land beside the report, for tests/bench/profile-report.py on the machine that
# built the programs.
profiles=$(dirname "$report")/profiles
mkdir -p "$profiles"
# Saves and loads of a table in GPU memory against dd on this machine's disk.
step "bench_checkpoint --backend cuda" 180 env EMBER_BENCH_PROFILE="$profiles" \
  "$bench_checkpoint" --backend cuda --seconds 1 --pairs 3
# Inserts into a full table that evicts against inserts at load 0.5, and the hit rates of
# lru and lfu against exact ones, with the tables on the GPU.
step "bench_eviction --backend cuda" 120 env EMBER_BENCH_PROFILE="$profiles" \
  "$bench_eviction" --backend cuda --parts 12 --rows 4194304 --accesses 100000
# The same inserts in pushes of 4,096 keys: each evicts a small share of the table, as
# in a large table in production.
step "bench_eviction --backend cuda, small pushes" 120 "$bench_eviction" --backend cuda \
  --parts 1 --rows 4194304 --batch 4096 --rounds 3
finish
