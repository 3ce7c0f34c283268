"""ember: the Python client of emberd, the embedding parameter server.

    import numpy as np, ember
    client = ember.Client("127.0.0.1:7070", admin="127.0.0.1:7071", admin_token="...")
    offsets = np.array([0, 2, 3], dtype=np.uint32)      # CSR: 2 rows, 3 keys
    keys = np.array([11, 12, 11], dtype=np.uint64)
    rows = client.pull("demo", offsets, keys, combiner="sum")   # float32 [2, dim]
    client.push("demo", offsets, keys, np.ones_like(rows))      # gradients, server applies

Arrays are numpy arrays of the exact types (offsets uint32, keys uint64, gradients
float32), C-contiguous; they are handed to the C client without a copy, and the answer
is written straight into the returned array. A wrong type, shape or layout is refused
here, before anything is sent, with an ember.Error naming the argument.

Every failure raises ember.Error: `.status` is the status name ("NOT_FOUND",
"UNAVAILABLE", "DEADLINE_EXCEEDED", ...) and `.message` the server's or client's text.
Network waits release the GIL. A Client is safe to share between threads (calls are
serialised on it); for parallel traffic give each thread its own.

Several servers ("h1:7070,h2:7070" or a list): keys are spread by jump consistent hash
and each call is split and reassembled, exactly as the C client does. Admin calls
(tables, create_table, stats, save, erase ...) go to `admin`, the admin listener of one
server, with `admin_token`.

Pipelining: pull_async / push_async return a Future at once (up to `window` requests in
flight per connection); Future.result() waits. A connection's requests take effect in
the order they were issued, so a push followed by a pull on the same Client sees the
push.
"""
import json
import time

import numpy as np

from . import _ember

__all__ = ["Client", "Error", "Future", "PullResult", "PushResult", "COMBINERS", "Export",
           "read_export", "write_export"]

Error = _ember.Error

COMBINERS = {"none": 0, "sum": 1, "mean": 2, "sqrtn": 3}


def _error(status, message):
    error = Error(message)
    error.status = status
    error.message = message
    return error


def invalid_argument(message):
    """An ember.Error with status INVALID_ARGUMENT (for checks made before sending)."""
    return _error("INVALID_ARGUMENT", message)


def _array(value, name, dtype, ndim=None):
    """value as the ndarray itself when it has dtype and is C-contiguous; else refused."""
    if not isinstance(value, np.ndarray):
        raise invalid_argument(
            f"{name}: expected a numpy.ndarray of {np.dtype(dtype).name}, "
            f"got {type(value).__name__}")
    if value.dtype != dtype:
        raise invalid_argument(
            f"{name}: expected dtype {np.dtype(dtype).name}, got {value.dtype.name} "
            f"(convert with {name}.astype(np.{np.dtype(dtype).name}))")
    if ndim is not None and value.ndim not in ndim:
        raise invalid_argument(
            f"{name}: expected {' or '.join(f'{n}-D' for n in ndim)}, got shape {value.shape}")
    if not value.flags.c_contiguous:
        raise invalid_argument(
            f"{name}: must be C-contiguous (use np.ascontiguousarray({name}))")
    return value


def _key_list(values, name):
    """A list or tuple of ints as a uint64 array; anything else in it is refused by index."""
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise invalid_argument(
                f"{name}[{i}]: expected an int key, got {type(value).__name__}")
        if not 0 <= int(value) < 2**64:
            raise invalid_argument(f"{name}[{i}]: key {int(value)} is not in [0, 2^64)")
    return np.array([int(value) for value in values], dtype=np.uint64)


def _combiner(combiner):
    if combiner not in COMBINERS:
        raise invalid_argument(
            f"combiner: expected one of {', '.join(COMBINERS)}, got {combiner!r}")
    return COMBINERS[combiner]


def check_csr(offsets, keys):
    """Checks a CSR batch's arrays (offsets uint32 [rows + 1], keys uint64 [nnz], the
    last offset equal to nnz); returns rows. That offsets start at 0 and never decrease
    is checked by the C client, which names the offset, before anything is sent."""
    offsets = _array(offsets, "offsets", np.uint32, (1,))
    keys = _array(keys, "keys", np.uint64, (1,))
    if offsets.size == 0:
        raise invalid_argument("offsets: expected rows + 1 entries, got none")
    if int(offsets[-1]) != keys.size:
        raise invalid_argument(
            f"offsets: end at {int(offsets[-1])} but keys has {keys.size} entries")
    return offsets.size - 1


