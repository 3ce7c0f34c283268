#!/usr/bin/env python3
"""The include rule of README "Architecture", checked on the include graph.

Every project header or source names its includes by path from the root
("lib/table/table.h"); this walks every C, CUDA and header file of the tree, maps each
file to its layer, and fails when a file includes a layer its own may not reach, or
when the graph between project files has a cycle. Two system headers are held to
their layers too: libuv only in daemon/, clients/ and tests/ (the engine has no event
loop), CUDA and NCCL only in kernels/ (everything else reaches the GPU through
kernels/ember_kernels.h). Run from anywhere:

    tests/include_rules.py [SOURCE_ROOT]
"""
import os
import re
import sys

# Which layers each layer may include (its own is always allowed).
ALLOWED = {
    "common": set(),
    "kernels": {"common"},
    "lib/base": {"common"},
    "lib/memory": {"common", "lib/base"},
    "lib/device": {"common", "lib/base", "lib/memory", "kernels/ember_kernels.h"},
    "lib/table": {"common", "lib/base", "lib/memory", "lib/device"},
    "lib/checkpoint": {"common", "lib/base", "lib/memory", "lib/device", "lib/table"},
    "proto": {"common", "lib/base", "lib/memory", "lib/device", "lib/table"},
    "clients": {"common", "lib/base", "lib/memory", "lib/device", "lib/table", "lib/checkpoint",
                "proto"},
    "daemon": {"common", "lib/base", "lib/memory", "lib/device", "lib/table", "lib/checkpoint",
               "proto"},
    "tests": None,  # tests may include anything
}
# Generated or configured headers every layer may include.
ANYWHERE = {"ember_config.h", "proto/ember.pb-c.h"}
SOURCE_SUFFIXES = (".c", ".h", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
SYSTEM_INCLUDE = re.compile(r'^\s*#\s*include\s+<([^>]+)>', re.MULTILINE)
# System headers that only some layers may include: (pattern, layers allowed, what).
SYSTEM_RULES = [
    (re.compile(r"^uv\.h$|^uv/"), {"daemon", "clients", "tests"}, "libuv"),
    (re.compile(r"^(cuda|cub/|thrust/|nccl|curand|cublas)"), {"kernels", "tests"},
     "a CUDA or NCCL header"),
]


def layer_of(path):
    for layer in sorted(ALLOWED, key=len, reverse=True):
        if path == layer or path.startswith(layer + "/"):
            return layer
    return None


def allowed(from_layer, target):
    if target in ANYWHERE:
        return True
    permitted = ALLOWED[from_layer]
    if permitted is None:
        return True
    target_layer = layer_of(target)
    if target_layer == from_layer:
        return True
    return target_layer in permitted or target in permitted


def project_files(root):
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [d for d in subdirectories
                             if not d.startswith(".") and not d.startswith("build")]
        for name in files:
            if name.endswith(SOURCE_SUFFIXES):
                full = os.path.join(directory, name)
                yield os.path.relpath(full, root).replace(os.sep, "/")


def find_cycle(graph):
    """A list of files forming a cycle, or None."""
    state = {}
    stack = []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in graph.get(node, ()):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), ".."))
    problems = []
    graph = {}
    files = sorted(project_files(root))
    for path in files:
        layer = layer_of(path)
        if layer is None:
            continue
        with open(os.path.join(root, path), encoding="utf-8") as source:
            text = source.read()
        targets = INCLUDE.findall(text)
        for header in SYSTEM_INCLUDE.findall(text):
            for pattern, layers, what in SYSTEM_RULES:
                if pattern.search(header) and layer not in layers:
                    problems.append(f"{path}: {layer}/ may not include <{header}> ({what})")
        for target in targets:
            if target not in ANYWHERE and not os.path.exists(os.path.join(root, target)):
                problems.append(f"{path}: includes \"{target}\", which is not a path from "
                                "the root of the tree")
                continue
            if not allowed(layer, target):
                problems.append(f"{path}: {layer}/ may not include \"{target}\" "
                                f"({layer_of(target)}/)")
            if target not in ANYWHERE:
                graph.setdefault(path, []).append(target)
    cycle = find_cycle(graph)
    if cycle:
        problems.append("include cycle: " + " -> ".join(cycle))
    for problem in problems:
        print(problem)
    print(f"{len(files)} files checked, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
