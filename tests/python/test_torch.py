"""ember.torch against local references: N training steps through the ember modules give
the rows of torch.nn.EmbeddingBag + torch.optim.SGD / Adagrad (sparse), and of a float64
reference for row-wise Adagrad and ember's per-row-step Adam; prefetching gives the
results of the loop without it."""
import numpy as np
import pytest
import torch

import ember
from ember.torch import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection,
                         EmbeddingConfig, KeyedJaggedTensor, PrefetchPipeline)
from conftest import table

KEYS = 40
BATCH = 8
STEPS = 12
DIM = 6
INITIALIZER = {"type": "uniform", "bound": 0.5, "seed": 11}


def assert_close(got, expected, rtol=1e-6, err_msg=""):
    """Equal within rtol relative to the larger of each element and the array's scale
    (sums that cancel leave float32 rounding of the terms' size, not the result's)."""
    expected = np.asarray(expected)
    np.testing.assert_allclose(got, expected, rtol=rtol,
                               atol=rtol * float(np.abs(expected).max()), err_msg=err_msg)


def random_kjt(rng, features, max_length=4, weighted=False):
    lengths = rng.integers(0, max_length + 1, len(features) * BATCH)
    values = rng.integers(0, KEYS, int(lengths.sum()))
    weights = rng.uniform(0.5, 1.5, values.size).astype(np.float32) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(features, torch.from_numpy(values),
                                              torch.from_numpy(lengths), weights=weights)


def batches(seed, features, weighted=False):
    rng = np.random.default_rng(seed)
    result = []
    for _ in range(STEPS):
        kjt = random_kjt(rng, features, weighted=weighted)
        target = torch.from_numpy(rng.standard_normal((BATCH, DIM * len(features)))
                                  .astype(np.float32))
        result.append((kjt, target))
    return result


def initial_rows(client, name):
    """Creates keys 0..KEYS-1 and returns their rows (the reference starts from them)."""
    offsets = np.array([0, KEYS], dtype=np.uint32)
    return client.pull(name, offsets, np.arange(KEYS, dtype=np.uint64), combiner="none")


def rows(client, name):
    offsets = np.array([0, KEYS], dtype=np.uint32)
    return client.pull(name, offsets, np.arange(KEYS, dtype=np.uint64), combiner="none",
                       create_missing=False)


def train_ember(collection, data):
    outputs = []
    for kjt, target in data:
        pooled = collection(kjt).values()
        loss = ((pooled - target) ** 2).sum()
        loss.backward()
        outputs.append(pooled.detach().clone())
    collection.flush()
    return outputs


def ember_collection(daemon, optimizer, pooling, dedup, features=("f0", "f1")):
    client = daemon.client()
    configs = [EmbeddingBagConfig(f"t_{feature}", DIM, 1000, [feature], pooling=pooling,
                                  optimizer=optimizer, initializer=INITIALIZER)
               for feature in features]
    collection = EmbeddingBagCollection(configs, client, create_tables=True, dedup=dedup)
    starts = [initial_rows(client, config.name) for config in configs]
    return client, collection, starts


@pytest.fixture
def daemon(start_daemon):
    return start_daemon()


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("dedup", [False, True])
@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_steps_match_torch_embedding_bag(daemon, kind, pooling, dedup):
    optimizer = {"type": kind, "lr": 0.05}
    if kind == "adagrad":
        optimizer.update(eps=1e-10, initial_accumulator=0.0)
    client, collection, starts = ember_collection(daemon, optimizer, pooling, dedup)
    data = batches(5, ["f0", "f1"])
    got = train_ember(collection, data)

    bags = [torch.nn.EmbeddingBag(KEYS, DIM, mode=pooling, sparse=True) for _ in starts]
    for bag, start in zip(bags, starts):
        bag.weight.data.copy_(torch.from_numpy(start))
    parameters = [bag.weight for bag in bags]
    reference = (torch.optim.SGD(parameters, lr=0.05) if kind == "sgd"
                 else torch.optim.Adagrad(parameters, lr=0.05, eps=1e-10))
    for step, (kjt, target) in enumerate(data):
        reference.zero_grad()
        blocks = []
        for bag, feature in zip(bags, ["f0", "f1"]):
            jagged = kjt[feature]
            blocks.append(bag(jagged.values(), jagged.offsets()[:-1]))
        pooled = torch.cat(blocks, dim=1)
        assert_close(got[step].numpy(), pooled.detach().numpy(), err_msg=f"step {step}")
        ((pooled - target) ** 2).sum().backward()
        reference.step()
    for bag, config in zip(bags, collection.tables):
        assert_close(rows(client, config.name), bag.weight.detach().numpy())


def float64_step(kind, weights, state, gradient, lr):
    """One optimizer step on one row, in float64, as common/optimizer.h defines it."""
    if kind == "rowwise_adagrad":
        state["s"] += float(np.mean(gradient ** 2))
        weights -= lr * gradient / (np.sqrt(state["s"]) + 1e-8)
    elif kind == "adam":
        beta1, beta2, eps = 0.9, 0.999, 1e-8
        state["t"] += 1
        state["m"] = beta1 * state["m"] + (1 - beta1) * gradient
        state["v"] = beta2 * state["v"] + (1 - beta2) * gradient ** 2
        m_hat = state["m"] / (1 - beta1 ** state["t"])
        v_hat = state["v"] / (1 - beta2 ** state["t"])
        weights -= lr * m_hat / (np.sqrt(v_hat) + eps)


