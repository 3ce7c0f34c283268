#!/usr/bin/python3
"""Trains a small DLRM on Criteo-like data in HugeCTR Norm format, with its 26 embedding
tables in emberd (server-side optimizer), and reports logloss and AUC per epoch.

    train_dlrm.py --emberd build/daemon/emberd           # a private emberd, synthetic data
    train_dlrm.py --server 127.0.0.1:7070 --admin 127.0.0.1:7071 --admin-token TOKEN

The model: a bottom MLP over the 13 dense features (13 -> 64 -> dim), 26 pooled
embedding lookups (one ember table per categorical slot), the dot products of every
pair of the 27 vectors, and a top MLP (-> 64 -> 1). The dense layers train here with
torch.optim.Adam; the embeddings train on the server with --optimizer.

Without --data, synthetic Criteo-like data with a planted signal is generated (ember.criteo)
and converted to Norm files. --embeddings local trains the same model with in-process
torch.nn.EmbeddingBag(sparse=True) tables and the same optimizer instead (the baseline
of tests/bench/bench_python.py).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import ember
from ember import criteo, hugectr
from ember.torch import (EmbeddingBagCollection, EmbeddingBagConfig, KeyedTensor,
                         PrefetchPipeline)

SLOTS = criteo.SLOTS
DEFAULT_LR = {"sgd": 2.0, "adagrad": 0.05, "rowwise_adagrad": 0.05, "adam": 0.005}


def progress(iterable, total, description, quiet):
    if quiet:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=description, unit="batch", leave=False,
                file=sys.stderr)


class MLP(torch.nn.Sequential):
    def __init__(self, sizes, last_activation=True):
        layers = []
        for index, (inputs, outputs) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(torch.nn.Linear(inputs, outputs))
            if last_activation or index < len(sizes) - 2:
                layers.append(torch.nn.ReLU())
        super().__init__(*layers)


class DLRM(torch.nn.Module):
    def __init__(self, embeddings, dim, dense_features=criteo.DENSE):
        super().__init__()
        self.embeddings = embeddings
        self.bottom = MLP([dense_features, 64, dim])
        vectors = SLOTS + 1
        self.pairs = torch.triu_indices(vectors, vectors, 1)
        self.top = MLP([dim + self.pairs.shape[1], 64, 1], last_activation=False)
        self.dim = dim

    def forward(self, dense, kjt):
        bottom = self.bottom(dense)
        pooled = self.embeddings(kjt).values().view(-1, SLOTS, self.dim)
        vectors = torch.cat([bottom[:, None, :], pooled], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([bottom, dots], dim=1)).squeeze(1)


class LocalEmbeddings(torch.nn.Module):
    """The baseline: the same tables in process, torch.nn.EmbeddingBag(sparse=True) over
    a per-slot index of the keys seen in the data (no hashing collisions)."""

    def __init__(self, vocabularies, dim, bound, seed):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.vocabularies = vocabularies
        self.bags = torch.nn.ModuleList()
        for vocabulary in vocabularies:
            bag = torch.nn.EmbeddingBag(len(vocabulary) + 1, dim, mode="sum", sparse=True)
            with torch.no_grad():
                bag.weight.uniform_(-bound, bound, generator=generator)
            self.bags.append(bag)

    def forward(self, kjt):
        blocks = []
        for slot, (bag, vocabulary) in enumerate(zip(self.bags, self.vocabularies)):
            jagged = kjt[f"slot_{slot}"]
            keys = jagged.values().numpy().view(np.uint64)
            index = np.searchsorted(vocabulary, keys)
            index = np.where(index < len(vocabulary), index, 0)
            known = vocabulary[index] == keys if len(vocabulary) else np.zeros(0, bool)
            index = np.where(known, index + 1, 0)  # row 0: keys never seen
            blocks.append(bag(torch.from_numpy(index), jagged.offsets()[:-1]))
        values = torch.cat(blocks, dim=1)
        return KeyedTensor([f"slot_{s}" for s in range(SLOTS)], [values.shape[1] // SLOTS] * SLOTS,
                           values)


def vocabularies(lists):
    keys = [[] for _ in range(SLOTS)]
    for listing in lists:
        for batch in hugectr.NormReader(listing, 65536):
            for slot in range(SLOTS):
                keys[slot].append(batch.slot(slot)[1])
    return [np.unique(np.concatenate(k)) for k in keys]


def local_optimizer(name, parameters, lr):
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(parameters, lr=lr, eps=1e-10)
    if name == "adam":
        return torch.optim.SparseAdam(parameters, lr=lr)
    raise SystemExit(f"--embeddings local: no torch optimizer for {name}")


def start_emberd(binary, directory):
    token = "dlrm-example-token"
    config = {"listen": {"data": "127.0.0.1:0", "admin": "127.0.0.1:0", "metrics": ""},
              "backend": {"type": "cpu", "memory_limit_bytes": 2 << 30},
              "admin_token": {"value": token}, "log_level": "warning"}
    config_path = os.path.join(directory, "emberd.json")
    listen_path = os.path.join(directory, "listen.json")
    with open(config_path, "w") as handle:
        json.dump(config, handle)
    log = open(os.path.join(directory, "emberd.log"), "w")
    process = subprocess.Popen([binary, "--config", config_path, "--listen-file", listen_path],
                               stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while not (os.path.exists(listen_path) and os.path.getsize(listen_path)):
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"emberd did not start: see {log.name}")
        time.sleep(0.02)
    time.sleep(0.02)
    with open(listen_path) as handle:
        listen = json.load(handle)
    return process, listen["data"], listen["admin"], token


def batches_of(listing, batch_size):
    for batch in hugectr.NormReader(listing, batch_size, slot_num=SLOTS):
        yield (batch.kjt([f"slot_{s}" for s in range(SLOTS)]), torch.from_numpy(batch.dense),
               torch.from_numpy(batch.labels[:, 0].copy()))


def evaluate(model, listing, batch_size):
    model.eval()
    labels, scores = [], []
    with torch.no_grad():
        for kjt, dense, label in batches_of(listing, batch_size):
            scores.append(torch.sigmoid(model(dense, kjt)).numpy())
            labels.append(label.numpy())
    model.train()
    labels, scores = np.concatenate(labels), np.concatenate(scores)
    return criteo.logloss(labels, scores), criteo.auc(labels, scores)


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="directory with train/file_list.txt and "
                        "test/file_list.txt (made there with synthetic data when absent)")
    parser.add_argument("--samples", type=int, default=100000,
                        help="synthetic training samples (test: a fifth as many)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--optimizer", default="adagrad", choices=sorted(DEFAULT_LR))
    parser.add_argument("--lr", type=float, help="embedding learning rate (default by optimizer)")
    parser.add_argument("--dense-lr", type=float, default=0.002)
    parser.add_argument("--server", default="127.0.0.1:7070")
    parser.add_argument("--admin", default="127.0.0.1:7071")
    parser.add_argument("--admin-token", default=os.environ.get("EMBER_ADMIN_TOKEN",
                                                                "ember-dev-admin-token"))
    parser.add_argument("--emberd", help="start a private emberd from this binary instead")
    parser.add_argument("--embeddings", choices=["ember", "local"], default="ember")
    parser.add_argument("--no-prefetch", action="store_true")
    parser.add_argument("--staleness", type=int, choices=[0, 1], default=0)
    parser.add_argument("--background", action="store_true",
                        help="pushes and prefetches on a thread of their own")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="the final figures as JSON")
    return parser.parse_args()


def main():
    options = parse_arguments()
    torch.manual_seed(options.seed)
    scratch = tempfile.mkdtemp(prefix="ember-dlrm-")
    data = options.data or os.path.join(scratch, "data")
    train_list = os.path.join(data, "train", "file_list.txt")
    test_list = os.path.join(data, "test", "file_list.txt")
    if not os.path.exists(train_list):
        print(f"generating {options.samples} synthetic samples in {data}", file=sys.stderr)
        criteo.synthesize(data, options.samples, seed=options.seed)
    lr = options.lr or DEFAULT_LR[options.optimizer]
    daemon = None
    tables = []
    if options.embeddings == "ember":
        server, admin, token = options.server, options.admin, options.admin_token
        if options.emberd:
            daemon, server, admin, token = start_emberd(options.emberd, scratch)
        client = ember.Client(server, admin=admin, admin_token=token)
        optimizer = {"type": options.optimizer, "lr": lr}
        tables = [EmbeddingBagConfig(f"dlrm_slot_{s}", options.dim, 1 << 20, [f"slot_{s}"],
                                     optimizer=optimizer,
                                     initializer={"type": "uniform", "bound": 0.05,
                                                  "seed": options.seed + s})
                  for s in range(SLOTS)]
        for config in tables:  # start from fresh tables
            if any(t["name"] == config.name for t in client.tables()):
                client.drop_table(config.name)
        embeddings = EmbeddingBagCollection(tables, client, create_tables=True)
        model = DLRM(embeddings, options.dim)
        sparse_optimizer = None
    else:
        embeddings = LocalEmbeddings(vocabularies([train_list, test_list]), options.dim, 0.05,
                                     options.seed)
        model = DLRM(embeddings, options.dim)
        sparse_optimizer = local_optimizer(options.optimizer, embeddings.parameters(), lr)
    dense_parameters = [p for name, p in model.named_parameters()
                        if not name.startswith("embeddings.")]
    dense_optimizer = torch.optim.Adam(dense_parameters, lr=options.dense_lr)
    loss_function = torch.nn.BCEWithLogitsLoss()
    batches_per_epoch = -(-hugectr.NormReader(train_list, 1).records() // options.batch_size)
    history = []
    samples = 0
    train_seconds = 0.0
    try:
        for epoch in range(options.epochs):
            batches = batches_of(train_list, options.batch_size)
            if options.embeddings == "ember" and not options.no_prefetch:
                batches = PrefetchPipeline(batches, [embeddings], staleness=options.staleness,
                                           background=options.background)
            started = time.perf_counter()
            losses = []
            for kjt, dense, label in progress(batches, batches_per_epoch, f"epoch {epoch + 1}",
                                              options.quiet):
                dense_optimizer.zero_grad()
                if sparse_optimizer is not None:
                    sparse_optimizer.zero_grad()
                loss = loss_function(model(dense, kjt), label)
                loss.backward()
                dense_optimizer.step()
                if sparse_optimizer is not None:
                    sparse_optimizer.step()
                losses.append(float(loss))
                samples += len(label)
            if options.embeddings == "ember":
                embeddings.flush()
            train_seconds += time.perf_counter() - started
            test_loss, test_auc = evaluate(model, test_list, options.batch_size)
            history.append({"epoch": epoch + 1, "train_logloss": float(np.mean(losses)),
                            "test_logloss": test_loss, "test_auc": test_auc})
            print(f"epoch {epoch + 1}: train logloss {np.mean(losses):.4f}, test logloss "
                  f"{test_loss:.4f}, test AUC {test_auc:.4f}", file=sys.stderr)
        final_loss, final_auc = evaluate(model, test_list, options.batch_size)
        result = {"optimizer": options.optimizer, "embeddings": options.embeddings,
                  "epochs": history, "test_logloss": final_loss, "test_auc": final_auc,
                  "train_samples_per_second": samples / train_seconds if train_seconds else 0}
        print(f"final: test logloss {final_loss:.4f}, test AUC {final_auc:.4f}, "
              f"{result['train_samples_per_second']:.0f} training samples/s", file=sys.stderr)
        if options.json:
            print(json.dumps(result))
    finally:
        if options.embeddings == "ember" and options.emberd is None:
            for config in tables:
                client.drop_table(config.name)
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=30)


if __name__ == "__main__":
    main()
