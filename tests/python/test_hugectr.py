"""The HugeCTR readers: writer -> reader round trips, the checksum mode, a file written
the way the seed article's Python writer writes it, and every kind of damage refused
with an error naming the file, the sample and the field."""
import os
import struct
from ctypes import c_float, c_int, c_longlong, c_uint

import numpy as np
import pytest

import ember
from ember import hugectr


def random_samples(rng, count, slot_num, dense_dim=3, label_dim=1, max_nnz=4, key_max=2**32):
    labels = rng.integers(0, 2, (count, label_dim)).astype(np.float32)
    dense = rng.standard_normal((count, dense_dim)).astype(np.float32)
    lengths = rng.integers(0, max_nnz + 1, (slot_num, count)).astype(np.uint32)
    keys = rng.integers(0, key_max, int(lengths.sum()), dtype=np.uint64)
    return labels, dense, lengths, keys


def collect(reader):
    batches = list(reader)
    labels = np.concatenate([b.labels for b in batches])
    dense = np.concatenate([b.dense for b in batches])
    lengths = np.concatenate([b.lengths for b in batches], axis=1)
    keys = [np.concatenate([b.slot(s)[1] for b in batches]) for s in range(batches[0].slot_num)]
    return batches, labels, dense, lengths, np.concatenate(keys)


@pytest.mark.parametrize("key_type", ["u32", "u64"])
@pytest.mark.parametrize("checksum", [False, True])
def test_norm_round_trip_over_a_file_list(tmp_path, key_type, checksum):
    rng = np.random.default_rng(1)
    files, parts = [], []
    for index, count in enumerate([37, 0, 50, 13]):
        part = random_samples(rng, count, slot_num=5,
                              key_max=2**32 if key_type == "u32" else 2**63)
        path = tmp_path / f"part{index}.data"
        hugectr.write_norm(str(path), *part, key_type=key_type, checksum=checksum)
        files.append(str(path))
        parts.append(part)
    hugectr.write_file_list(str(tmp_path / "list.txt"), files)
    reader = hugectr.NormReader(str(tmp_path / "list.txt"), batch_size=16, key_type=key_type)
    assert reader.records() == 100
    batches, labels, dense, lengths, keys = collect(reader)
    assert [len(b) for b in batches] == [16] * 6 + [4]
    np.testing.assert_array_equal(labels, np.concatenate([p[0] for p in parts]))
    np.testing.assert_array_equal(dense, np.concatenate([p[1] for p in parts]))
    np.testing.assert_array_equal(lengths, np.concatenate([p[2] for p in parts], axis=1))
    expected_keys = []
    for slot in range(5):
        for labels_, dense_, lengths_, keys_ in parts:
            starts = np.concatenate([[0], np.cumsum(lengths_.sum(axis=1))]).astype(np.int64)
            expected_keys.append(keys_[starts[slot]:starts[slot + 1]])
    np.testing.assert_array_equal(keys, np.concatenate(expected_keys))


def test_a_batch_is_csr_per_slot_and_a_keyed_jagged_tensor(tmp_path):
    path = str(tmp_path / "one.data")
    lengths = np.array([[2, 0, 1], [1, 1, 1]], dtype=np.uint32)
    keys = np.array([5, 6, 7, 10, 11, 12], dtype=np.uint64)
    hugectr.write_norm(path, [1, 0, 1], np.zeros((3, 2)), lengths, keys)
    batch = next(iter(hugectr.NormReader([path], batch_size=8)))
    offsets, slot0 = batch.slot(0)
    np.testing.assert_array_equal(offsets, [0, 2, 2, 3])
    np.testing.assert_array_equal(slot0, [5, 6, 7])
    kjt = batch.kjt(["a", "b"])
    assert kjt.keys() == ["a", "b"] and kjt.stride() == 3
    assert kjt["b"].values().tolist() == [10, 11, 12]
    assert kjt.lengths().tolist() == [2, 0, 1, 1, 1, 1]


