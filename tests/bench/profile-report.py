#!/usr/bin/env python3
"""Reads a benchmark's sampled profile (tests/bench/sampler.h) and prints, per phase,
where the sampled thread's time went.

    profile-report.py FILE.profile [--binaries DIR]... [--top N]

The frames are offsets into the objects of the process that wrote FILE: they are named
with addr2line against the same binaries, found at the path recorded, or by file name
under each --binaries DIR (the build tree the programs came from, or the staged
.gpu-runtime/), so a profile written on another host reads here. Objects that cannot
be found (the driver's libraries, libc) are named by their file name only.

For each phase it prints the wall samples of the thread that timed it, then the CPU
samples of every thread, in tables that give shares of the phase's samples of that kind:
  self        the function the thread was in (or the library, where it has no names);
  inclusive   each function of ember's own objects on the stack, counted once a sample;
  callers     (wall samples) for samples in a library (a CUDA call, a wait in the
              kernel), the first of ember's functions above it: which of them spends
              its time there.
"""
import argparse
import collections
import os
import subprocess
import sys


def read_profile(path):
    labels, objects, samples = {}, {}, []
    meta = {}
    with open(path) as f:
        first = f.readline().split()
        if first[:1] != ["ember-bench-profile"]:
            sys.exit(f"{path}: not a profile of tests/bench/sampler.c")
        for line in f:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "label":
                number, _, name = rest.partition(" ")
                labels[int(number)] = name
            elif kind == "object":
                number, _, name = rest.partition(" ")
                objects[int(number)] = name
            elif kind == "sample":
                fields = rest.split()
                frames = []
                for frame in fields[2:]:
                    obj, _, offset = frame.partition(":")
                    frames.append((int(obj), int(offset, 16)))
                samples.append((int(fields[0]), fields[1], frames))
            else:
                meta[kind] = rest
    return meta, labels, objects, samples


def locate(path, search):
    if os.path.isfile(path):
        return path
    base = os.path.basename(path)
    for top in search:
        for dirpath, _, files in os.walk(top):
            if base in files:
                return os.path.join(dirpath, base)
    return None


def is_ember(path):
    base = os.path.basename(path)
    return "ember" in base or base.startswith(("bench_", "test_", "emberd"))


def name_frames(objects, samples, search):
    """{(object, offset, is_leaf): name} for every frame of every sample."""
    wanted = collections.defaultdict(set)
    for _, _, frames in samples:
        for i, (obj, offset) in enumerate(frames):
            # a caller's frame is a return address: the call is the byte before it
            wanted[obj].add(offset if i == 0 else offset - 1)
    names = {}
    for obj, offsets in wanted.items():
        path = objects.get(obj)
        local = locate(path, search) if path else None
        label = os.path.basename(path) if path else "?"
        resolved = {}
        if local is not None:
            ordered = sorted(offsets)
            try:
                out = subprocess.run(["addr2line", "-f", "-C", "-e", local] +
                                     [hex(o) for o in ordered],
                                     capture_output=True, text=True, check=True).stdout
                lines = out.splitlines()
                for k, offset in enumerate(ordered):
                    function = lines[2 * k] if 2 * k < len(lines) else "??"
                    if function != "??":
                        resolved[offset] = function
            except (OSError, subprocess.CalledProcessError) as e:
                print(f"addr2line on {local}: {e}", file=sys.stderr)
        for offset in offsets:
            names[(obj, offset)] = resolved.get(offset, f"[{label}]")
    return names


def frame_name(names, frames, i):
    obj, offset = frames[i]
    return names[(obj, offset if i == 0 else offset - 1)]


def table(title, counter, total, top):
    print(f"  {title}")
    everywhere = [name for name, count in counter.items() if count == total]
    if len(everywhere) > 1:  # the stack's bottom (main, the benchmark's loop)
        print(f"    (in every sample: {', '.join(everywhere)})")
        counter = collections.Counter({n: c for n, c in counter.items() if c < total})
    for name, count in counter.most_common(top):
        print(f"    {100.0 * count / total:6.1f}%  {name}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--binaries", action="append", default=[],
                        help="a directory to find the process's objects in by name")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    meta, labels, objects, samples = read_profile(args.profile)
    names = name_frames(objects, samples, args.binaries)
    ember = {obj for obj, path in objects.items() if is_ember(path)}
    interval = float(meta.get("interval_us", "1000"))
    wall = sum(1 for _, kind, _ in samples if kind == "wall")
    print(f"{args.profile}: {wall} wall samples, one each {interval:.0f} us of the "
          f"sampled thread's time, and {len(samples) - wall} CPU samples, one each "
          f"{interval:.0f} us (or the kernel's tick) of the process's CPU time on any "
          f"thread ({meta.get('dropped', '0')} dropped)")
    for number in sorted(labels):
        for kind in ("wall", "cpu"):
            mine = [frames for label, k, frames in samples if label == number and k == kind]
            if mine:
                phase(names, ember, f"{labels[number]} ({kind})", mine, interval, args.top,
                      kind == "wall")


def phase(names, ember, title, mine, interval, top, with_callers):
    self_time, inclusive, callers = (collections.Counter() for _ in range(3))
    for frames in mine:
        self_time[frame_name(names, frames, 0)] += 1
        seen = set()
        for i, (obj, _) in enumerate(frames):
            if obj in ember:
                name = frame_name(names, frames, i)
                if name not in seen:
                    seen.add(name)
                    inclusive[name] += 1
        if frames[0][0] not in ember:
            leaf = frame_name(names, frames, 0)
            caller = next((frame_name(names, frames, i) for i, (obj, _) in
                           enumerate(frames) if obj in ember), "(none of ember's)")
            callers[f"{caller} -> {leaf}"] += 1
    print(f"\n== {title}: {len(mine)} samples")
    table("self", self_time, len(mine), top)
    table("inclusive (ember's functions)", inclusive, len(mine), top)
    if with_callers and callers:
        table("callers of the time spent in libraries", callers, len(mine), top)

if __name__ == "__main__":
    main()
