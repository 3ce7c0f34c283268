"""Criteo-format data: a synthetic generator with a planted signal, the TSV format, and a
converter to HugeCTR Norm and Raw files, so examples and tests run without downloading
anything.

Criteo TSV: one sample per line, tab-separated: the label (0 or 1), 13 integer features
(I1..I13, may be empty) and 26 categorical features (C1..C26, 32-bit hashes as 8 hex
digits, may be empty).

The synthetic data: categorical ids are drawn per slot from a Zipf-like law over a
vocabulary whose size varies by slot (3 to tens of thousands, as Criteo's do); a
fraction of each slot's ids carries a hidden weight, the dense features carry a linear
term on log(1 + x), and the label is drawn from the logistic of their sum. A model can
only beat chance by learning those weights: an AUC clearly above 0.5 shows that it
learnt them (`planted_auc` reports what the true weights themselves reach).

    python3 -m ember.criteo synth --samples 100000 --out data/      # TSV + Norm files
"""
import argparse
import os

import numpy as np

from . import hugectr, invalid_argument

DENSE = 13
SLOTS = 26
# vocabulary per slot (smaller than Criteo's, same spread)
VOCABULARY = [1460, 583, 10131, 2202, 305, 24, 12517, 633, 3, 9379, 5721, 8251, 3157, 27,
              14992, 5461, 10, 5652, 2173, 4, 7046, 18, 15, 2862, 105, 1428]


def _hash(slot, ids):
    """The 32-bit value a categorical id is written as (distinct per slot and id)."""
    mixed = (ids.astype(np.uint64) * np.uint64(2654435761) + np.uint64(slot * 40503 + 17))
    return (mixed ^ (mixed >> np.uint64(15))) & np.uint64(0xFFFFFFFF)


class Synthetic:
    """The hidden model of a synthetic dataset (seeded): per slot, ids' weights."""

    def __init__(self, seed=0, signal=1.0):
        rng = np.random.default_rng(seed)
        self.seed = seed
        self.weights = []
        for size in VOCABULARY:
            carries = rng.random(size) < 0.3
            self.weights.append(np.where(carries, rng.normal(0, 0.8 * signal, size), 0.0))
        self.dense_weights = rng.normal(0, 0.25 * signal, DENSE)
        self.bias = -1.5

    def sample(self, count, seed):
        """count samples: labels [n], dense [n, 13] (int, -1 for missing), ids [n, 26]
        (-1 for missing), and the true logits."""
        rng = np.random.default_rng((self.seed, seed))
        dense = np.floor(rng.lognormal(1.0, 1.3, (count, DENSE))).astype(np.int64)
        dense[rng.random((count, DENSE)) < 0.05] = -1
        ids = np.empty((count, SLOTS), dtype=np.int64)
        logits = np.full(count, self.bias)
        for slot, size in enumerate(VOCABULARY):
            ranks = np.minimum(rng.zipf(1.3, count) - 1, size - 1)
            ids[:, slot] = (ranks * 7919 + slot) % size  # hot ids spread over the vocabulary
            logits += self.weights[slot][ids[:, slot]]
        ids[rng.random((count, SLOTS)) < 0.03] = -1
        logits += (np.log1p(np.maximum(dense, 0)) - 1.5) @ self.dense_weights
        labels = (rng.random(count) < 1 / (1 + np.exp(-logits))).astype(np.int64)
        return labels, dense, ids, logits


def auc(labels, scores):
    """Area under the ROC curve (ties counted half), from ranks."""
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, dtype=np.float64)
    positives, negatives = labels.sum(), (~labels).sum()
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    # average ranks over ties
    boundaries = np.concatenate([[0], np.nonzero(np.diff(sorted_scores))[0] + 1,
                                 [len(scores)]])
    for begin, end in zip(boundaries[:-1], boundaries[1:]):
        ranks[order[begin:end]] = (begin + end + 1) / 2
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) /
                 (positives * negatives))