def write_like_the_seed_article(path, data):
    """The NCF preprocessing writer quoted in the seed article on HugeCTR's formats."""
    ll = c_longlong
    with open(path, "wb") as f:
        f.write(ll(0))                 # 0: no error check; 1: check_num
        f.write(ll(data.shape[0]))     # the number of samples in this data file
        f.write(ll(1))                 # dimension of label
        f.write(ll(1))                 # dimension of dense feature
        f.write(ll(2))                 # long long slot_num
        for _ in range(3):
            f.write(ll(0))             # reserved for future use
        for i in range(data.shape[0]):
            f.write(c_float(data[i, 2]))   # float label[label_dim];
            f.write(c_float(0))            # dummy dense feature
            f.write(c_int(1))              # slot 1 nnz: user ID
            f.write(c_uint(data[i, 0]))
            f.write(c_int(1))              # slot 2 nnz: item ID
            f.write(c_uint(data[i, 1]))


def test_a_file_written_like_the_seed_article_reads_back(tmp_path):
    rng = np.random.default_rng(4)
    data = np.stack([rng.integers(0, 1000, 30), rng.integers(0, 5000, 30),
                     rng.integers(0, 2, 30)], axis=1)
    path = str(tmp_path / "huge_ctr_data.dat")
    write_like_the_seed_article(path, data)
    assert os.path.getsize(path) == 64 + 30 * (4 + 4 + 8 + 8)
    batches, labels, dense, lengths, keys = collect(hugectr.NormReader([path], 7, slot_num=2))
    np.testing.assert_array_equal(labels[:, 0], data[:, 2])
    np.testing.assert_array_equal(dense, np.zeros((30, 1)))
    np.testing.assert_array_equal(lengths, np.ones((2, 30)))
    np.testing.assert_array_equal(keys, np.concatenate([data[:, 0], data[:, 1]]))


def damaged(tmp_path, change, checksum=False):
    rng = np.random.default_rng(8)
    path = str(tmp_path / "damaged.data")
    hugectr.write_norm(path, *random_samples(rng, 20, slot_num=3), checksum=checksum)
    with open(path, "rb") as handle:
        data = bytearray(handle.read())
    data = change(data)
    with open(path, "wb") as handle:
        handle.write(data)
    return path


def sample_offset(data, sample, checksum):
    """Byte offset of a sample in a file written with label_dim 1, dense_dim 3, 3 slots."""
    at = 64
    for _ in range(sample):
        if checksum:
            at += 4 + struct.unpack_from("<i", data, at)[0] + 1
        else:
            at += 16
            for _ in range(3):
                at += 4 + 4 * struct.unpack_from("<i", data, at)[0]
    return at


def put_i32(data, at, value):
    struct.pack_into("<i", data, at, value)
    return data


@pytest.mark.parametrize("name, change, checksum, expected", [
    ("short header", lambda d: d[:40], False,
     r"damaged.data: header: the file has 40 bytes, a Norm header takes 64"),
    ("bad error_check", lambda d: struct.pack_into("<q", d, 0, 7) or d, False,
     r"header: error_check is 7"),
    ("negative slot_num", lambda d: struct.pack_into("<q", d, 32, -1) or d, False,
     r"header: slot_num is -1"),
    ("nnz past the end", lambda d: put_i32(d, sample_offset(d, 19, False) + 16, 1 << 20), False,
     r"sample 19: slot 0: nnz 1048576: its keys .* run past the end of the file"),
    ("negative nnz", lambda d: put_i32(d, sample_offset(d, 4, False) + 16, -3), False,
     r"sample 4: slot 0: nnz -3"),
    ("truncated", lambda d: d[:-3], False, r"sample 19: .*past the end of the file"),
    ("trailing bytes", lambda d: d + b"\0\0\0\0", False,
     r"4 bytes follow the last of the header's 20 samples"),
    ("bad checksum", lambda d: d.__setitem__(sample_offset(d, 7, True) + 6,
                                             d[sample_offset(d, 7, True) + 6] ^ 0x10) or d, True,
     r"sample 7: checkbits: the sample's bytes sum to \d+ \(mod 256\), its check byte says \d+"),
    ("length too long", lambda d: put_i32(d, sample_offset(d, 19, True), 10**6), True,
     r"sample 19: length: 1000000 bytes .* run past the end of the file"),
])
def test_damaged_norm_files_are_refused(tmp_path, name, change, checksum, expected):
    path = damaged(tmp_path, change, checksum)
    with pytest.raises(ember.Error, match=expected) as error:
        list(hugectr.NormReader([path], batch_size=8))
    assert error.value.status == "DATA_LOSS"
    assert path in error.value.message


