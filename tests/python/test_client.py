"""ember.Client against a real emberd: values, pipelining, errors, timeouts, several
servers and the admin calls."""
import socket
import threading
import time

import numpy as np
import pytest

import ember
from conftest import ADMIN_TOKEN, table


def csr(rows):
    """offsets, keys of a list of key lists."""
    offsets = np.zeros(len(rows) + 1, dtype=np.uint32)
    offsets[1:] = np.cumsum([len(row) for row in rows])
    keys = np.array([key for row in rows for key in row], dtype=np.uint64)
    return offsets, keys


def random_batch(rng, rows, max_len, key_space):
    return csr([list(rng.integers(0, key_space, rng.integers(0, max_len + 1)))
                for _ in range(rows)])


@pytest.fixture
def daemon(start_daemon):
    adam = {"type": "adam", "lr": 0.01}
    return start_daemon(tables=[table("t", dim=4), table("adam", dim=3, optimizer=adam),
                                table("adam_again", dim=3, optimizer=adam)])


def test_pull_pools_the_rows_the_server_holds(daemon):
    client = daemon.client()
    offsets, keys = csr([[1, 2], [3], [], [1, 1, 3]])
    vectors = client.pull("t", offsets, keys, combiner="none")
    assert vectors.shape == (6, 4) and vectors.dtype == np.float32
    assert client.last_pull.created == 3 and client.last_pull.unique_keys == 3
    by_key = {int(k): vectors[i] for i, k in enumerate(keys)}
    summed = client.pull("t", offsets, keys, combiner="sum")
    expected = np.stack([by_key[1] + by_key[2], by_key[3], np.zeros(4, np.float32),
                         by_key[1] + by_key[1] + by_key[3]])
    np.testing.assert_allclose(summed, expected, rtol=1e-6)
    mean = client.pull("t", offsets, keys, combiner="mean")
    np.testing.assert_allclose(mean[3], expected[3] / 3, rtol=1e-6)
    sqrtn = client.pull("t", offsets, keys, combiner="sqrtn")
    np.testing.assert_allclose(sqrtn[0], expected[0] / np.sqrt(2), rtol=1e-6)


def test_push_applies_sgd_on_the_server(daemon):
    client = daemon.client()
    offsets, keys = csr([[5, 6], [5]])
    before = client.pull("t", offsets, keys, combiner="none")
    grads = np.arange(8, dtype=np.float32).reshape(2, 4)
    result = client.push("t", offsets, keys, grads, combiner="sum")
    assert result.updated == 2
    after = client.pull("t", offsets, keys, combiner="none")
    # key 5 gets rows 0 and 1's gradients, key 6 row 0's; lr 0.1
    np.testing.assert_allclose(after[0], before[0] - 0.1 * (grads[0] + grads[1]), rtol=1e-6)
    np.testing.assert_allclose(after[1], before[1] - 0.1 * grads[0], rtol=1e-6)


def test_pull_without_create_missing_reads_zeros_and_stores_nothing(daemon):
    client = daemon.client()
    offsets, keys = csr([[100, 101]])
    serving = client.pull("t", offsets, keys, combiner="none", create_missing=False)
    assert client.last_pull.missing == 2 and client.last_pull.created == 0
    assert client.stats("t")["tables"][0]["rows"] == 0
    np.testing.assert_array_equal(serving, np.zeros((2, 4), np.float32))
    created = client.pull("t", offsets, keys, combiner="none")
    assert client.last_pull.created == 2 and np.abs(created).max() > 0


def test_pipelined_calls_give_the_blocking_results(daemon):
    client, reference = daemon.client(), daemon.client()
    rng = np.random.default_rng(7)
    batches = [random_batch(rng, 32, 5, 500) for _ in range(20)]
    futures = []
    for offsets, keys in batches:
        futures.append(client.pull_async("adam", offsets, keys))
        grads = np.full((32, 3), 0.5, dtype=np.float32)
        futures.append(client.push_async("adam", offsets, keys, grads))
    results = [future.result() for future in futures]
    for index, (offsets, keys) in enumerate(batches):
        # the same requests one at a time, on a table with the same config
        expected = reference.pull("adam_again", offsets, keys)
        grads = np.full((32, 3), 0.5, dtype=np.float32)
        assert isinstance(results[2 * index + 1], ember.PushResult)
        np.testing.assert_array_equal(results[2 * index], expected)
        reference.push("adam_again", offsets, keys, grads)
    assert all(future.done() for future in futures)


