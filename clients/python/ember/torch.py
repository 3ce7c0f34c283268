"""ember.torch: embedding tables that live in emberd, as PyTorch modules.

The input is a KeyedJaggedTensor (TorchRec's layout and field names: per feature, the
values of every sample plus lengths or offsets, feature-major, optional per-value
weights). EmbeddingBagCollection pulls pooled rows in forward (pooled by the server with
SUM / MEAN / SQRTN) and in backward pushes the pooled gradient, which the server applies
with the table's optimizer: the module has no local parameters and the trainer ships
only gradients. EmbeddingCollection is the sequence variant (one vector per key).

Keys are deduplicated per table before the wire when that moves fewer bytes: then the
distinct keys' rows are pulled once and pooled here, and backward pushes one summed
gradient per distinct key; the server's result is the same (it sums a key's gradients
before applying them either way).

Prefetch (PrefetchPipeline): the pull of batch i+1 is issued while batch i computes.
With staleness=0 (the default) it is issued right after the push of batch i, on the same
connection; a connection's requests take effect in order, so batch i+1 reads rows that
include step i's update, exactly as the loop without prefetch. With staleness=1 it is
issued before batch i's forward: more of the wait is hidden, and rows that batch i also
updated are read without step i's update (one step stale).
"""
import queue
import threading

import numpy as np
import torch

from . import Client, Error, invalid_argument  # noqa: F401 (re-exported for users)

__all__ = ["KeyedJaggedTensor", "KeyedTensor", "JaggedTensor", "EmbeddingBagConfig",
           "EmbeddingConfig", "EmbeddingBagCollection", "EmbeddingCollection",
           "PrefetchPipeline"]

POOLINGS = ("sum", "mean", "sqrtn")
# pushes sent and not yet finished, per table, before their answers are collected
PUSHES_KEPT_PER_TABLE = 8


def _as_int64(tensor, name):
    if not isinstance(tensor, torch.Tensor):
        tensor = torch.as_tensor(tensor)
    if tensor.dtype not in (torch.int32, torch.int64):
        raise invalid_argument(f"{name}: expected an integer tensor, got {tensor.dtype}")
    if tensor.dim() != 1:
        raise invalid_argument(f"{name}: expected 1-D, got shape {tuple(tensor.shape)}")
    return tensor.to(torch.int64)


class JaggedTensor:
    """One feature's jagged values: values [nnz(, dim)] with lengths per sample."""

    def __init__(self, values, lengths, weights=None):
        self._values, self._lengths, self._weights = values, lengths, weights

    def values(self):
        return self._values

    def lengths(self):
        return self._lengths

    def offsets(self):
        return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(self._lengths, 0)])

    def weights_or_none(self):
        return self._weights

    def to_dense(self):
        """A list with each sample's values."""
        return list(torch.split(self._values, self._lengths.tolist()))