def logloss(labels, probabilities):
    p = np.clip(np.asarray(probabilities, dtype=np.float64), 1e-7, 1 - 1e-7)
    y = np.asarray(labels, dtype=np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def write_tsv(path, labels, dense, ids):
    """Criteo TSV: missing values (-1) as empty fields, ids as their 8-hex-digit hash."""
    hashed = np.stack([_hash(slot, np.maximum(ids[:, slot], 0)) for slot in range(SLOTS)],
                      axis=1)
    with open(path, "w") as out:
        for i in range(len(labels)):
            fields = [str(int(labels[i]))]
            fields += ["" if value < 0 else str(int(value)) for value in dense[i]]
            fields += ["" if ids[i, s] < 0 else "%08x" % int(hashed[i, s]) for s in range(SLOTS)]
            out.write("\t".join(fields) + "\n")


def read_tsv(path):
    """(labels [n], dense [n, 13] with -1 for missing, keys [n, 26] uint64 with
    2^64 - 1 for missing); a malformed line is refused naming its number and field."""
    labels, dense, keys = [], [], []
    missing = np.iinfo(np.uint64).max
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            fields = line.rstrip("\n").split("\t")
            if len(fields) != 1 + DENSE + SLOTS:
                raise invalid_argument(
                    f"{path}: line {number}: {len(fields)} fields, Criteo has {1 + DENSE + SLOTS}")
            try:
                label = int(fields[0])
                if label not in (0, 1):
                    raise ValueError
                labels.append(label)
            except ValueError:
                raise invalid_argument(f"{path}: line {number}: label: {fields[0]!r}") from None
            row = []
            for index, field in enumerate(fields[1:1 + DENSE]):
                try:
                    row.append(int(field) if field else -1)
                except ValueError:
                    raise invalid_argument(
                        f"{path}: line {number}: I{index + 1}: {field!r}") from None
            dense.append(row)
            row = []
            for index, field in enumerate(fields[1 + DENSE:]):
                try:
                    row.append(int(field, 16) if field else missing)
                except ValueError:
                    raise invalid_argument(
                        f"{path}: line {number}: C{index + 1}: {field!r}") from None
            keys.append(row)
    return (np.array(labels, dtype=np.int64), np.array(dense, dtype=np.int64).reshape(-1, DENSE),
            np.array(keys, dtype=np.uint64).reshape(-1, SLOTS))


def dense_features(dense):
    """What the models see of the integer features: log(1 + x), 0 when missing."""
    return np.log1p(np.maximum(dense, 0)).astype(np.float32)


def convert(tsv_path, out_dir, format="norm", files=1, key_type="u32", checksum=False):
    """Converts a Criteo TSV file to HugeCTR files in out_dir: Norm (`files` data files
    and file_list.txt; missing categoricals have no key, dense as log(1 + x)) or Raw
    (train.bin: int32 label, dense as given with missing as 0, missing keys as 0).
    Returns the file list's path (Norm) or the Raw file's."""
    labels, dense, keys = read_tsv(tsv_path)
    os.makedirs(out_dir, exist_ok=True)
    missing = np.iinfo(np.uint64).max
    if format == "raw":
        path = os.path.join(out_dir, "train.bin")
        hugectr.write_raw(path, labels, np.maximum(dense, 0),
                          np.where(keys == missing, 0, keys))
        return path
    if format != "norm":
        raise invalid_argument(f"format: expected norm or raw, got {format!r}")
    paths = []
    for index, part in enumerate(np.array_split(np.arange(len(labels)), files)):
        present = keys[part] != missing  # [n, slots]
        lengths = present.T.astype(np.uint32)
        slot_keys = keys[part].T[present.T]  # slot-major
        path = os.path.join(out_dir, f"part{index:03d}.data")
        hugectr.write_norm(path, labels[part].astype(np.float32), dense_features(dense[part]),
                           lengths, slot_keys, key_type=key_type, checksum=checksum)
        paths.append(path)
    listing = os.path.join(out_dir, "file_list.txt")
    hugectr.write_file_list(listing, paths)
    return listing


def planted_auc(synthetic, count, seed):
    """The AUC of the true logits on fresh samples: the best any model can do."""
    labels, _, _, logits = synthetic.sample(count, seed)
    return auc(labels, logits)


def synthesize(out_dir, samples, test_samples=None, seed=0, files=4, key_type="u32",
               checksum=False):
    """Writes train.tsv and test.tsv of synthetic Criteo-like data and their Norm
    conversions (train/file_list.txt, test/file_list.txt); returns the two lists."""
    synthetic = Synthetic(seed)
    test_samples = test_samples or max(1, samples // 5)
    lists = []
    for name, count, part in (("train", samples, 1), ("test", test_samples, 2)):
        labels, dense, ids, _ = synthetic.sample(count, part)
        tsv = os.path.join(out_dir, f"{name}.tsv")
        os.makedirs(out_dir, exist_ok=True)
        write_tsv(tsv, labels, dense, ids)
        lists.append(convert(tsv, os.path.join(out_dir, name), files=files, key_type=key_type,
                             checksum=checksum))
    return lists


def main():
    parser = argparse.ArgumentParser(prog="python3 -m ember.criteo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    synth = commands.add_parser("synth", help="synthetic Criteo-like TSV and Norm files")
    synth.add_argument("--samples", type=int, default=100000)
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--files", type=int, default=4)
    synth.add_argument("--out", required=True)
    conv = commands.add_parser("convert", help="Criteo TSV to HugeCTR Norm or Raw")
    conv.add_argument("tsv")
    conv.add_argument("--out", required=True)
    conv.add_argument("--format", choices=["norm", "raw"], default="norm")
    conv.add_argument("--files", type=int, default=1)
    conv.add_argument("--key-type", choices=["u32", "u64"], default="u32")
    conv.add_argument("--checksum", action="store_true")
    options = parser.parse_args()
    if options.command == "synth":
        for listing in synthesize(options.out, options.samples, seed=options.seed,
                                  files=options.files):
            print(listing)
    else:
        print(convert(options.tsv, options.out, options.format, options.files,
                      options.key_type, options.checksum))


if __name__ == "__main__":
    main()