def float64_pool(weights, values, lengths, pooling, per_value_weights=None):
    out = np.zeros((len(lengths), weights.shape[1]))
    scales = []
    begin = 0
    for row, length in enumerate(lengths):
        for position in range(begin, begin + length):
            scale = 1.0 if per_value_weights is None else float(per_value_weights[position])
            if pooling == "mean":
                scale /= length
            elif pooling == "sqrtn":
                scale /= np.sqrt(length)
            out[row] += scale * weights[values[position]]
            scales.append((row, values[position], scale))
        begin += length
    return out, scales


@pytest.mark.parametrize("kind, pooling", [("rowwise_adagrad", "sum"), ("adam", "sum"),
                                           ("adam", "sqrtn"), ("rowwise_adagrad", "mean")])
def test_steps_match_a_float64_reference(daemon, kind, pooling):
    optimizer = {"type": kind, "lr": 0.02, "eps": 1e-8}
    if kind == "adam":
        optimizer.update(beta1=0.9, beta2=0.999)
    client, collection, starts = ember_collection(daemon, optimizer, pooling, "auto")
    data = batches(9, ["f0", "f1"])
    got = train_ember(collection, data)
    weights = [start.astype(np.float64) for start in starts]
    states = [[{"s": 0.0, "t": 0, "m": np.zeros(DIM), "v": np.zeros(DIM)} for _ in range(KEYS)]
              for _ in starts]
    for step, (kjt, target) in enumerate(data):
        blocks, all_scales = [], []
        for table_weights, feature in zip(weights, ["f0", "f1"]):
            jagged = kjt[feature]
            pooled, scales = float64_pool(table_weights, jagged.values().numpy(),
                                          jagged.lengths().numpy(), pooling)
            blocks.append(pooled)
            all_scales.append(scales)
        pooled = np.concatenate(blocks, axis=1)
        assert_close(got[step].numpy(), pooled, rtol=1e-5, err_msg=f"step {step}")
        grad = 2 * (pooled - target.numpy().astype(np.float64))
        for index, (table_weights, scales) in enumerate(zip(weights, all_scales)):
            per_key = {}
            for row, key, scale in scales:
                per_key.setdefault(key, np.zeros(DIM))
                per_key[key] += scale * grad[row, index * DIM:(index + 1) * DIM]
            for key, gradient in per_key.items():
                float64_step(kind, table_weights[key], states[index][key], gradient, 0.02)
    for table_weights, config in zip(weights, collection.tables):
        assert_close(rows(client, config.name), table_weights, rtol=1e-5)


def test_weighted_pooling_matches_per_sample_weights(daemon):
    client, collection, starts = ember_collection(daemon, {"type": "sgd", "lr": 0.1}, "sum",
                                                  "auto", features=("f0",))
    data = batches(13, ["f0"], weighted=True)
    got = train_ember(collection, [(kjt, target[:, :DIM]) for kjt, target in data])
    bag = torch.nn.EmbeddingBag(KEYS, DIM, mode="sum", sparse=True)
    bag.weight.data.copy_(torch.from_numpy(starts[0]))
    reference = torch.optim.SGD([bag.weight], lr=0.1)
    for step, (kjt, target) in enumerate(data):
        reference.zero_grad()
        jagged = kjt["f0"]
        pooled = bag(jagged.values(), jagged.offsets()[:-1],
                     per_sample_weights=jagged.weights_or_none())
        assert_close(got[step].numpy(), pooled.detach().numpy(), err_msg=f"step {step}")
        ((pooled - target[:, :DIM]) ** 2).sum().backward()
        reference.step()
    assert_close(rows(client, "t_f0"), bag.weight.detach().numpy())


def test_sequence_variant_matches_torch_embedding(daemon):
    client = daemon.client()
    config = EmbeddingConfig("seq", DIM, 1000, ["f0"], optimizer={"type": "sgd", "lr": 0.1},
                             initializer=INITIALIZER)
    collection = EmbeddingCollection([config], client, create_tables=True)
    start = initial_rows(client, "seq")
    embedding = torch.nn.Embedding(KEYS, DIM, sparse=True)
    embedding.weight.data.copy_(torch.from_numpy(start))
    reference = torch.optim.SGD([embedding.weight], lr=0.1)
    rng = np.random.default_rng(2)
    for step in range(STEPS):
        kjt = random_kjt(rng, ["f0"])
        target = torch.from_numpy(rng.standard_normal((kjt.values().numel(), DIM))
                                  .astype(np.float32))
        jagged = collection(kjt)["f0"]
        assert jagged.lengths().tolist() == kjt.lengths().tolist()
        ((jagged.values() - target) ** 2).sum().backward()
        reference.zero_grad()
        local = embedding(kjt.values())
        assert_close(jagged.values().detach().numpy(), local.detach().numpy())
        ((local - target) ** 2).sum().backward()
        reference.step()
    collection.flush()
    assert_close(rows(client, "seq"), embedding.weight.detach().numpy())