def test_futures_finish_in_any_order(daemon):
    client = daemon.client()
    offsets, keys = csr([[1, 2, 3]])
    futures = [client.pull_async("t", offsets, keys) for _ in range(10)]
    values = [future.result() for future in reversed(futures)]
    for value in values:
        np.testing.assert_array_equal(value, values[0])


@pytest.mark.parametrize("change, argument", [
    (lambda o, k, g: (o.astype(np.int64), k, g), "offsets: expected dtype uint32"),
    (lambda o, k, g: (o, k.astype(np.int64), g), "keys: expected dtype uint64"),
    (lambda o, k, g: (o, k, g.astype(np.float64)), "grads: expected dtype float32"),
    (lambda o, k, g: (list(o), k, g), "offsets: expected a numpy.ndarray"),
    (lambda o, k, g: (o, np.repeat(k, 2)[::2], g), "keys: must be C-contiguous"),
    (lambda o, k, g: (o.reshape(1, -1), k, g), "offsets: expected 1-D"),
    (lambda o, k, g: (o, k[:-1], g), "offsets: end at 3 but keys has 2"),
    (lambda o, k, g: (np.array([0, 4, 3], np.uint32), k, g), "offsets[2]=3 < offsets[1]=4"),
    (lambda o, k, g: (np.array([1, 2, 3], np.uint32), k, g), "offsets[0]=1, must be 0"),
    (lambda o, k, g: (o, k, g[:1]), "grads: expected 2 rows"),
    (lambda o, k, g: (o, k, np.where(g > 0, np.nan, g).astype(np.float32)), "grads: value"),
])
def test_bad_arrays_are_refused_before_anything_is_sent(daemon, change, argument):
    client = daemon.client()
    offsets, keys = csr([[1, 2], [3]])
    grads = np.ones((2, 4), dtype=np.float32)
    client.dim("t")  # the table's dim is asked once (an empty pull); not what is tested
    before = client.stats("t")["tables"][0]
    bad_offsets, bad_keys, bad_grads = change(offsets, keys, grads)
    with pytest.raises(ember.Error) as error:
        client.push("t", bad_offsets, bad_keys, bad_grads)
    assert error.value.status == "INVALID_ARGUMENT"
    assert argument in str(error.value)
    if not argument.startswith("grads"):
        with pytest.raises(ember.Error) as error:
            client.pull("t", bad_offsets, bad_keys)
        assert argument in error.value.message
    after = client.stats("t")["tables"][0]
    assert after["pushes"] == before["pushes"] and after["pulls"] == before["pulls"]


def test_bad_combiner_and_out_are_refused(daemon):
    client = daemon.client()
    offsets, keys = csr([[1]])
    with pytest.raises(ember.Error, match="combiner: expected one of none, sum, mean, sqrtn"):
        client.pull("t", offsets, keys, combiner="max")
    with pytest.raises(ember.Error, match=r"out: expected 1 rows"):
        client.pull("t", offsets, keys, out=np.zeros((2, 4), np.float32))


def test_server_errors_carry_status_and_message(daemon):
    client = daemon.client()
    offsets, keys = csr([[1]])
    with pytest.raises(ember.Error) as error:
        client.pull("missing", offsets, keys)
    assert error.value.status == "NOT_FOUND"
    assert "no table 'missing'" in error.value.message
    with pytest.raises(ember.Error) as error:
        client.push("t", offsets, keys, np.ones((1, 5), np.float32))
    assert error.value.status == "INVALID_ARGUMENT" and "dim" in error.value.message
    with pytest.raises(ember.Error) as error:
        client._data.list_tables()  # the data listener refuses admin calls
    assert error.value.status in ("PERMISSION_DENIED", "UNAUTHENTICATED")


def test_admin_calls_need_the_admin_listener(daemon):
    client = ember.Client(daemon.data)
    with pytest.raises(ember.Error, match="admin: this call needs the admin listener"):
        client.tables()


def test_data_token_is_sent(start_daemon):
    daemon = start_daemon(tables=[table("t")], data_token="sesame")
    offsets, keys = csr([[1]])
    with pytest.raises(ember.Error) as error:
        ember.Client(daemon.data).pull("t", offsets, keys)
    assert error.value.status in ("UNAUTHENTICATED", "PERMISSION_DENIED")
    assert ember.Client(daemon.data, token="sesame").pull("t", offsets, keys).shape == (1, 8)


