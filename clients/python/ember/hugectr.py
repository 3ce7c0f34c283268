"""HugeCTR datasets: Norm and Raw files read into CSR batches per slot (the parsing is in
C, ember._ember), and written.

    reader = NormReader("train/file_list.txt", batch_size=4096, key_type="u32")
    for batch in reader:
        batch.labels        # float32 [n, label_dim]
        batch.dense         # float32 [n, dense_dim]
        batch.slot(3)       # (offsets uint32 [n + 1], keys uint64): slot 3's CSR
        batch.kjt(names)    # an ember.torch.KeyedJaggedTensor, one feature per slot

Norm: a file list (its first line the number of files, then one path per line, relative
paths taken from the list's directory) of data files, each a 64-byte header (int64
error_check, number_of_records, label_dim, dense_dim, slot_num, 3 reserved) and its
samples: label and dense floats, then per slot an int32 nnz and nnz keys (uint32 or
uint64: key_type says which). error_check 1 frames each sample with an int32 length
and a check byte (the sum of the sample's bytes modulo 256). Raw: one file of
fixed-size samples, label_dim + dense_dim int32 values (float32 with
float_label_dense) and one uint32 key per slot.

slot_size_array (optional, as HugeCTR's): slot i's keys must lie in [0, size[i]) and get
size[0] + ... + size[i-1] added, so the slots share one key space without collisions.

A damaged file is refused with ember.Error (status DATA_LOSS) naming the file, the
sample and the field; batches continue across file boundaries.
"""
import os

import numpy as np

from . import _ember, Error, invalid_argument

__all__ = ["Batch", "NormReader", "RawReader", "read_file_list", "write_file_list",
           "write_norm", "write_raw"]

KEY_TYPES = {"u32": 4, "u64": 8}


def _data_loss(message):
    error = Error(message)
    error.status, error.message = "DATA_LOSS", message
    return error


class Batch:
    """Samples of a dataset: labels, dense, and per slot a CSR of keys (slot-major:
    lengths [slot_num, n], keys of slot 0's samples, then slot 1's ...)."""

    def __init__(self, labels, dense, lengths, keys):
        self.labels, self.dense, self.lengths, self.keys = labels, dense, lengths, keys
        self.slot_num, self.size = lengths.shape
        self._slot_starts = np.zeros(self.slot_num + 1, dtype=np.int64)
        np.cumsum(lengths.sum(axis=1, dtype=np.int64), out=self._slot_starts[1:])

    def __len__(self):
        return self.size

    def slot(self, index):
        """(offsets uint32 [n + 1], keys uint64) of one slot, ready for Client.pull."""
        offsets = np.zeros(self.size + 1, dtype=np.uint32)
        np.cumsum(self.lengths[index], out=offsets[1:])
        begin, end = self._slot_starts[index], self._slot_starts[index + 1]
        return offsets, self.keys[begin:end]

    def kjt(self, feature_names=None):
        """The sparse part as an ember.torch.KeyedJaggedTensor (feature i = slot i)."""
        import torch
        from .torch import KeyedJaggedTensor
        names = feature_names or [f"slot_{i}" for i in range(self.slot_num)]
        if len(names) != self.slot_num:
            raise invalid_argument(
                f"feature_names: {len(names)} names for {self.slot_num} slots")
        return KeyedJaggedTensor.from_lengths_sync(
            names, torch.from_numpy(self.keys.view(np.int64)),
            torch.from_numpy(self.lengths.reshape(-1).astype(np.int64)), stride=self.size)


def _batch_from(raw, label_dim, dense_dim, slot_num):
    count, labels, dense, lengths, keys = raw
    return Batch(np.frombuffer(labels, np.float32).reshape(count, label_dim),
                 np.frombuffer(dense, np.float32).reshape(count, dense_dim),
                 np.frombuffer(lengths, np.uint32).reshape(slot_num, count),
                 np.frombuffer(keys, np.uint64))


def _concatenate(batches):
    if len(batches) == 1:
        return batches[0]
    slot_num = batches[0].slot_num
    keys = [batch.keys[batch._slot_starts[s]:batch._slot_starts[s + 1]]
            for s in range(slot_num) for batch in batches]
    return Batch(np.concatenate([batch.labels for batch in batches]),
                 np.concatenate([batch.dense for batch in batches]),
                 np.concatenate([batch.lengths for batch in batches], axis=1),
                 np.concatenate(keys) if keys else np.zeros(0, np.uint64))