class KeyedJaggedTensor:
    """Sparse features of a batch, TorchRec's layout: keys (feature names); values
    (int64, feature-major: feature 0's keys for samples 0..B-1, then feature 1's ...);
    lengths [len(keys) * B] or offsets [len(keys) * B + 1]; optional weights (float, one
    per value) for weighted pooling."""

    def __init__(self, keys, values, weights=None, lengths=None, offsets=None, stride=None):
        self._keys = list(keys)
        self._values = _as_int64(values, "values")
        if (lengths is None) == (offsets is None):
            raise invalid_argument("KeyedJaggedTensor: give lengths or offsets (one of them)")
        if lengths is not None:
            self._lengths = _as_int64(lengths, "lengths")
        else:
            offsets = _as_int64(offsets, "offsets")
            if offsets.numel() == 0 or offsets[0] != 0:
                raise invalid_argument("offsets: must start at 0")
            self._lengths = offsets[1:] - offsets[:-1]
        if (self._lengths < 0).any():
            raise invalid_argument("lengths: negative length")
        if int(self._lengths.sum()) != self._values.numel():
            raise invalid_argument(
                f"lengths: sum to {int(self._lengths.sum())} but values has "
                f"{self._values.numel()} entries")
        if self._keys and self._lengths.numel() % len(self._keys):
            raise invalid_argument(
                f"lengths: {self._lengths.numel()} entries are not {len(self._keys)} features "
                f"x a batch size")
        self._stride = stride if stride is not None else (
            self._lengths.numel() // len(self._keys) if self._keys else 0)
        if (self._values < 0).any():
            raise invalid_argument("values: keys are ids >= 0")
        if weights is not None:
            weights = torch.as_tensor(weights, dtype=torch.float32)
            if weights.shape != self._values.shape:
                raise invalid_argument(
                    f"weights: expected one per value ({self._values.numel()}), got shape "
                    f"{tuple(weights.shape)}")
        self._weights = weights
        self._length_per_key = self._offset_per_key = None

    @staticmethod
    def from_lengths_sync(keys, values, lengths, weights=None, stride=None):
        return KeyedJaggedTensor(keys, values, weights=weights, lengths=lengths, stride=stride)

    @staticmethod
    def from_offsets_sync(keys, values, offsets, weights=None, stride=None):
        return KeyedJaggedTensor(keys, values, weights=weights, offsets=offsets, stride=stride)

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def weights(self):
        if self._weights is None:
            raise invalid_argument("this KeyedJaggedTensor has no weights")
        return self._weights

    def weights_or_none(self):
        return self._weights

    def lengths(self):
        return self._lengths

    def offsets(self):
        return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(self._lengths, 0)])

    def stride(self):
        """The batch size."""
        return self._stride

    def length_per_key(self):
        if self._length_per_key is None:
            self._length_per_key = (self._lengths.view(len(self._keys), self._stride).sum(1)
                                    .tolist())
        return self._length_per_key

    def offset_per_key(self):
        if self._offset_per_key is None:
            self._offset_per_key = [0] + np.cumsum(self.length_per_key()).tolist()
        return self._offset_per_key

    def __getitem__(self, key):
        index = self._keys.index(key)
        begin, end = self.offset_per_key()[index], self.offset_per_key()[index + 1]
        lengths = self._lengths[index * self._stride:(index + 1) * self._stride]
        weights = None if self._weights is None else self._weights[begin:end]
        return JaggedTensor(self._values[begin:end], lengths, weights)

    def to_dict(self):
        return {key: self[key] for key in self._keys}


class KeyedTensor:
    """Pooled embeddings: values [B, sum of dims], one block of columns per key."""

    def __init__(self, keys, length_per_key, values):
        self._keys, self._length_per_key, self._values = list(keys), list(length_per_key), values

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def length_per_key(self):
        return self._length_per_key

    def to_dict(self):
        return dict(zip(self._keys, torch.split(self._values, self._length_per_key, dim=1)))


class EmbeddingBagConfig:
    """One ember table and the features that look it up (TorchRec's field names).
    pooling: "sum", "mean" or "sqrtn", done by the server. optimizer and initializer:
    ember table config objects, used when the collection creates the table."""

    def __init__(self, name, embedding_dim, num_embeddings, feature_names, pooling="sum",
                 optimizer=None, initializer=None, shards=0, extra=None):
        if pooling not in POOLINGS:
            raise invalid_argument(
                f"pooling: expected one of {', '.join(POOLINGS)}, got {pooling!r}")
        if not feature_names:
            raise invalid_argument(f"table {name!r}: feature_names is empty")
        self.name, self.embedding_dim, self.num_embeddings = name, embedding_dim, num_embeddings
        self.feature_names, self.pooling = list(feature_names), pooling
        self.optimizer, self.initializer, self.shards = optimizer, initializer, shards
        self.extra = dict(extra or {})

    def table_config(self):
        config = {"name": self.name, "dim": self.embedding_dim,
                  "capacity": self.num_embeddings, "shards": self.shards}
        if self.optimizer is not None:
            config["optimizer"] = self.optimizer
        if self.initializer is not None:
            config["initializer"] = self.initializer
        config.update(self.extra)
        return config


class EmbeddingConfig(EmbeddingBagConfig):
    """A table for EmbeddingCollection (one vector per key, no pooling)."""

    def __init__(self, name, embedding_dim, num_embeddings, feature_names, **options):
        super().__init__(name, embedding_dim, num_embeddings, feature_names, "sum", **options)
        self.pooling = "none"