class SilentServer:
    """Accepts connections and never answers."""

    def __init__(self):
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.socket.getsockname()[1]
        self.connections = []
        self.thread = threading.Thread(target=self.accept, daemon=True)
        self.thread.start()

    def accept(self):
        while True:
            try:
                self.connections.append(self.socket.accept()[0])
            except OSError:
                return

    def close(self):
        self.socket.close()
        for connection in self.connections:
            connection.close()


def test_timeouts_and_unreachable_servers():
    silent = SilentServer()
    try:
        client = ember.Client(silent.address, timeout=0.3)
        offsets, keys = csr([[1]])
        started = time.monotonic()
        with pytest.raises(ember.Error) as error:
            client.pull("t", offsets, keys, out=np.zeros((1, 4), np.float32))
        assert error.value.status == "DEADLINE_EXCEEDED"
        assert 0.25 < time.monotonic() - started < 5
    finally:
        silent.close()
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(ember.Error) as error:
        ember.Client(f"127.0.0.1:{port}", connect_timeout=1)
    assert error.value.status == "UNAVAILABLE" and str(port) in error.value.message
    with pytest.raises(ember.Error) as error:
        ember.Client("no-port-here")
    assert error.value.status == "INVALID_ARGUMENT"


def test_network_waits_release_the_gil():
    silent = SilentServer()
    try:
        client = ember.Client(silent.address, timeout=1.0)
        offsets, keys = csr([[1]])
        errors = []

        def waiting_pull():
            try:
                client.pull("t", offsets, keys, out=np.zeros((1, 4), np.float32))
            except ember.Error as error:
                errors.append(error.status)

        thread = threading.Thread(target=waiting_pull)
        thread.start()
        spins = 0
        while thread.is_alive():
            spins += 1
        thread.join()
        assert errors == ["DEADLINE_EXCEEDED"]
        assert spins > 100000  # this thread ran Python while the other waited
    finally:
        silent.close()


def test_several_servers_give_the_results_of_one(start_daemon):
    config = table("t", dim=4, optimizer={"type": "adagrad", "lr": 0.1})
    first, second, single = (start_daemon(tables=[config]) for _ in range(3))
    spread = ember.Client([first.data, second.data])
    whole = ember.Client(single.data)
    assert spread.server_count == 2
    rng = np.random.default_rng(3)
    for step in range(10):
        offsets, keys = random_batch(rng, 64, 6, 1000)
        for combiner in ("sum", "mean", "none"):
            np.testing.assert_array_equal(spread.pull("t", offsets, keys, combiner=combiner),
                                          whole.pull("t", offsets, keys, combiner=combiner))
        grads = rng.standard_normal((64, 4)).astype(np.float32)
        spread.push("t", offsets, keys, grads, combiner="mean")
        whole.push("t", offsets, keys, grads, combiner="mean")
    rows = [daemon.client().stats("t")["tables"][0]["rows"] for daemon in (first, second)]
    assert min(rows) > 0
    assert sum(rows) == single.client().stats("t")["tables"][0]["rows"]


