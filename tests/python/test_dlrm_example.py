"""clients/python/examples/train_dlrm.py learns the planted signal of the synthetic data
against a private emberd, with every server-side optimizer (the target its README
states: test AUC at least 0.75 after one epoch of 20,000 samples)."""
import json
import os
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "clients", "python", "examples",
                       "train_dlrm.py")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from ember import criteo
    directory = str(tmp_path_factory.mktemp("dlrm"))
    criteo.synthesize(directory, 20000, seed=0)
    return directory


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_the_example_learns(data, optimizer):
    emberd = os.environ.get("EMBERD")
    if not emberd:
        pytest.skip("EMBERD is not set (run through meson test)")
    finished = subprocess.run(
        [sys.executable, EXAMPLE, "--emberd", emberd, "--data", data, "--epochs", "1",
         "--optimizer", optimizer, "--quiet", "--json"],
        capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    assert result["test_auc"] >= 0.75, result
    assert result["epochs"][0]["test_logloss"] < 0.6, result