def test_length_that_disagrees_with_the_fields_is_refused(tmp_path):
    def shorten(data):
        # sample 2's length says one byte less; its check byte moves accordingly
        at = sample_offset(data, 2, True)
        length = struct.unpack_from("<i", data, at)[0]
        fields = bytes(data[at + 4:at + 4 + length - 1])
        frame = struct.pack("<i", length - 1) + fields + bytes([sum(fields) % 256])
        return data[:at] + frame + data[at + 4 + length + 1:]
    path = damaged(tmp_path, shorten, checksum=True)
    with pytest.raises(ember.Error, match=r"sample 2: slot 2: nnz.* past the sample's length"):
        list(hugectr.NormReader([path], batch_size=8))


def test_slot_count_mismatch_is_refused(tmp_path):
    path = damaged(tmp_path, lambda d: d)
    with pytest.raises(ember.Error, match=r"damaged.data: header: slot_num is 3, expected 4 "
                                          r"\(slot count mismatch\)"):
        list(hugectr.NormReader([path], batch_size=8, slot_num=4))


def test_file_list_errors_name_the_line(tmp_path):
    listing = tmp_path / "list.txt"
    listing.write_text("3\na.data\nb.data\n")
    with pytest.raises(ember.Error, match=r"list.txt: line 1: says 3 files, the list names 2"):
        hugectr.NormReader(str(listing), batch_size=4)


def test_slot_size_array_offsets_keys_and_refuses_keys_outside(tmp_path):
    path = str(tmp_path / "slots.data")
    lengths = np.array([[1, 1], [2, 0]], dtype=np.uint32)
    hugectr.write_norm(path, [0, 1], np.zeros((2, 1)), lengths,
                       np.array([3, 9, 0, 4], dtype=np.uint64))
    batch = next(iter(hugectr.NormReader([path], 4, slot_size_array=[10, 5])))
    np.testing.assert_array_equal(batch.keys, [3, 9, 10, 14])
    with pytest.raises(ember.Error, match=r"sample 1: slot 0: key 9 is outside "
                                          r"slot_size_array\[0\] = 8"):
        list(hugectr.NormReader([path], 4, slot_size_array=[8, 5]))


@pytest.mark.parametrize("float_label_dense", [False, True])
def test_raw_round_trip(tmp_path, float_label_dense):
    rng = np.random.default_rng(2)
    labels = rng.integers(0, 2, 45)
    dense = rng.integers(0, 100, (45, 13))
    keys = rng.integers(0, 2**32, (45, 26), dtype=np.uint64)
    path = str(tmp_path / "train.bin")
    hugectr.write_raw(path, labels, dense, keys, float_label_dense=float_label_dense)
    reader = hugectr.RawReader(path, 10, float_label_dense=float_label_dense)
    assert reader.records() == 45
    batches, got_labels, got_dense, lengths, got_keys = collect(reader)
    np.testing.assert_array_equal(got_labels[:, 0], labels)
    np.testing.assert_array_equal(got_dense, dense)
    assert (lengths == 1).all()
    np.testing.assert_array_equal(got_keys, keys.T.reshape(-1))


def test_truncated_raw_file_is_refused(tmp_path):
    path = str(tmp_path / "train.bin")
    hugectr.write_raw(path, np.zeros(3), np.zeros((3, 13)), np.zeros((3, 26), np.uint64))
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) - 2)
    with pytest.raises(ember.Error, match=r"train.bin: sample 2: truncated"):
        hugectr.RawReader(path, 10).records()