def _vectors(rows, nnz, combiner):
    return nnz if combiner == "none" else rows


class PullResult:
    """What a pull reports besides its rows: keys asked once, not found, created."""
    __slots__ = ("dim", "unique_keys", "missing", "created")

    def __init__(self, values):
        self.dim, self.unique_keys, self.missing, self.created = values

    def __repr__(self):
        return (f"PullResult(dim={self.dim}, unique_keys={self.unique_keys}, "
                f"missing={self.missing}, created={self.created})")


class PushResult:
    """Rows a push updated and created, summed over servers."""
    __slots__ = ("updated", "created")

    def __init__(self, values):
        self.updated, self.created = values

    def __repr__(self):
        return f"PushResult(updated={self.updated}, created={self.created})"


class Future:
    """A pipelined pull or push: result() waits for it (GIL released) and returns the
    pulled array or the PushResult, or raises ember.Error. Keeps the request's arrays
    alive until then."""

    def __init__(self, call, finish, arrays):
        self._call = call
        self._finish = finish
        self._arrays = arrays
        self._value = None
        self._error = None
        self._done = False

    def done(self):
        """Whether result() has already run."""
        return self._done

    def result(self):
        if not self._done:
            try:
                self._value = self._finish(self._call.finish())
            except Error as error:
                self._error = error
            self._done = True
            self._call = None
            self._arrays = None
        if self._error is not None:
            raise self._error
        return self._value


def _server_list(servers):
    if isinstance(servers, (list, tuple)):
        servers = ",".join(servers)
    if not isinstance(servers, str) or not servers:
        raise invalid_argument(
            f"servers: expected 'host:port[,host:port...]' or a list of them, got {servers!r}")
    return servers


def _milliseconds(seconds, name):
    if seconds is None:
        return 0
    if not isinstance(seconds, (int, float)) or seconds < 0:
        raise invalid_argument(f"{name}: expected seconds >= 0 or None, got {seconds!r}")
    return int(round(seconds * 1000))