def test_admin_calls(start_daemon, tmp_path):
    daemon = start_daemon(extra={"checkpoint": {"dir": str(tmp_path), "on_shutdown": False}})
    client = daemon.client()
    version, uptime = client.ping()
    assert version and uptime >= 0
    created = client.create_table("clicks", 6, 1000, optimizer={"type": "adagrad", "lr": 0.1})
    assert created["name"] == "clicks" and created["dim"] == 6
    assert [t["name"] for t in client.tables()] == ["clicks"]
    with pytest.raises(ember.Error) as error:
        client.create_table(config={"name": "bad", "dim": 0, "capacity": 10})
    assert error.value.status == "INVALID_ARGUMENT" and "dim" in error.value.message
    views = client.create_table({"name": "views", "dim": 4, "capacity": 10})  # a dict: the config
    assert (views["name"], views["dim"]) == ("views", 4)
    client.drop_table("views")
    with pytest.raises(ember.Error) as error:
        client.create_table(7, 4, 10)
    assert error.value.status == "INVALID_ARGUMENT" and "name must be a str" in error.value.message
    offsets, keys = csr([[1, 2, 3]])
    rows = client.pull("clicks", offsets, keys, combiner="none")
    saved = client.save("clicks", delta=True)  # nothing to build on: a full one
    assert saved[0]["table"] == "clicks" and saved[0]["rows"] == 3
    assert saved[0]["kind"] == "full"
    listed = client.checkpoints("clicks")
    assert [(c["id"], c["path"], c["kind"], c["rows"]) for c in listed] == \
        [(saved[0]["id"], saved[0]["path"], "full", 3)]
    assert client.checkpoints() == listed
    assert client.erase("clicks", np.array([1, 2, 9], np.uint64)) == 2
    assert client.erase("clicks", [2, 10]) == 0  # a list of ints: nothing there any more
    for bad, said in (([1, -1], "keys[1]: key -1 is not in [0, 2^64)"),
                      ([1, 2**64], "keys[1]: key 18446744073709551616"),
                      ([1.5], "keys[0]: expected an int key, got float")):
        with pytest.raises(ember.Error) as error:
            client.erase("clicks", bad)
        assert error.value.status == "INVALID_ARGUMENT" and said in error.value.message
    assert client.stats("clicks")["tables"][0]["rows"] == 1
    delta = client.save("clicks", delta=True)[0]
    assert (delta["kind"], delta["parent"], delta["rows"], delta["tombstones"],
            delta["table_rows"]) == ("delta", saved[0]["id"], 0, 2, 1)
    client.load("clicks", saved[0]["path"])
    np.testing.assert_array_equal(client.pull("clicks", offsets, keys, combiner="none"), rows)
    assert client.load("clicks")["table_rows"] == 1
    with pytest.raises(ember.Error) as error:
        client.erase_older("clicks", 1)
    assert error.value.status == "FAILED_PRECONDITION" and "clicks" in error.value.message
    client.drop_table("clicks")
    assert client.tables() == []
    assert client.health()["tables"] == 0


def test_cluster_checkpoints_restore_onto_another_cluster_size(start_daemon, tmp_path):
    config = table("t", dim=4, optimizer={"type": "adam", "lr": 0.01})
    two = [start_daemon(tables=[config]) for _ in range(2)]
    trainer = ember.Client([d.data for d in two], admin=[d.admin for d in two],
                           admin_token=ADMIN_TOKEN)
    rng = np.random.default_rng(5)
    keys = rng.integers(1, 2**63, 2000, dtype=np.uint64)
    offsets = np.arange(len(keys) + 1, dtype=np.uint32)
    trainer.pull("t", offsets, keys, combiner="none")
    for _ in range(3):
        trainer.push("t", offsets, keys, rng.standard_normal((len(keys), 4)).astype(np.float32),
                     combiner="none")
    before = trainer.pull("t", offsets, keys, combiner="none", create_missing=False)
    record = trainer.save_cluster(tmp_path / "cluster", "t")
    assert [p["server"] for p in record["tables"][0]["parts"]] == [0, 1]
    with pytest.raises(ember.Error) as error:
        trainer.save_cluster(tmp_path / "cluster")
    assert error.value.status == "ALREADY_EXISTS"
    three = [start_daemon() for _ in range(3)]
    restored = ember.Client([d.data for d in three], admin=[d.admin for d in three],
                            admin_token=ADMIN_TOKEN)
    loaded = restored.load_cluster(tmp_path / "cluster", shards=2)
    assert sorted(item["server"] for item in loaded) == [0, 1, 2]
    assert sum(item["table_rows"] for item in loaded) == len(keys)
    np.testing.assert_array_equal(
        restored.pull("t", offsets, keys, combiner="none", create_missing=False), before)
    with pytest.raises(ember.Error) as error:
        restored.load_cluster("relative/path")
    assert error.value.status == "INVALID_ARGUMENT" and "not absolute" in error.value.message


def test_evicted_keys_are_readable(start_daemon):
    daemon = start_daemon(tables=[table("lru", dim=2, capacity=4,
                                        eviction={"policy": "lru", "candidates": 64})])
    client = daemon.client()
    for key in range(10):
        offsets, keys = csr([[key]])
        client.pull("lru", offsets, keys)
    evicted = client.evicted("lru")
    assert evicted["total"] == 6
    assert evicted["keys"].dtype == np.uint64
    np.testing.assert_array_equal(np.sort(evicted["keys"]), np.arange(6, dtype=np.uint64))