def run_loop(daemon, name, data, prefetch, staleness=0, background=False):
    client = daemon.client()
    config = EmbeddingBagConfig(name, DIM, 1000, ["f0", "f1"], optimizer={"type": "adagrad",
                                                                         "lr": 0.1},
                                initializer=INITIALIZER)
    collection = EmbeddingBagCollection([config], client, create_tables=True)
    loop = (PrefetchPipeline(data, [collection], staleness=staleness, background=background)
            if prefetch else data)
    outputs = []
    for kjt, target in loop:
        pooled = collection(kjt).values()
        ((pooled - target) ** 2).sum().backward()
        outputs.append(pooled.detach().clone())
    collection.flush()
    return outputs, rows(client, name)


def test_prefetch_gives_the_results_of_the_plain_loop(daemon):
    data = batches(21, ["f0", "f1"])
    plain, plain_rows = run_loop(daemon, "plain", data, prefetch=False)
    piped, piped_rows = run_loop(daemon, "piped", data, prefetch=True)
    for step, (a, b) in enumerate(zip(plain, piped)):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=f"step {step}")
    np.testing.assert_array_equal(plain_rows, piped_rows)
    background, background_rows = run_loop(daemon, "background", data, prefetch=True,
                                           background=True)
    for step, (a, b) in enumerate(zip(plain, background)):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=f"background step {step}")
    np.testing.assert_array_equal(plain_rows, background_rows)
    for use_thread in (False, True):
        stale, _ = run_loop(daemon, f"stale{int(use_thread)}", data, prefetch=True, staleness=1,
                            background=use_thread)
        np.testing.assert_array_equal(stale[0].numpy(), plain[0].numpy())
        assert any(not np.array_equal(a.numpy(), b.numpy()) for a, b in zip(plain, stale))


def test_background_prefetch_raises_the_servers_errors(daemon):
    client = daemon.client()
    config = EmbeddingBagConfig("gone", DIM, 1000, ["f0", "f1"], initializer=INITIALIZER,
                                optimizer={"type": "sgd", "lr": 0.1})
    collection = EmbeddingBagCollection([config], client, create_tables=True)
    data = batches(3, ["f0", "f1"])
    with pytest.raises(ember.Error) as error:
        for step, (kjt, target) in enumerate(PrefetchPipeline(data, [collection],
                                                              background=True)):
            ((collection(kjt).values() - target) ** 2).sum().backward()
            if step == 1:
                client.drop_table("gone")
    assert error.value.status == "NOT_FOUND" and "gone" in error.value.message


def test_several_servers_train_as_one(start_daemon):
    first, second, single = start_daemon(), start_daemon(), start_daemon()
    results = []
    for servers, admins in (([first.data, second.data], [first, second]), ([single.data],
                                                                           [single])):
        for daemon in admins:
            daemon.client().create_table(config=table("shared", dim=DIM, initializer=INITIALIZER,
                                                      optimizer={"type": "adagrad", "lr": 0.1}))
        client = ember.Client(servers)
        config = EmbeddingBagConfig("shared", DIM, 1000, ["f0", "f1"], pooling="mean")
        collection = EmbeddingBagCollection([config], client, dedup=False)
        outputs = train_ember(collection, batches(4, ["f0", "f1"]))
        results.append((outputs, rows(client, "shared")))
    for a, b in zip(results[0][0], results[1][0]):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_bad_inputs_are_refused(daemon):
    with pytest.raises(ember.Error, match="lengths: sum to 3 but values has 2"):
        KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([1, 2]), torch.tensor([1, 2]))
    with pytest.raises(ember.Error, match="values: expected an integer tensor"):
        KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([1.0]), torch.tensor([1]))
    with pytest.raises(ember.Error, match="give lengths or offsets"):
        KeyedJaggedTensor(["a"], torch.tensor([1]))
    with pytest.raises(ember.Error, match="pooling: expected one of sum, mean, sqrtn"):
        EmbeddingBagConfig("t", 4, 10, ["a"], pooling="max")
    client = daemon.client()
    client.create_table(config=table("four", dim=4))
    with pytest.raises(ember.Error, match="embedding_dim 8 but the server's table has dim 4"):
        EmbeddingBagCollection([EmbeddingBagConfig("four", 8, 10, ["a"])], client)
    collection = EmbeddingBagCollection([EmbeddingBagConfig("four", 4, 10, ["a"])], client)
    kjt = KeyedJaggedTensor.from_lengths_sync(["b"], torch.tensor([1]), torch.tensor([1]))
    with pytest.raises(ember.Error, match="feature 'a' is not in the batch"):
        collection(kjt)
    with pytest.raises(ember.Error) as error:
        EmbeddingBagCollection([EmbeddingBagConfig("absent", 4, 10, ["a"])], client)
    assert error.value.status == "NOT_FOUND"
