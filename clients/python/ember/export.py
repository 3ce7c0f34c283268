"""A table's rows as NumPy arrays: what `emberctl checkpoints export` writes, and what
`emberctl checkpoints import` reads (docs/checkpoints.md, "Export and import").

    table = ember.read_export("/tmp/clicks")          # after: emberctl checkpoints export
    table.keys, table.weights, table.state["second_moment"], table.config["dim"]

    ember.write_export("/tmp/pretrained", keys, weights,
                       config={"name": "items", "dim": 64, "capacity": 10_000_000,
                               "optimizer": {"type": "adam", "lr": 0.001}})
    # then: emberctl checkpoints import /tmp/pretrained --to /var/lib/ember/checkpoints
"""
import json
import os

import numpy as np

FORMAT = "ember-export"
VERSION = 1

# The state arrays of each optimizer: name -> floats a row (None: dim of them).
STATE_ARRAYS = {
    "sgd": {},
    "adagrad": {"accumulator": None},
    "rowwise_adagrad": {"accumulator": 1},
    "adam": {"first_moment": None, "second_moment": None, "step": 1},
}


def _error(message):
    from . import invalid_argument
    return invalid_argument(message)


class Export:
    """A table's rows: keys (uint64, ascending for an export), weights (float32 [n, dim]),
    state (name -> float32 array, empty for weights only), config (the table's config
    dict), table and checkpoint (the names an export records)."""

    def __init__(self, keys, weights, state, config, table=None, checkpoint=None):
        self.keys = keys
        self.weights = weights
        self.state = state
        self.config = config
        self.table = table
        self.checkpoint = checkpoint

    def __len__(self):
        return len(self.keys)

    def __repr__(self):
        return (f"ember.Export(table={self.table!r}, rows={len(self.keys)}, "
                f"dim={self.weights.shape[1]}, state={sorted(self.state)})")


def read_export(directory, mmap=False):
    """The arrays an export wrote in directory, as an Export; with mmap, the arrays are
    mapped read-only instead of read (for tables larger than memory)."""
    manifest_path = os.path.join(directory, "export.json")
    try:
        with open(manifest_path) as handle:
            manifest = json.load(handle)
    except (OSError, ValueError) as error:
        raise _error(f"{manifest_path}: {error}") from None
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("arrays"), dict):
        raise _error(f"{manifest_path}: not an ember export's manifest")
    mode = "r" if mmap else None
    arrays = {}
    for name, file in manifest["arrays"].items():
        path = os.path.join(directory, file)
        try:
            arrays[name] = np.load(path, mmap_mode=mode, allow_pickle=False)
        except (OSError, ValueError) as error:
            raise _error(f"{path}: {error}") from None
    if "keys" not in arrays or "weights" not in arrays:
        raise _error(f"{manifest_path}: names no keys or no weights array")
    keys, weights = arrays.pop("keys"), arrays.pop("weights")
    return Export(keys, weights, arrays, manifest.get("config"), manifest.get("table"),
                  manifest.get("checkpoint"))


def _checked_state(state, config, rows, dim):
    optimizer = (config.get("optimizer") or {}).get("type", "sgd")
    if optimizer not in STATE_ARRAYS:
        raise _error(f"config: unknown optimizer type {optimizer!r}")
    expected = STATE_ARRAYS[optimizer]
    unknown = sorted(set(state) - set(expected))
    if unknown:
        raise _error(f"state: {unknown} are not {optimizer}'s (it keeps {sorted(expected)})")
    if state and set(state) != set(expected):
        raise _error(f"state: {optimizer} keeps {sorted(expected)}; give all of them or none")
    checked = {}
    for name, array in state.items():
        width = expected[name] or dim
        shape = (rows,) if width == 1 else (rows, width)
        array = np.asarray(array)
        if array.dtype != np.float32 or array.shape != shape:
            raise _error(f"state[{name!r}]: expected float32 of shape {shape}, got "
                         f"{array.dtype} of shape {array.shape}")
        checked[name] = array
    return checked


def write_export(directory, keys, weights, config, state=None):
    """Writes keys (uint64 [n]), weights (float32 [n, dim]) and optionally the optimizer's
    state (name -> float32 array, see STATE_ARRAYS) into directory (created, or empty) in
    an export's layout, with config (the table's config dict, as create_table takes it).
    `emberctl checkpoints import` then checks every value and writes the checkpoint."""
    keys = np.asarray(keys)
    weights = np.asarray(weights)
    if keys.dtype != np.uint64 or keys.ndim != 1:
        raise _error(f"keys: expected uint64 of one dimension, got {keys.dtype} of shape "
                     f"{keys.shape} (convert with keys.astype(np.uint64))")
    dim = config.get("dim")
    if weights.dtype != np.float32 or weights.shape != (len(keys), dim):
        raise _error(f"weights: expected float32 of shape ({len(keys)}, {dim}), got "
                     f"{weights.dtype} of shape {weights.shape}")
    state = _checked_state(state or {}, config, len(keys), dim)
    os.makedirs(directory, exist_ok=True)
    if os.listdir(directory):
        raise _error(f"{directory} is not empty: an export goes into a new or empty directory")
    arrays = {"keys": keys, "weights": weights, **state}
    for name, array in arrays.items():
        np.save(os.path.join(directory, name + ".npy"), np.ascontiguousarray(array))
    manifest = {"format": FORMAT, "version": VERSION, "table": config.get("name"),
                "rows": len(keys), "weights_only": not state,
                "arrays": {name: name + ".npy" for name in arrays}, "config": config}
    with open(os.path.join(directory, "export.json"), "w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.write("\n")
