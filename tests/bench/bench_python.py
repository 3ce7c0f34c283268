#!/usr/bin/python3
"""The Python client and ember.torch, measured side by side in one run.

    PYTHONPATH=build/clients/python /usr/bin/python3 tests/bench/bench_python.py \
        --emberd build/daemon/emberd --client-bench build/tests/bench/bench_client_pull

Three tables:
1. Pull keys/s from Python (ember.Client, pipelined with the same window, and blocking)
   against the C client (bench_client_pull) on the same batches and the same emberd,
   alternating rounds; target: Python at least 90% of C.
2. The share of pull/push time the prefetch pipeline hides: steps of a model (bottom MLP
   of a given width on the dense input, 8 ember tables, a top layer) timed without
   prefetch, with exact prefetch (staleness 0) and one step stale (staleness 1), and
   with the lookups answered locally (compute only). hidden = (plain - prefetched) /
   (plain - compute); target: at least 80% when compute per batch exceeds the RPC time.
3. Training samples/s of clients/python/examples/train_dlrm.py with its tables in ember
   against the same model with in-process torch.nn.EmbeddingBag(sparse=True) and the
   same optimizer, on the same synthetic data.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import ember
from ember import criteo
from ember.torch import (EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor,
                         PrefetchPipeline)

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "..", "clients", "python", "examples", "train_dlrm.py")
TOKEN = "bench-python-token"


def start_emberd(binary, directory, tables, threads):
    config = {"listen": {"data": "127.0.0.1:0", "admin": "127.0.0.1:0", "metrics": ""},
              "backend": {"type": "cpu", "memory_limit_bytes": 4 << 30, "threads": threads},
              "admin_token": {"value": TOKEN}, "tables": tables, "log_level": "warning"}
    path = os.path.join(directory, "emberd.json")
    listen = os.path.join(directory, "listen.json")
    with open(path, "w") as handle:
        json.dump(config, handle)
    process = subprocess.Popen([binary, "--config", path, "--listen-file", listen],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not (os.path.exists(listen) and os.path.getsize(listen)):
        if process.poll() is not None or time.monotonic() > deadline:
            sys.exit("emberd did not start")
        time.sleep(0.02)
    time.sleep(0.05)
    with open(listen) as handle:
        addresses = json.load(handle)
    return process, addresses["data"], addresses["admin"]


def splitmix_keys(count, key_space):
    """The keys bench_client_pull draws: splitmix64(i) % key_space."""
    with np.errstate(over="ignore"):
        x = np.arange(count, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x % np.uint64(key_space)


def python_pulls(client, table, rows, per_row, key_space, pulls, window, dim, blocking):
    nnz = rows * per_row
    batches = 16
    keys = splitmix_keys(batches * nnz, key_space)
    views = [keys[b * nnz:(b + 1) * nnz] for b in range(batches)]
    offsets = (np.arange(rows + 1, dtype=np.uint32) * per_row)
    outs = [np.empty((rows, dim), np.float32) for _ in range(window)]
    started = time.perf_counter()
    if blocking:
        for p in range(pulls):
            client.pull(table, offsets, views[p % batches])
    else:
        futures = [None] * window
        for p in range(pulls + window):
            slot = p % window
            if futures[slot] is not None:
                futures[slot].result()
                futures[slot] = None
            if p < pulls:
                futures[slot] = client.pull_async(table, offsets, views[p % batches],
                                                  out=outs[slot])
    seconds = time.perf_counter() - started
    return pulls * nnz / seconds


def c_pulls(binary, server, table, rows, per_row, key_space, pulls, window):
    output = subprocess.run([binary, server, table, str(rows), str(per_row), str(key_space),
                             str(pulls), str(window)], capture_output=True, text=True,
                            check=True).stdout.split()
    return float(output[0])


def pull_section(options, server):
    client = ember.Client(server, window=64)
    print("\n## Pull keys/s: Python against the C client (same emberd, same batches)\n")
    print("| dim | rows x keys/row | window | C keys/s | Python pipelined | ratio | "
          "Python blocking | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for dim, rows, per_row, window in ((16, 512, 8, 8), (64, 256, 4, 8), (16, 64, 1, 1)):
        table = f"pull{dim}"
        pulls = max(200, options.pull_keys // (rows * per_row))
        # warm: create every key once
        python_pulls(client, table, rows, per_row, options.key_space, 16, 1, dim, True)
        c_rates, piped, blocking = [], [], []
        for _ in range(options.rounds):
            c_rates.append(c_pulls(options.client_bench, server, table, rows, per_row,
                                   options.key_space, pulls, window))
            piped.append(python_pulls(client, table, rows, per_row, options.key_space, pulls,
                                      window, dim, False))
            blocking.append(python_pulls(client, table, rows, per_row, options.key_space,
                                         pulls, window, dim, True))
        c, p, b = (statistics.median(x) for x in (c_rates, piped, blocking))
        print(f"| {dim} | {rows} x {per_row} | {window} | {c:,.0f} | {p:,.0f} | {p / c:.2f} | "
              f"{b:,.0f} | {b / c:.2f} |")


class Model(torch.nn.Module):
    def __init__(self, embeddings, width, dim, features):
        super().__init__()
        self.embeddings = embeddings
        self.bottom = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(),
                                          torch.nn.Linear(width, width), torch.nn.ReLU(),
                                          torch.nn.Linear(width, dim))
        self.top = torch.nn.Linear(dim * (features + 1), 1)

    def forward(self, dense, kjt):
        bottom = self.bottom(dense)  # before the lookups: its backward runs after the push
        return self.top(torch.cat([bottom, self.embeddings(kjt).values()], dim=1)).squeeze(1)


class Answered(torch.nn.Module):
    """The lookups answered locally (compute only): a fixed tensor per batch."""

    def __init__(self, outputs):
        super().__init__()
        self.outputs = outputs

    def forward(self, kjt):
        class Values:
            def __init__(self, tensor):
                self.tensor = tensor

            def values(self):
                return self.tensor
        return Values(self.outputs[id(kjt)])


def prefetch_batches(count, batch, features, per_row, key_space, seed):
    rng = np.random.default_rng(seed)
    data = []
    names = [f"f{i}" for i in range(features)]
    for _ in range(count):
        lengths = np.full(features * batch, per_row)
        values = rng.zipf(1.2, features * batch * per_row) % key_space
        kjt = KeyedJaggedTensor.from_lengths_sync(names, torch.from_numpy(values.astype(np.int64)),
                                                  torch.from_numpy(lengths))
        data.append((kjt, torch.randn(batch, 64), torch.rand(batch).round()))
    return data


def timed_steps(model, data, collection, mode):
    optimizer = torch.optim.SGD([p for n, p in model.named_parameters()
                                 if not n.startswith("embeddings")], lr=1e-4)
    loop = data
    if mode in ("exact", "stale", "thread", "thread_stale"):
        loop = PrefetchPipeline(data, [collection], sparse=lambda b: b[0],
                                staleness=1 if mode.endswith("stale") else 0,
                                background=mode.startswith("thread"))
    loss_function = torch.nn.BCEWithLogitsLoss()
    started, cpu_started = time.perf_counter(), time.process_time()
    for kjt, dense, label in loop:
        optimizer.zero_grad()
        loss = loss_function(model(dense, kjt), label)
        loss.backward()
        optimizer.step()
    if collection is not None:
        collection.flush()
    return ((time.perf_counter() - started) / len(data),
            (time.process_time() - cpu_started) / len(data))


def prefetch_section(options, server, admin):
    client = ember.Client(server, admin=admin, admin_token=TOKEN)
    features, dim, batch, per_row = 8, 32, 1024, 4
    tables = [EmbeddingBagConfig(f"pf{i}", dim, 1 << 20, [f"f{i}"],
                                 optimizer={"type": "adagrad", "lr": 0.01})
              for i in range(features)]
    collection = EmbeddingBagCollection(tables, client, create_tables=True, dedup=False)
    data = prefetch_batches(options.prefetch_steps, batch, features, per_row, 200000, 1)
    with torch.no_grad():  # the compute-only run sees the rows the first step would
        answered = {id(kjt): collection(kjt).values().detach().clone().requires_grad_()
                    for kjt, _, _ in data}
    print(f"\n## Prefetch: the share of pull/push time hidden ({features} tables of dim {dim}, "
          f"batch {batch}, {per_row} keys per row, {options.prefetch_steps} steps, "
          f"torch threads {torch.get_num_threads()})\n")
    print("| bottom MLP width | compute ms/step | no prefetch | RPC ms | of which trainer CPU | "
          "staleness 0 | hidden | staleness 1 | hidden | background, staleness 0 | hidden | "
          "background, staleness 1 | hidden |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for width in options.widths:
        torch.manual_seed(0)
        model = Model(collection, width, dim, features)
        local = Model(Answered(answered), width, dim, features)
        local.load_state_dict({k: v for k, v in model.state_dict().items()}, strict=False)
        runs = {"compute": [], "plain": [], "exact": [], "stale": [], "thread": [],
                "thread_stale": []}
        cpu = {"compute": [], "plain": []}
        timed_steps(model, data[:4], collection, "plain")  # warm
        for _ in range(options.rounds):  # the modes interleaved, round after round
            for mode in runs:
                wall, processor = timed_steps(local if mode == "compute" else model, data,
                                              None if mode == "compute" else collection, mode)
                runs[mode].append(wall)
                if mode in cpu:
                    cpu[mode].append(processor)
        t = {mode: statistics.median(values) * 1000 for mode, values in runs.items()}
        lookup_cpu = (statistics.median(cpu["plain"]) - statistics.median(cpu["compute"])) * 1000
        rpc = t["plain"] - t["compute"]
        hidden = {mode: (t["plain"] - t[mode]) / rpc if rpc > 0 else float("nan")
                  for mode in ("exact", "stale", "thread", "thread_stale")}
        print(f"| {width} | {t['compute']:.2f} | {t['plain']:.2f} | {rpc:.2f} | "
              f"{lookup_cpu:.2f} | {t['exact']:.2f} | {hidden['exact']:.0%} | {t['stale']:.2f} | "
              f"{hidden['stale']:.0%} | {t['thread']:.2f} | {hidden['thread']:.0%} | "
              f"{t['thread_stale']:.2f} | {hidden['thread_stale']:.0%} |")


def dlrm_section(options, directory):
    data = os.path.join(directory, "dlrm")
    criteo.synthesize(data, options.dlrm_samples, seed=0)
    print(f"\n## DLRM training samples/s ({options.dlrm_samples} synthetic samples, 1 epoch, "
          f"adagrad, batch 256): ember against in-process torch.nn.EmbeddingBag\n")
    print("| embeddings | samples/s (median) | runs | test AUC |")
    print("|---|---|---|---|")
    results = {"ember": [], "ember --background": [], "local": []}
    for _ in range(options.rounds):
        for kind in results:
            command = [sys.executable, EXAMPLE, "--data", data, "--epochs", "1", "--quiet",
                       "--json", "--embeddings", kind.split()[0]]
            if kind.startswith("ember"):
                command += ["--emberd", options.emberd] + kind.split()[1:]
            finished = subprocess.run(command, capture_output=True, text=True, check=True)
            results[kind].append(json.loads(finished.stdout.strip().splitlines()[-1]))
    rates = {}
    for kind, runs in results.items():
        rates[kind] = statistics.median(r["train_samples_per_second"] for r in runs)
        each = ", ".join(format(r["train_samples_per_second"], ",.0f") for r in runs)
        auc = statistics.median(r["test_auc"] for r in runs)
        print(f"| {kind} | {rates[kind]:,.0f} | {each} | {auc:.3f} |")
    print(f"\nember / local: {rates['ember'] / rates['local']:.2f}; with --background: "
          f"{rates['ember --background'] / rates['local']:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--emberd", default="build/daemon/emberd")
    parser.add_argument("--client-bench", default="build/tests/bench/bench_client_pull")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pull-keys", type=int, default=8_000_000,
                        help="keys pulled per round of each pull row")
    parser.add_argument("--key-space", type=int, default=1_000_000)
    parser.add_argument("--prefetch-steps", type=int, default=30)
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 2048])
    parser.add_argument("--dlrm-samples", type=int, default=50000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--server-threads", type=int, default=1,
                        help="emberd worker threads (with --threads, at most the cores: "
                        "work hidden behind compute needs a core of its own)")
    parser.add_argument("--only", choices=["pull", "prefetch", "dlrm"])
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    print("# bench_python: " + " ".join(sys.argv[1:]))
    directory = tempfile.mkdtemp(prefix="ember-bench-python-")
    tables = [{"name": f"pull{dim}", "dim": dim, "capacity": 2_000_000,
               "optimizer": {"type": "sgd", "lr": 0.1}} for dim in (16, 64)]
    process, server, admin = start_emberd(options.emberd, directory, tables,
                                          options.server_threads)
    try:
        if options.only in (None, "pull"):
            pull_section(options, server)
        if options.only in (None, "prefetch"):
            prefetch_section(options, server, admin)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    if options.only in (None, "dlrm"):
        dlrm_section(options, directory)


if __name__ == "__main__":
    main()
