"""The Criteo tools: synthetic data, TSV, conversion to Norm and Raw, and AUC."""
import numpy as np
import pytest

import ember
from ember import criteo, hugectr


def test_tsv_converts_to_norm_and_raw_with_the_same_samples(tmp_path):
    synthetic = criteo.Synthetic(seed=5)
    labels, dense, ids, _ = synthetic.sample(300, seed=1)
    tsv = str(tmp_path / "day.tsv")
    criteo.write_tsv(tsv, labels, dense, ids)
    read_labels, read_dense, read_keys = criteo.read_tsv(tsv)
    np.testing.assert_array_equal(read_labels, labels)
    np.testing.assert_array_equal(read_dense, dense)
    missing = np.iinfo(np.uint64).max
    assert ((read_keys == missing) == (ids < 0)).all()

    listing = criteo.convert(tsv, str(tmp_path / "norm"), files=3, checksum=True)
    batch = next(iter(hugectr.NormReader(listing, 1000, slot_num=26)))
    assert len(batch) == 300
    np.testing.assert_array_equal(batch.labels[:, 0], labels)
    np.testing.assert_allclose(batch.dense, criteo.dense_features(dense))
    for slot in (0, 8, 25):
        offsets, keys = batch.slot(slot)
        present = ids[:, slot] >= 0
        np.testing.assert_array_equal(np.diff(offsets), present.astype(np.uint32))
        np.testing.assert_array_equal(keys, read_keys[present, slot])

    raw = criteo.convert(tsv, str(tmp_path / "raw"), format="raw")
    batch = next(iter(hugectr.RawReader(raw, 1000)))
    np.testing.assert_array_equal(batch.labels[:, 0], labels)
    np.testing.assert_array_equal(batch.dense, np.maximum(dense, 0))
    np.testing.assert_array_equal(batch.slot(3)[1], np.where(ids[:, 3] < 0, 0, read_keys[:, 3]))


def test_malformed_tsv_lines_are_refused(tmp_path):
    tsv = tmp_path / "bad.tsv"
    good = "\t".join(["1"] + ["3"] * 13 + ["0a0b0c0d"] * 26)
    tsv.write_text(good + "\n" + good.replace("0a0b0c0d", "zz", 1) + "\n")
    with pytest.raises(ember.Error, match=r"bad.tsv: line 2: C1: 'zz'"):
        criteo.read_tsv(str(tsv))
    tsv.write_text(good + "\n1\t2\n")
    with pytest.raises(ember.Error, match=r"bad.tsv: line 2: 2 fields, Criteo has 40"):
        criteo.read_tsv(str(tsv))


def test_auc_and_the_planted_signal():
    assert criteo.auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert criteo.auc([0, 1, 0, 1], [0.5, 0.5, 0.5, 0.5]) == 0.5
    assert criteo.auc([1, 0], [0.1, 0.9]) == 0.0
    # the true weights separate the classes; fresh random scores do not
    synthetic = criteo.Synthetic(seed=0)
    assert criteo.planted_auc(synthetic, 20000, seed=3) > 0.85
    labels = synthetic.sample(20000, seed=4)[0]
    assert abs(criteo.auc(labels, np.random.default_rng(1).random(20000)) - 0.5) < 0.02