# ---- the per-table plan of one batch -------------------------------------------------


class _TableBatch:
    """One table's part of a batch: its features' rows (feature-major), as CSR, and how
    it goes on the wire: pooled by the server, or distinct keys pooled here."""

    def __init__(self, config, kjt, dedup):
        features = kjt.keys()
        stride = kjt.stride()
        key_offsets = kjt.offset_per_key()
        all_lengths, all_values = kjt.lengths().numpy(), kjt.values().numpy()
        lengths, values, weights = [], [], []
        for feature in config.feature_names:
            if feature not in features:
                raise invalid_argument(
                    f"table {config.name!r}: feature {feature!r} is not in the batch "
                    f"(features: {', '.join(features)})")
            index = features.index(feature)
            lengths.append(all_lengths[index * stride:(index + 1) * stride])
            values.append(all_values[key_offsets[index]:key_offsets[index + 1]])
            if kjt.weights_or_none() is not None:
                weights.append(kjt.weights()[key_offsets[index]:key_offsets[index + 1]])
        self.config = config
        self.rows = len(config.feature_names) * stride
        lengths = lengths[0] if len(lengths) == 1 else np.concatenate(lengths)
        self.lengths = torch.from_numpy(lengths)
        self.offsets = np.zeros(self.rows + 1, dtype=np.uint32)
        np.cumsum(lengths, out=self.offsets[1:])
        # keys are ids >= 0 (KeyedJaggedTensor checks): int64 read as uint64 in place
        values = values[0] if len(values) == 1 else np.concatenate(values)
        self.keys = np.ascontiguousarray(values).view(np.uint64)
        self.weights = torch.cat(weights) if weights else None
        pooled = config.pooling != "none"
        self.local = not pooled or self.weights is not None
        self.unique = None
        if self.local or dedup is True or (dedup == "auto" and self._dedup_saves_bytes()):
            self.unique, inverse = np.unique(self.keys, return_inverse=True)
            self.inverse = torch.from_numpy(inverse.astype(np.int64))
            self.unique_offsets = np.array([0, self.unique.size], dtype=np.uint32)
            self.local = True

    @property
    def vectors(self):
        """Output vectors: one per row pooled, one per key otherwise."""
        return self.keys.size if self.config.pooling == "none" else self.rows

    def _dedup_saves_bytes(self):
        dim, nnz, rows = self.config.embedding_dim, self.keys.size, self.rows
        if nnz == 0:
            return False
        # an estimate of the distinct keys from a sample keeps this cheap
        sample = self.keys[:: max(1, nnz // 4096)]
        distinct = nnz * np.unique(sample).size / sample.size
        pooled_bytes = 8 * nnz + 4 * (rows + 1) + 4 * dim * rows * 2  # keys, offsets, rows, grads
        dedup_bytes = 8 * distinct * 2 + 4 * dim * distinct * 2 + 8 * nnz  # + the local index
        return dedup_bytes < pooled_bytes

    # -- forward

    def start_pull(self, client, create_missing):
        # the arrays are built here, well-formed: the client's own checks (in C) suffice
        if self.local:
            return client._pull_async_prepared(self.config.name, self.unique_offsets,
                                               self.unique, "none", create_missing,
                                               self.unique.size)
        return client._pull_async_prepared(self.config.name, self.offsets, self.keys,
                                           self.config.pooling, create_missing, self.rows)

    def _scale(self):
        """Each value's factor in its row's pool (weights, 1/len, 1/sqrt(len))."""
        counts = self.lengths.to(torch.float32)
        per_value = torch.repeat_interleave(counts, self.lengths)
        scale = self.weights.clone() if self.weights is not None else torch.ones(self.keys.size)
        if self.config.pooling == "mean":
            scale = scale / per_value
        elif self.config.pooling == "sqrtn":
            scale = scale / torch.sqrt(per_value)
        return scale

    def finish_pull(self, future):
        rows = torch.from_numpy(future.result())
        if not self.local:
            return rows
        vectors = rows[self.inverse]
        if self.config.pooling == "none":
            return vectors
        row_of_value = torch.repeat_interleave(torch.arange(self.rows), self.lengths)
        pooled = torch.zeros(self.rows, self.config.embedding_dim)
        return pooled.index_add_(0, row_of_value, vectors * self._scale()[:, None])

    # -- backward

    def start_push(self, client, grads):
        grads = grads.detach().to(torch.float32).contiguous()
        if not self.local:
            return client._push_async_prepared(self.config.name, self.offsets, self.keys,
                                               grads.numpy(), self.config.pooling)
        if self.config.pooling == "none":
            per_value = grads
        else:
            row_of_value = torch.repeat_interleave(torch.arange(self.rows), self.lengths)
            per_value = grads[row_of_value] * self._scale()[:, None]
        summed = torch.zeros(self.unique.size, self.config.embedding_dim)
        summed.index_add_(0, self.inverse, per_value)
        return client._push_async_prepared(self.config.name, self.unique_offsets, self.unique,
                                           summed.numpy(), "none")


class _Batch:
    """A batch's per-table plans and, once issued, their pulls in flight. Prefetched by
    the background worker: ready is set when its outputs (or its error) are there."""

    def __init__(self, kjt, plans):
        self.kjt, self.plans, self.futures = kjt, plans, None
        self.ready, self.outputs, self.error = None, None, None


class _Worker:
    """One thread that runs a collection's network work in order: pushes, then the
    prefetch of the next batch (planning, sending, waiting, converting), so that this
    Python work overlaps the trainer's compute (torch releases the GIL while it
    computes, the client while it waits). Requests keep the order they were queued in,
    on the same connection, so the staleness rule is unchanged."""

    def __init__(self):
        self.tasks = queue.Queue()
        self.pushes = []  # futures of pushes sent, touched by the thread only
        self.error = None
        self.thread = threading.Thread(target=self._run, name="ember-prefetch", daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            task = self.tasks.get()
            try:
                task()
            except BaseException as error:  # noqa: B902 (raised in the trainer's thread)
                if self.error is None:
                    self.error = error

    def submit(self, task):
        self.raise_error()
        self.tasks.put(task)

    def raise_error(self):
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def wait(self):
        """Waits for the tasks queued so far and the pushes they sent."""
        done = threading.Event()

        def finish_pushes():
            pushes, self.pushes = self.pushes, []
            try:
                for future in pushes:
                    future.result()
            finally:
                done.set()
        self.tasks.put(finish_pushes)
        done.wait()
        self.raise_error()


class _Collection(torch.nn.Module):
    def __init__(self, tables, client, create_tables, dedup):
        super().__init__()
        if not isinstance(client, Client):
            raise invalid_argument(f"client: expected an ember.Client, got {type(client).__name__}")
        names = [table.name for table in tables]
        if len(set(names)) != len(names):
            raise invalid_argument(f"tables: names repeat: {names}")
        self.tables, self.client, self.dedup = list(tables), client, dedup
        self._anchor = torch.empty(0, requires_grad=True)
        self._pushes = []
        self._prefetched = {}
        self._next = None
        self._worker = None
        if create_tables:
            existing = {table["name"] for table in client.tables()}
            for table in self.tables:
                if table.name not in existing:
                    client.create_table(config=table.table_config())
        for table in self.tables:
            dim = client.dim(table.name)
            if dim != table.embedding_dim:
                raise invalid_argument(
                    f"table {table.name!r}: embedding_dim {table.embedding_dim} but the server's "
                    f"table has dim {dim}")

    def _plan(self, kjt):
        return _Batch(kjt, [_TableBatch(table, kjt, self.dedup) for table in self.tables])

    def _issue(self, batch):
        if batch.futures is None:
            # training creates the keys it meets; evaluation (module.eval()) reads
            # unseen keys as zeros and stores nothing
            batch.futures = [plan.start_pull(self.client, self.training)
                             for plan in batch.plans]

    def prefetch(self, kjt):
        """Issues the pulls of the batch kjt now (in background mode: queues them);
        forward(kjt) then uses them."""
        if self._worker is None:
            batch = self._plan(kjt)
            self._issue(batch)
            self._prefetched[id(kjt)] = batch
            return
        batch = _Batch(kjt, None)
        batch.ready = threading.Event()
        self._prefetched[id(kjt)] = batch

        def pull():
            try:
                batch.plans = [_TableBatch(table, kjt, self.dedup) for table in self.tables]
                self._issue(batch)
                batch.outputs = self._assemble(kjt, [
                    plan.finish_pull(future) for plan, future in zip(batch.plans, batch.futures)])
            except BaseException as error:  # noqa: B902 (raised by forward)
                batch.error = error
            finally:
                batch.ready.set()
        self._worker.submit(pull)

    def background(self, enabled=True):
        """Background mode: pushes and prefetches run on a thread of their own."""
        if enabled and self._worker is None:
            self._worker = _Worker()
        elif not enabled and self._worker is not None:
            self.flush()
            self._worker = None

    def prefetch_after_push(self, kjt):
        """Issues the pulls of kjt right after the next backward's push (exact
        prefetch: they see that push)."""
        self._next = kjt

    def _pull(self, batch):
        if batch.ready is not None:
            batch.ready.wait()
            if batch.error is not None:
                raise batch.error
            outputs, batch.outputs = batch.outputs, None
            return outputs
        self._issue(batch)
        return self._assemble(batch.kjt, [plan.finish_pull(future)
                                          for plan, future in zip(batch.plans, batch.futures)])

    def _assemble(self, kjt, outputs):
        """The module's output from the tables' outputs (in the worker thread, when
        there is one); the subclasses say how."""
        return tuple(outputs)

    def _split(self, kjt, grads):
        """The tables' gradients from the output's gradient: the inverse of _assemble."""
        return grads

    def _push(self, batch, grads):
        if self._worker is None:
            for plan, grad in zip(batch.plans, self._split(batch.kjt, grads)):
                self._pushes.append(plan.start_push(self.client, grad))
        else:
            worker = self._worker

            def push():
                for plan, grad in zip(batch.plans, self._split(batch.kjt, grads)):
                    worker.pushes.append(plan.start_push(self.client, grad))
                if len(worker.pushes) > PUSHES_KEPT_PER_TABLE * len(self.tables):
                    pushes, worker.pushes = worker.pushes, []
                    for future in pushes:
                        future.result()
            worker.submit(push)
        if self._next is not None:
            self.prefetch(self._next)
            self._next = None

    def flush(self):
        """Waits for the pushes sent so far (raising their errors)."""
        if self._worker is not None:
            self._worker.wait()
        pushes, self._pushes = self._pushes, []
        for future in pushes:
            future.result()

    def _lookup(self, kjt):
        # pushes are not waited for (the connection applies requests in order); their
        # answers are collected, and their errors raised, every few batches
        if len(self._pushes) > PUSHES_KEPT_PER_TABLE * len(self.tables):
            self.flush()
        batch = self._prefetched.pop(id(kjt), None)
        if batch is None or batch.kjt is not kjt:
            batch = self._plan(kjt)
        return batch, _LookupMany.apply(self._anchor, self, batch)


class _LookupMany(torch.autograd.Function):
    """The lookup of every table of a collection: forward pulls (the collection's
    output: one tensor, or one per table), backward pushes. The anchor is an empty
    tensor that requires grad, so that autograd calls backward although the module has
    no parameters."""

    @staticmethod
    def forward(ctx, anchor, collection, batch):
        ctx.collection, ctx.batch = collection, batch
        outputs = collection._pull(batch)
        ctx.shapes = [output.shape for output in
                      (outputs if isinstance(outputs, tuple) else (outputs,))]
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        grads = [grad if grad is not None else torch.zeros(shape)
                 for grad, shape in zip(grads, ctx.shapes)]
        ctx.collection._push(ctx.batch, grads)
        return None, None, None


class EmbeddingBagCollection(_Collection):
    """Pooled embeddings of ember tables: forward(kjt) -> KeyedTensor [B, sum of dims],
    one block per feature in the tables' order; backward pushes the gradients. tables:
    EmbeddingBagConfig list; create_tables: create the tables that do not exist (needs
    the client's admin listener); dedup: "auto" (when it moves fewer bytes), True, False."""

    def __init__(self, tables, client, create_tables=False, dedup="auto"):
        super().__init__(tables, client, create_tables, dedup)
        self._keys = [feature for table in self.tables for feature in table.feature_names]
        self._dims = [table.embedding_dim for table in self.tables
                      for _ in table.feature_names]

    def _assemble(self, kjt, outputs):
        """[B, sum of dims]: each feature's rows of its table's output, side by side."""
        stride = kjt.stride()
        return torch.cat([rows[index * stride:(index + 1) * stride]
                          for table, rows in zip(self.tables, outputs)
                          for index in range(len(table.feature_names))], dim=1)

    def _split(self, kjt, grads):
        """Per table [features x B, dim]: its features' columns of the gradient, stacked."""
        (grad,) = grads
        result, column = [], 0
        for table in self.tables:
            blocks = []
            for _ in table.feature_names:
                blocks.append(grad[:, column:column + table.embedding_dim])
                column += table.embedding_dim
            result.append(blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=0))
        return result

    def forward(self, kjt):
        _, values = self._lookup(kjt)
        return KeyedTensor(self._keys, self._dims, values)


class EmbeddingCollection(_Collection):
    """The sequence variant: forward(kjt) -> {feature: JaggedTensor} with one vector per
    key (values [nnz, dim]); backward pushes per-key gradients."""

    def __init__(self, tables, client, create_tables=False, dedup="auto"):
        for table in tables:
            table.pooling = "none"
        super().__init__(tables, client, create_tables, dedup)

    def forward(self, kjt):
        batch, outputs = self._lookup(kjt)
        stride = kjt.stride()
        result = {}
        for table, plan, vectors in zip(self.tables, batch.plans, outputs):
            begin = 0
            for index, feature in enumerate(table.feature_names):
                lengths = plan.lengths[index * stride:(index + 1) * stride]
                count = int(lengths.sum())
                result[feature] = JaggedTensor(vectors[begin:begin + count], lengths)
                begin += count
        return result


class PrefetchPipeline:
    """Iterates over batches while the ember pulls of the next one are in flight.

        pipeline = PrefetchPipeline(loader, [ebc], sparse=lambda batch: batch.sparse)
        for batch in pipeline:
            loss = model(batch); loss.backward(); optimizer.step()

    The pipeline reads one batch ahead. staleness=0 (exact): the next batch's pulls are
    issued by the backward of this one, right after its push, so they see it; the wait
    overlaps the rest of the step (the dense backward, the optimizer, loading, the next
    forward up to the embeddings). staleness=1: they are issued before this batch's
    forward, overlapping the whole step, and miss this step's update. background=True
    moves the pushes and the prefetches (planning, sending, waiting, converting) to a
    thread of the collection's own, so that their Python work overlaps the trainer's
    compute too; the order of requests, and so the staleness rule, is the same."""

    def __init__(self, batches, collections, sparse=lambda batch: batch[0], staleness=0,
                 background=False):
        if staleness not in (0, 1):
            raise invalid_argument(f"staleness: expected 0 or 1, got {staleness!r}")
        self.batches, self.collections = batches, list(collections)
        self.sparse, self.staleness = sparse, staleness
        self.background = background

    def __iter__(self):
        iterator = iter(self.batches)
        try:
            current = next(iterator)
        except StopIteration:
            return
        for collection in self.collections:
            collection.background(self.background)
        for collection in self.collections:
            collection.prefetch(self.sparse(current))
        for upcoming in iterator:
            for collection in self.collections:
                if self.staleness == 1:
                    collection.prefetch(self.sparse(upcoming))
                else:
                    collection.prefetch_after_push(self.sparse(upcoming))
            yield current
            for collection in self.collections:
                kjt = self.sparse(upcoming)
                if id(kjt) not in collection._prefetched:  # no backward ran: issue it now
                    collection._next = None
                    collection.prefetch(kjt)
            current = upcoming
        yield current
        for collection in self.collections:
            collection.flush()
            if self.background:
                collection.background(False)
