#!/usr/bin/python3
"""The cost of keeping rows finite, in instructions and simulated cache misses.

Runs bench_table's pushes (fixed work: --batches requests of 4096 keys, one thread) under
valgrind's callgrind with its cache simulation (32 KiB L1, a 32 MiB last level), counting
inside em_table_push only, and prints, per optimizer and dim, the share of the push
spent in the finite-rows check (cpu_shard_check_apply: each shard's check, under its
read lock) and in the input pass that refuses non-finite gradients and finds their
largest size (em_csr_check_gradients), with bench_table's gradients (below 0.013, so
every check is settled by the bounds of common/row_check.h) and with gradients past
those bounds (up to 1.2e16, so every row's step is computed by the check). Instruction
counts do not move with the machine's load the way times do on a shared VM.

    tests/bench/row_check_cost.py BUILD_DIR [--batches B] [--keys N]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

EVENTS = ["Ir", "Dr", "Dw", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw"]


def inclusive_costs(path):
    """{function: [event counts]} inclusive, and the totals, from callgrind_annotate."""
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", path],
                         check=True, capture_output=True, text=True).stdout
    costs, totals = {}, None
    for line in out.splitlines():
        tokens = re.sub(r"\(\s*[\d.]+%\)", " ", line).split()
        if len(tokens) <= len(EVENTS) or not all(re.fullmatch(r"[\d,]+|\.", t)
                                                 for t in tokens[:len(EVENTS)]):
            continue
        values = [0 if t == "." else int(t.replace(",", "")) for t in tokens[:len(EVENTS)]]
        name = " ".join(tokens[len(EVENTS):])
        if "PROGRAM TOTALS" in name:
            totals = values
            continue
        function = name.split(" ")[0].split(":")[-1]
        costs[function] = [a + b for a, b in zip(costs.get(function, [0] * len(EVENTS)),
                                                 values)]
    return costs, totals


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("build")
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--keys", type=int, default=200000)
    args = parser.parse_args()
    bench = os.path.join(args.build, "tests", "bench", "bench_table")
    print(f"command: row_check_cost.py {args.build} --batches {args.batches} --keys {args.keys}")
    print(f"callgrind --cache-sim=yes, counting inside em_table_push only: {args.batches} pushes "
          f"of 4096 keys drawn from {args.keys} existing keys, 8 shards, one thread\n")
    print(f"{'gradients':<10} {'optimizer':<16} {'dim':>4} {'Ir/key':>8} {'check Ir':>9} "
          f"{'input Ir':>9} {'D1 miss/key':>11} {'check D1':>9} {'LL miss/key':>11} "
          f"{'check LL':>9}")
    for gradient, label in (("0.001", "bounded"), ("1e15", "past")):
      for dim in (16, 64, 128):
        for optimizer in ("sgd", "adagrad", "rowwise_adagrad", "adam"):
            with tempfile.TemporaryDirectory() as scratch:
                out = os.path.join(scratch, "callgrind.out")
                subprocess.run(["valgrind", "--tool=callgrind", "--cache-sim=yes",
                                "--D1=32768,8,64", "--LL=33554432,16,64",
                                "--toggle-collect=em_table_push", f"--callgrind-out-file={out}",
                                bench, "--operations", "push", "--optimizer", optimizer,
                                "--dim", str(dim), "--threads", "1", "--batches",
                                str(args.batches), "--keys", str(args.keys), "--gradient",
                                gradient],
                               check=True, capture_output=True)
                costs, totals = inclusive_costs(out)
            push = costs.get("em_table_push", totals)
            check = costs.get("cpu_shard_check_apply", [0] * len(EVENTS))
            gradients = costs.get("em_csr_check_gradients", [0] * len(EVENTS))
            keys = args.batches * 4096
            ir = EVENTS.index("Ir")
            d1 = lambda c: c[EVENTS.index("D1mr")] + c[EVENTS.index("D1mw")]
            ll = lambda c: c[EVENTS.index("DLmr")] + c[EVENTS.index("DLmw")]
            print(f"{label:<10} {optimizer:<16} {dim:>4} {push[ir] / keys:>8.0f} "
                  f"{100 * check[ir] / push[ir]:>8.2f}% {100 * gradients[ir] / push[ir]:>8.2f}% "
                  f"{d1(push) / keys:>11.2f} {100 * d1(check) / max(d1(push), 1):>8.2f}% "
                  f"{ll(push) / keys:>11.3f} {100 * ll(check) / max(ll(push), 1):>8.2f}%")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