class Client:
    """Connections to one emberd or a list of them (see the module's documentation).

    servers: data listeners, "host:port[,host:port...]" or a list. token: the data
    token, if the servers want one. timeout: seconds per call (None: no limit).
    admin / admin_token: the admin listener used by the admin calls. TLS: tls_ca_file
    (and tls_cert_file + tls_key_file for mutual TLS, tls_server_name to check another
    name than the host dialled)."""

    def __init__(self, servers, token=None, timeout=30.0, *, admin=None, admin_token=None,
                 connect_timeout=5.0, window=64, reconnect_attempts=3, tls_ca_file=None,
                 tls_cert_file=None, tls_key_file=None, tls_server_name=None):
        self._options = dict(timeout_ms=_milliseconds(timeout, "timeout"),
                             connect_timeout_ms=_milliseconds(connect_timeout,
                                                              "connect_timeout"),
                             window=int(window), reconnect_attempts=int(reconnect_attempts),
                             tls_ca_file=tls_ca_file, tls_cert_file=tls_cert_file,
                             tls_key_file=tls_key_file, tls_server_name=tls_server_name)
        self.servers = _server_list(servers)
        self._data = _ember.Client(self.servers, token, **self._options)
        self._admin_address = admin
        self._admin_token = admin_token
        self._admin = None
        self._dims = {}
        self.last_pull = None  # the PullResult of the last blocking pull

    # ---- lifetime -------------------------------------------------------------------

    def close(self):
        self._data.close()
        if self._admin is not None:
            self._admin.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def server_count(self):
        return self._data.server_count()

    # ---- data ---------------------------------------------------------------------

    def dim(self, table):
        """The table's dim, asked of the servers once (an empty pull) and remembered."""
        if table not in self._dims:
            empty = np.zeros(1, dtype=np.uint32)
            result = self._data.pull(table, empty, np.zeros(0, dtype=np.uint64),
                                     np.zeros(0, dtype=np.float32), COMBINERS["sum"], False)
            self._dims[table] = result[0]
        return self._dims[table]

    def _prepare_pull(self, table, offsets, keys, combiner, out):
        rows = check_csr(offsets, keys)
        code = _combiner(combiner)
        vectors = _vectors(rows, keys.size, combiner)
        if out is None:
            out = np.empty((vectors, self.dim(table)), dtype=np.float32)
        else:
            out = _array(out, "out", np.float32, (2,))
            if out.shape[0] != vectors:
                raise invalid_argument(
                    f"out: expected {vectors} rows for a {combiner} pull, got shape {out.shape}")
        return code, out

    def pull(self, table, offsets, keys, combiner="sum", create_missing=True, out=None):
        """Rows of a CSR batch: float32 [rows, dim] pooled, or [nnz, dim] with combiner
        "none". Missing keys are created (create_missing) or read as their initial
        value. out: an array of that shape to fill instead of a new one."""
        code, out = self._prepare_pull(table, offsets, keys, combiner, out)
        try:
            result = self._data.pull(table, offsets, keys, out, code, bool(create_missing))
        except Error:
            self._dims.pop(table, None)  # the table may have been created again
            raise
        self.last_pull = PullResult(result)
        return out

    def pull_async(self, table, offsets, keys, combiner="sum", create_missing=True, out=None):
        """pull, pipelined: a Future whose result() is the array."""
        code, out = self._prepare_pull(table, offsets, keys, combiner, out)
        call = self._data.pull_start(table, offsets, keys, out, code, bool(create_missing))
        return Future(call, lambda result: out, (offsets, keys, out))

    def _pull_async_prepared(self, table, offsets, keys, combiner, create_missing, vectors):
        """pull_async for arrays built by ember itself (right types and shapes): the
        C client still checks the CSR before sending."""
        out = np.empty((vectors, self.dim(table)), dtype=np.float32)
        call = self._data.pull_start(table, offsets, keys, out, COMBINERS[combiner],
                                     create_missing)
        return Future(call, lambda result: out, (offsets, keys, out))

    def _push_async_prepared(self, table, offsets, keys, grads, combiner):
        """push_async for arrays built by ember itself; the C client checks the CSR and
        that every gradient is finite before sending."""
        call = self._data.push_start(table, offsets, keys, grads, COMBINERS[combiner])
        return Future(call, PushResult, (offsets, keys, grads))

    def _prepare_push(self, table, offsets, keys, grads, combiner):
        rows = check_csr(offsets, keys)
        code = _combiner(combiner)
        grads = _array(grads, "grads", np.float32, (1, 2))
        vectors = _vectors(rows, keys.size, combiner)
        if grads.ndim == 2 and grads.shape[0] != vectors:
            raise invalid_argument(
                f"grads: expected {vectors} rows (one per {'key' if combiner == 'none' else 'row'}"
                f" of a {combiner} push), got shape {grads.shape}")
        if grads.ndim == 1 and (vectors == 0 and grads.size or
                                vectors and grads.size % vectors):
            raise invalid_argument(
                f"grads: {grads.size} values are not a whole number of {vectors} vectors")
        if not np.isfinite(grads).all():
            bad = int(np.argmax(~np.isfinite(grads.reshape(-1))))
            raise invalid_argument(f"grads: value {bad} is {grads.reshape(-1)[bad]}")
        return code, grads

    def push(self, table, offsets, keys, grads, combiner="sum"):
        """Sends gradients: float32 [rows, dim] for a pooled push (each row's gradient
        is spread over its keys as the combiner did), [nnz, dim] with "none". The
        server sums a key's gradients and applies the table's optimizer."""
        code, grads = self._prepare_push(table, offsets, keys, grads, combiner)
        return PushResult(self._data.push(table, offsets, keys, grads, code))

    def push_async(self, table, offsets, keys, grads, combiner="sum"):
        """push, pipelined: a Future whose result() is the PushResult."""
        code, grads = self._prepare_push(table, offsets, keys, grads, combiner)
        call = self._data.push_start(table, offsets, keys, grads, code)
        return Future(call, PushResult, (offsets, keys, grads))

    def ping(self):
        """(version, uptime in seconds) of the first server."""
        version, uptime_ms = self._data.ping()
        return version, uptime_ms / 1000.0

    def health(self):
        """{ready, state, backend, devices, tables} of the first server."""
        return self._data.health()

    # ---- admin ----------------------------------------------------------------------

    def _admin_client(self):
        if self._admin is None:
            if self._admin_address is None:
                raise invalid_argument(
                    "admin: this call needs the admin listener: Client(..., admin='host:port', "
                    "admin_token=...)")
            self._admin = _ember.Client(_server_list(self._admin_address), self._admin_token,
                                        **self._options)
        return self._admin

    def tables(self):
        """The tables: a list of {name, dim, capacity, shards, optimizer, rows, config}."""
        return json.loads(self._admin_client().list_tables())

    def create_table(self, name=None, dim=None, capacity=None, *, config=None, **fields):
        """Creates a table from a config dict (config=...) or from its fields:
        create_table("clicks", 16, 1_000_000, optimizer={"type": "adagrad", "lr": 0.05}).
        Returns the created table's description. A dict as the first argument is the
        config: create_table({"name": "clicks", "dim": 16, "capacity": 1_000_000})."""
        if isinstance(name, dict) and config is None and dim is None and capacity is None:
            config, name = name, None
            if fields:
                raise invalid_argument("create_table: pass config=... or fields, not both")
        if name is not None and not isinstance(name, str):
            raise invalid_argument(
                f"create_table: name must be a str (or the whole config a dict), got "
                f"{type(name).__name__}")
        if config is None:
            config = dict(fields)
            for key, value in (("name", name), ("dim", dim), ("capacity", capacity)):
                if value is not None:
                    config[key] = value
        elif name is not None or dim is not None or capacity is not None or fields:
            raise invalid_argument("create_table: pass config=... or fields, not both")
        info = self._admin_client().create_table(json.dumps(config))
        self._dims.pop(config.get("name"), None)
        return json.loads(info) if info is not None else None

    def drop_table(self, name):
        self._admin_client().drop_table(name)
        self._dims.pop(name, None)

    def stats(self, table=None):
        """{server, tables, pools} as STATS answers (proto/ember.proto's fields)."""
        return json.loads(self._admin_client().stats(table))

    def save(self, table=None, delta=False):
        """Checkpoints the table (None: every table), with delta=True only what changed
        since its last checkpoint; a list of {table, id, path, kind, rows, ...}."""
        return json.loads(self._admin_client().save(table, bool(delta)))

    def checkpoints(self, table=None):
        """The complete checkpoints of the table (None: every table) under the server's
        checkpoint.dir, each table's latest last: a list of {table, id, path, kind, rows,
        ...}, read from their manifests."""
        return json.loads(self._admin_client().checkpoints(table))

    def load(self, table, path=None, weights_only=False):
        """Loads the table's latest checkpoint, or the one at path (on the server)."""
        loaded = self._admin_client().load(table, path, bool(weights_only))
        self._dims.pop(table, None)
        return json.loads(loaded) if loaded is not None else None

    def save_cluster(self, dir, table=None):
        """Saves the table (None: every table) of every server of the admin list into one
        cluster checkpoint at dir, an absolute path the servers and this process share;
        returns the record written as dir/cluster.json."""
        return json.loads(self._admin_client().cluster_save(str(dir), table))

    def load_cluster(self, dir, table=None, shards=0):
        """Restores the cluster checkpoint at dir onto the servers of the admin list,
        however many (each loads the buckets it now owns); shards > 0 sets the tables'
        shard count. Returns one {table, server, table_rows, ...} per server and table."""
        loaded = self._admin_client().cluster_load(str(dir), table, int(shards))
        self._dims.clear()
        return json.loads(loaded)

    def erase(self, table, keys):
        """Removes the keys (a uint64 array, or a list of ints) from the table; returns how
        many were there."""
        if isinstance(keys, (list, tuple)):
            keys = _key_list(keys, "keys")
        keys = _array(keys, "keys", np.uint64, (1,))
        return self._admin_client().erase(table, keys)

    def erase_older(self, table, not_pushed_for):
        """Removes rows not pushed in the table's last not_pushed_for pushes."""
        return self._admin_client().erase_older(table, int(not_pushed_for))

    def erase_before(self, table, since):
        """Removes rows not pushed since `since` (Unix seconds)."""
        if not isinstance(since, (int, float)) or since < 0:
            raise invalid_argument(f"since: expected Unix seconds, got {since!r}")
        return self._admin_client().erase_before(table, int(since * 1000))

    def evicted(self, table, after=0, max=0):
        """Keys the table's eviction policy removed after sequence `after`:
        {keys (uint64 array), first, total, missed}."""
        answer = json.loads(self._admin_client().evicted(table, int(after), int(max)))
        answer["keys"] = np.array([int(key) for key in answer.get("keys", [])],
                                  dtype=np.uint64)
        return answer

    def drain(self):
        return self._admin_client().drain()

    def undrain(self):
        return self._admin_client().undrain()

    def reload(self):
        return json.loads(self._admin_client().reload())

    def slowlog(self, max=0, reset=False):
        return json.loads(self._admin_client().slowlog(int(max), bool(reset)))

    def wait_ready(self, timeout=10.0):
        """Waits until the first server answers HEALTH ready (or raises its error)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health()["ready"]:
                    return
            except Error:
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise _error("DEADLINE_EXCEEDED", f"not ready after {timeout} s")
            time.sleep(0.05)


from .export import Export, read_export, write_export  # noqa: E402
