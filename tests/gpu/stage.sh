#!/usr/bin/env bash
# Stages into .gpu-runtime/ what tests/gpu/run-on-gpu.sh needs on a GPU machine that has
# a driver, CUDA and NCCL but nothing of ember's: the programs of a build tree (emberd,
# emberctl, the gpu suite, the *_cuda integration suites and the checkpoints suite,
# bench_gpu, bench_server, bench_checkpoint, bench_eviction), the Debian 12 runtime libraries they link
# (libuv, protobuf-c, cJSON, xxHash, http-parser, subunit, OpenSSL) and what bench_server
# compares against (redis-server, the openssl command), about 27 MB in all. Run on the
# Debian 12 machine that built the tree:
#
#     meson setup build && meson compile -C build    # with the CUDA toolkit found
#     tests/gpu/stage.sh [BUILD_DIR]                  # default: build
#
# Then copy the checkout with .gpu-runtime/ to the GPU machine and run
# tests/gpu/run-on-gpu.sh there (tests/gpu/README.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
dest=.gpu-runtime

programs=(
  daemon/emberd
  clients/emberctl
  clients/examples/train_logreg
  tests/gpu/test_gpu_backend
  tests/integration/test_client_daemon
  tests/integration/test_protocol
  tests/integration/test_serving
  tests/integration/test_checkpoints
  tests/bench/bench_gpu
  tests/bench/bench_server
  tests/bench/bench_checkpoint
  tests/bench/bench_eviction
)
packages=(libatomic1 libuv1 libprotobuf-c1 libcjson1 libxxhash0 libhttp-parser2.9 libsubunit0
          libssl3 openssl redis-tools libjemalloc2 liblzf1 liblua5.1-0)

for program in "${programs[@]}"; do
  if [[ ! -x "$build/$program" ]]; then
    echo "stage.sh: $build/$program is missing: build with the CUDA backend first" \
         "(meson setup $build; meson compile -C $build)" >&2
    exit 1
  fi
done

rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/lib" "$dest/debs"
for program in "${programs[@]}"; do
  objcopy --strip-debug "$build/$program" "$dest/bin/$(basename "$program")"
done

# The CUDA runtime the build linked (small; NCCL is 200 MB and is found on the GPU
# machine instead, see run-on-gpu.sh).
cudart=$(ldd "$build/daemon/emberd" | awk '/libcudart/ {print $3}')
if [[ -n "$cudart" ]]; then
  cp -L "$cudart" "$dest/lib/"
fi

(cd "$dest/debs" && apt-get download "${packages[@]}" >/dev/null 2>&1) || {
  echo "stage.sh: apt-get download failed (run apt-get update first)" >&2
  exit 1
}
unpacked=$(mktemp -d)
for deb in "$dest"/debs/*.deb; do
  dpkg-deb -x "$deb" "$unpacked"
done
cp -a "$unpacked"/usr/lib/x86_64-linux-gnu/*.so.* "$dest/lib/"
cp -a "$unpacked"/usr/bin/openssl "$unpacked"/usr/bin/redis-check-rdb "$dest/bin/"
ln -sf redis-check-rdb "$dest/bin/redis-server" # one binary in Debian, named by argv[0]
rm -rf "$unpacked" "$dest/debs"

{
  echo "staged $(date -u +%Y-%m-%dT%H:%M:%SZ) from $build"
  echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  meson introspect --buildoptions "$build" 2>/dev/null |
    /usr/bin/python3 -c 'import json, sys; o = {x["name"]: x["value"] for x in json.load(sys.stdin)}; print("buildtype", o.get("buildtype"), "gpu_architectures", o.get("gpu_architectures"))' ||
    true
} >"$dest/STAGED"
du -sh "$dest"
cat "$dest/STAGED"
