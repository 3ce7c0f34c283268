"""Tables out of ember as NumPy arrays and back in: emberctl checkpoints export / import
with ember.read_export / write_export, against a real emberd."""
import os
import subprocess

import numpy as np
import pytest

import ember


def emberctl(*arguments):
    program = os.environ.get("EMBERCTL")
    if not program:
        pytest.skip("EMBERCTL is not set (run through meson test)")
    return subprocess.run([program, *arguments], capture_output=True, text=True)


def csr_of(keys):
    return np.arange(len(keys) + 1, dtype=np.uint32), np.ascontiguousarray(keys, np.uint64)


def test_an_export_holds_what_the_server_serves(start_daemon, tmp_path):
    daemon = start_daemon(extra={"checkpoint": {"dir": str(tmp_path / "ckpt"),
                                                "on_shutdown": False}})
    client = daemon.client()
    client.create_table("items", 8, 10000, optimizer={"type": "adam", "lr": 0.01},
                        initializer={"type": "uniform", "bound": 0.1, "seed": 3})
    rng = np.random.default_rng(7)
    keys = np.unique(rng.integers(0, 2**64, size=600, dtype=np.uint64))[:500]
    rng.shuffle(keys)
    offsets, keys = csr_of(keys)
    for _ in range(3):
        client.push("items", offsets, keys, rng.standard_normal((500, 8), dtype=np.float32),
                    combiner="none")
    served = client.pull("items", offsets, keys, combiner="none", create_missing=False)
    client.save("items")

    out = tmp_path / "export"
    done = emberctl("checkpoints", "export", str(tmp_path / "ckpt" / "items"), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "table items, checkpoint 00000000000000000001, 500 rows" in done.stdout
    table = ember.read_export(str(out))
    assert (table.table, len(table), table.config["dim"]) == ("items", 500, 8)
    assert table.keys.dtype == np.uint64 and np.all(table.keys[1:] > table.keys[:-1])
    order = np.argsort(keys)
    np.testing.assert_array_equal(table.keys, keys[order])
    np.testing.assert_array_equal(table.weights, served[order])  # bit for bit
    assert sorted(table.state) == ["first_moment", "second_moment", "step"]
    np.testing.assert_array_equal(table.state["step"], np.full(500, 3, np.float32))
    assert table.state["first_moment"].shape == (500, 8)
    assert np.all(table.state["second_moment"] >= 0)
    mapped = ember.read_export(str(out), mmap=True)
    assert isinstance(mapped.weights, np.memmap)
    np.testing.assert_array_equal(mapped.weights, table.weights)


def test_arrays_written_here_are_served_after_an_import(start_daemon, tmp_path):
    daemon = start_daemon(extra={"checkpoint": {"dir": str(tmp_path / "ckpt"),
                                                "on_shutdown": False}})
    client = daemon.client()
    rng = np.random.default_rng(11)
    keys = np.arange(1000, 2000, dtype=np.uint64)
    weights = rng.standard_normal((1000, 16), dtype=np.float32)  # say, a pretrained nn.Embedding
    config = {"name": "pretrained", "dim": 16, "capacity": 5000,
              "optimizer": {"type": "adagrad", "lr": 0.05}}
    ember.write_export(str(tmp_path / "arrays"), keys, weights, config)
    root = tmp_path / "imported"
    done = emberctl("checkpoints", "import", str(tmp_path / "arrays"), "--to", str(root))
    assert done.returncode == 0, done.stderr
    assert "table pretrained, full, 1000 rows" in done.stdout
    loaded = client.load("pretrained", str(root / "pretrained"))
    assert loaded["table_rows"] == 1000
    offsets, keys = csr_of(keys)
    np.testing.assert_array_equal(
        client.pull("pretrained", offsets, keys, combiner="none", create_missing=False), weights)
    # trains on from there: adagrad's accumulators started as a new row's
    client.push("pretrained", offsets, keys, np.ones((1000, 16), np.float32), combiner="none")
    after = client.pull("pretrained", offsets, keys, combiner="none", create_missing=False)
    np.testing.assert_allclose(after, weights - 0.05, rtol=0, atol=1e-6)


def test_bad_arrays_are_refused_naming_what_was_wrong(tmp_path):
    config = {"name": "t", "dim": 4, "capacity": 100, "optimizer": {"type": "adam"}}
    keys = np.arange(10, dtype=np.uint64)
    weights = np.zeros((10, 4), np.float32)
    for arguments, said in (
            ((keys.astype(np.int64), weights, config), "keys: expected uint64"),
            ((keys, weights[:, :3], config), "weights: expected float32 of shape (10, 4)"),
            ((keys, weights, config, {"step": np.zeros(10, np.float32)}),
             "give all of them or none"),
            ((keys, weights, config, {"sum": np.zeros((10, 4), np.float32)}),
             "['sum'] are not adam's")):
        with pytest.raises(ember.Error) as error:
            ember.write_export(str(tmp_path / "refused"), *arguments)
        assert error.value.status == "INVALID_ARGUMENT" and said in error.value.message
    assert not os.path.exists(tmp_path / "refused")
    # a value only the import checks: named by file, row, key and element
    weights[6, 2] = np.inf
    ember.write_export(str(tmp_path / "inf"), keys, weights, config)
    done = emberctl("checkpoints", "import", str(tmp_path / "inf"), "--to", str(tmp_path / "r"))
    assert done.returncode == 1
    assert "weights.npy: row 6 (key 6), element 2 is inf: values must be finite" in done.stderr
    assert not os.path.exists(tmp_path / "r")
    with pytest.raises(ember.Error) as error:
        ember.read_export(str(tmp_path))
    assert error.value.status == "INVALID_ARGUMENT" and "export.json" in error.value.message
    os.remove(tmp_path / "inf" / "weights.npy")
    with pytest.raises(ember.Error) as error:
        ember.read_export(str(tmp_path / "inf"))
    assert error.value.status == "INVALID_ARGUMENT" and "weights.npy" in error.value.message