def read_file_list(path):
    """The data files of a Norm file list (first line: their number)."""
    with open(path) as handle:
        lines = [line.strip() for line in handle if line.strip()]
    if not lines:
        raise _data_loss(f"{path}: line 1: empty file list (expected the number of files)")
    try:
        count = int(lines[0])
    except ValueError:
        raise _data_loss(f"{path}: line 1: expected the number of files, got {lines[0]!r}") \
            from None
    files = lines[1:]
    if count != len(files):
        raise _data_loss(f"{path}: line 1: says {count} files, the list names {len(files)}")
    directory = os.path.dirname(os.path.abspath(path))
    return [name if os.path.isabs(name) else os.path.join(directory, name) for name in files]


def write_file_list(path, files):
    directory = os.path.dirname(os.path.abspath(path))
    with open(path, "w") as handle:
        handle.write(f"{len(files)}\n")
        for name in files:
            handle.write(os.path.relpath(os.path.abspath(name), directory) + "\n")


class _SlotOffsets:
    def __init__(self, slot_size_array, slot_num):
        sizes = np.asarray(slot_size_array, dtype=np.uint64)
        if sizes.size != slot_num:
            raise invalid_argument(
                f"slot_size_array: {sizes.size} sizes for {slot_num} slots")
        self.sizes = sizes
        self.offsets = np.concatenate([np.zeros(1, np.uint64), np.cumsum(sizes)[:-1]])

    def apply(self, batch, path, first_sample):
        for slot in range(batch.slot_num):
            begin, end = batch._slot_starts[slot], batch._slot_starts[slot + 1]
            keys = batch.keys[begin:end]
            if keys.size and keys.max() >= self.sizes[slot]:
                position = int(np.argmax(keys >= self.sizes[slot]))
                owner = np.searchsorted(np.cumsum(batch.lengths[slot]), position, side="right")
                raise _data_loss(
                    f"{path}: sample {first_sample + int(owner)}: slot {slot}: key "
                    f"{int(keys[position])} is outside slot_size_array[{slot}] = "
                    f"{int(self.sizes[slot])}")
        keys = batch.keys.copy()
        for slot in range(batch.slot_num):
            keys[batch._slot_starts[slot]:batch._slot_starts[slot + 1]] += self.offsets[slot]
        return Batch(batch.labels, batch.dense, batch.lengths, keys)


class _Reader:
    """Batches over a sequence of opened files, continuing across their boundaries."""

    def __init__(self, batch_size, slot_size_array):
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise invalid_argument(f"batch_size: expected a positive int, got {batch_size!r}")
        self.batch_size = batch_size
        self._slot_size_array = slot_size_array

    def _files(self):
        raise NotImplementedError

    def __iter__(self):
        pending, pending_size = [], 0
        offsets = None
        for path, opened, dims in self._files():
            if self._slot_size_array is not None and offsets is None:
                offsets = _SlotOffsets(self._slot_size_array, dims[2])
            while True:
                first = opened.next_sample
                raw = opened.read(self.batch_size - pending_size)
                if raw[0] == 0:
                    break
                batch = _batch_from(raw, *dims)
                if offsets is not None:
                    batch = offsets.apply(batch, path, first)
                pending.append(batch)
                pending_size += batch.size
                if pending_size == self.batch_size:
                    yield _concatenate(pending)
                    pending, pending_size = [], 0
        if pending:
            yield _concatenate(pending)


class NormReader(_Reader):
    """Batches of HugeCTR Norm files. source: a file list path, or a list of data files.
    key_type: "u32" or "u64" (the files do not say). slot_num, label_dim, dense_dim:
    when given, every file's header must agree (otherwise the first file's header sets
    them and the others must agree with it)."""

    def __init__(self, source, batch_size, key_type="u32", slot_num=None, label_dim=None,
                 dense_dim=None, slot_size_array=None):
        super().__init__(batch_size, slot_size_array)
        if key_type not in KEY_TYPES:
            raise invalid_argument(f"key_type: expected u32 or u64, got {key_type!r}")
        self.key_bytes = KEY_TYPES[key_type]
        self.paths = read_file_list(source) if isinstance(source, str) else list(source)
        if not self.paths:
            raise invalid_argument("source: no data files")
        self.expected = {"slot_num": slot_num, "label_dim": label_dim, "dense_dim": dense_dim}

    def _files(self):
        expected = dict(self.expected)
        for path in self.paths:
            opened = _ember.NormFile(path, self.key_bytes)
            header = opened.header
            for field in ("slot_num", "label_dim", "dense_dim"):
                if expected[field] is None:
                    expected[field] = header[field]
                elif header[field] != expected[field]:
                    raise _data_loss(
                        f"{path}: header: {field} is {header[field]}, expected "
                        f"{expected[field]}" + (" (slot count mismatch)" if field == "slot_num"
                                                else ""))
            yield path, opened, (header["label_dim"], header["dense_dim"], header["slot_num"])

    def records(self):
        """Samples in all the files (from their headers)."""
        return sum(_ember.NormFile(path, self.key_bytes).header["records"]
                   for path in self.paths)


class RawReader(_Reader):
    """Batches of HugeCTR Raw files (one-hot: one uint32 key per slot per sample)."""

    def __init__(self, source, batch_size, label_dim=1, dense_dim=13, slot_num=26,
                 float_label_dense=False, slot_size_array=None):
        super().__init__(batch_size, slot_size_array)
        self.paths = [source] if isinstance(source, str) else list(source)
        self.dims = (label_dim, dense_dim, slot_num)
        self.float_label_dense = float_label_dense

    def _files(self):
        for path in self.paths:
            yield path, _ember.RawFile(path, *self.dims, self.float_label_dense), self.dims

    def records(self):
        return sum(_ember.RawFile(path, *self.dims, self.float_label_dense).records
                   for path in self.paths)


def _check(array, name, dtype, shape):
    array = np.ascontiguousarray(array, dtype=dtype)
    if array.shape != shape:
        raise invalid_argument(f"{name}: expected shape {shape}, got {array.shape}")
    return array


def write_norm(path, labels, dense, lengths, keys, key_type="u32", checksum=False):
    """Writes a Norm file: labels [n, label_dim], dense [n, dense_dim], lengths
    [slot_num, n] and keys slot-major (as Batch holds them)."""
    if key_type not in KEY_TYPES:
        raise invalid_argument(f"key_type: expected u32 or u64, got {key_type!r}")
    labels = np.asarray(labels, dtype=np.float32)
    if labels.ndim == 1:
        labels = labels[:, None]
    count = labels.shape[0]
    dense = np.asarray(dense, dtype=np.float32)
    if dense.ndim != 2 or dense.shape[0] != count:
        raise invalid_argument(f"dense: expected [{count}, dense_dim], got {dense.shape}")
    lengths = np.asarray(lengths)
    if lengths.ndim != 2 or lengths.shape[1] != count:
        raise invalid_argument(f"lengths: expected [slot_num, {count}], got {lengths.shape}")
    lengths = _check(lengths, "lengths", np.uint32, lengths.shape)
    keys = _check(keys, "keys", np.uint64, (int(lengths.sum()),))
    if key_type == "u32" and keys.size and keys.max() > 0xFFFFFFFF:
        raise invalid_argument(f"keys: {int(keys.max())} does not fit key_type u32")
    _ember.norm_write(path, count, labels.shape[1], dense.shape[1], lengths.shape[0],
                      KEY_TYPES[key_type], bool(checksum), np.ascontiguousarray(labels),
                      np.ascontiguousarray(dense), lengths, keys)


def write_raw(path, labels, dense, keys, float_label_dense=False):
    """Writes a Raw file: labels [n, label_dim], dense [n, dense_dim], keys [n, slot_num]
    (one uint32 key per slot)."""
    labels = np.asarray(labels)
    if labels.ndim == 1:
        labels = labels[:, None]
    count = labels.shape[0]
    dense, keys = np.asarray(dense), np.asarray(keys)
    if dense.ndim != 2 or dense.shape[0] != count:
        raise invalid_argument(f"dense: expected [{count}, dense_dim], got {dense.shape}")
    if keys.ndim != 2 or keys.shape[0] != count:
        raise invalid_argument(f"keys: expected [{count}, slot_num], got {keys.shape}")
    if keys.size and (keys.min() < 0 or keys.max() > 0xFFFFFFFF):
        raise invalid_argument("keys: Raw keys are uint32")
    value_type = np.float32 if float_label_dense else np.int32
    record = np.concatenate([labels.astype(value_type).view(np.uint32),
                             dense.astype(value_type).view(np.uint32),
                             keys.astype(np.uint32)], axis=1)
    record.astype("<u4").tofile(path)
