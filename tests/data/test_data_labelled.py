"""Labelled examples (features and a label): batches, epochs, resume, processes, meshes, tasks."""

import csv
import json

import datasets
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardzoo.data import DataConfig, make_datasets, make_labelled_datasets
from shardzoo.sharding import get_rules, make_mesh

BATCH = 8  # 50 digits: 7 batches an epoch, the last with 6 fill-up rows


def make(path, tmp_path, batch=BATCH, seed=3, **kw):
    kw.setdefault("label_column", "label")
    config = DataConfig(data=path, cache_dir=str(tmp_path / "cache"), **kw)
    return make_labelled_datasets(config, batch, seed=seed)


def take(it, n):
    return [next(it) for _ in range(n)]


def example_ids(batches, images):
    """Which digit (index into ``images``) each weighted row of the batches is."""
    flat = images.reshape(len(images), -1).astype(np.float32) / 255
    ids = []
    for b in batches:
        for row, w in zip(b["inputs"], b["weights"], strict=True):
            if w:
                (match,) = np.flatnonzero(np.abs(flat - row).max(axis=1) < 1e-6)
                ids.append(int(match))
    return ids


def test_image_parquet_gives_scaled_pixels_and_class_ids(digits, tmp_path):
    path, images, labels = digits
    train, evaluation = make(path, tmp_path)
    assert evaluation is None
    assert (train.task, train.num_features, train.num_classes, train.num_outputs) == (
        "classification", 64, 10, 10)
    assert train.label_names is None
    batch = next(train)
    assert set(batch) == {"inputs", "targets", "weights"}
    assert batch["inputs"].shape == (BATCH, 64) and batch["inputs"].dtype == np.float32
    assert batch["targets"].shape == (BATCH,) and batch["targets"].dtype == np.int32
    assert batch["weights"].shape == (BATCH,) and batch["weights"].dtype == np.float32
    ids = example_ids([batch], images)  # each row is one digit's pixels / 255, with its label
    assert len(ids) == BATCH
    np.testing.assert_allclose(
        batch["inputs"], images[ids].reshape(BATCH, 64) / np.float32(255), atol=1e-6
    )
    np.testing.assert_array_equal(batch["targets"], labels[ids])
    assert batch["inputs"].max() <= 1.0 and batch["inputs"].max() > 0.9  # ink 200 + noise


def test_every_example_once_per_epoch_and_fill_up_rows_weigh_nothing(digits, tmp_path):
    path, images, _ = digits
    train, _ = make(path, tmp_path)
    assert train.batches_per_epoch == 7
    epochs = [take(train, 7) for _ in range(2)]
    orders = [example_ids(e, images) for e in epochs]
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(50))
    assert orders[0] != orders[1]  # a new permutation each epoch
    last = epochs[0][-1]
    np.testing.assert_array_equal(last["weights"], [1, 1, 0, 0, 0, 0, 0, 0])
    assert not last["inputs"][2:].any() and not last["targets"][2:].any()
    again, _ = make(path, tmp_path)  # same seed, same order
    assert example_ids(take(again, 7), images) == orders[0]


@pytest.mark.parametrize("skip", [3, 7, 6])
def test_restore_gives_exactly_the_next_batches(digits, tmp_path, skip):
    path, _, _ = digits
    train, _ = make(path, tmp_path)
    take(train, skip)
    state = json.loads(json.dumps(train.state()))
    expected = take(train, 9)  # crosses an epoch boundary
    resumed, _ = make(path, tmp_path)
    resumed.restore(state)
    for want, got in zip(expected, take(resumed, 9), strict=True):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_processes_get_disjoint_rows_of_the_global_batch(digits, tmp_path):
    path, images, _ = digits
    config = DataConfig(data=path, label_column="label", cache_dir=str(tmp_path / "cache"))
    whole, _ = make_labelled_datasets(config, BATCH, seed=1, process_index=0, process_count=1)
    parts = [
        make_labelled_datasets(config, BATCH, seed=1, process_index=i, process_count=2)[0]
        for i in range(2)
    ]
    for _ in range(whole.batches_per_epoch):
        want, got = next(whole), [next(p) for p in parts]
        for key in want:
            assert got[0][key].shape[0] == BATCH // 2
            np.testing.assert_array_equal(np.concatenate([g[key] for g in got]), want[key])
        ids = [set(example_ids([g], images)) for g in got]
        assert not ids[0] & ids[1]


@pytest.mark.parametrize(
    "rules, mesh_spec, batch_axes",
    [("dp", "data=8", "data"), ("fsdp", "data=2,fsdp=4", ("data", "fsdp"))],
)
def test_mesh_gives_global_arrays_sharded_on_the_batch(digits, tmp_path, rules, mesh_spec, batch_axes):
    path, _, _ = digits
    mesh = make_mesh(mesh_spec)
    config = DataConfig(
        data=path, label_column="label", eval_fraction=0.2, cache_dir=str(tmp_path / "cache")
    )
    train, evaluation = make_labelled_datasets(config, BATCH, mesh=mesh, rules=get_rules(rules))
    plain, plain_eval = make_labelled_datasets(config, BATCH)
    pairs = [(next(train), next(plain)) for _ in range(train.batches_per_epoch + 1)]
    pairs += list(zip(evaluation, plain_eval, strict=True))
    want = {"inputs": P(batch_axes, None), "targets": P(batch_axes), "weights": P(batch_axes)}
    for batch, numpy_batch in pairs:
        for key, array in batch.items():
            assert isinstance(array, jax.Array) and array.shape == numpy_batch[key].shape
            assert array.sharding.is_equivalent_to(NamedSharding(mesh, want[key]), array.ndim)
            assert len(array.addressable_shards) == 8
            assert array.addressable_shards[0].data.shape[0] == BATCH // 8
            np.testing.assert_array_equal(np.asarray(array), numpy_batch[key])


def test_eval_fraction_holds_out_whole_examples(digits, tmp_path):
    path, images, _ = digits
    train, evaluation = make(path, tmp_path, eval_fraction=0.2)
    assert (len(train.rows), len(evaluation.rows)) == (40, 10)
    train_ids = example_ids(take(train, train.batches_per_epoch), images)
    eval_ids = example_ids(list(evaluation), images)
    assert sorted(train_ids + eval_ids) == list(range(50))
    assert eval_ids == sorted(eval_ids)  # eval goes in data order
    assert example_ids(list(evaluation), images) == eval_ids  # each pass is the same
    _, other = make(path, tmp_path, eval_fraction=0.2, seed=4)  # the seed picks the held-out set
    assert example_ids(list(other), images) != eval_ids


def test_regression_jsonl_with_list_features_and_list_labels(tmp_path):
    path = tmp_path / "reg.jsonl"
    rows = [{"x": [i, 2 * i], "scale": i % 3, "y": [0.5 * i, -1.0]} for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = DataConfig(
        data=str(path), label_column="y", feature_columns=("scale", "x"),
        cache_dir=str(tmp_path / "cache"),
    )
    train, _ = make_labelled_datasets(config, 4, seed=0)
    assert (train.task, train.num_features, train.num_outputs, train.num_classes) == (
        "regression", 3, 2, None)
    batches = take(train, 3)
    for b in batches:
        assert b["targets"].shape == (4, 2) and b["targets"].dtype == np.float32
        assert b["inputs"].dtype == np.float32
    inputs = np.concatenate([b["inputs"] for b in batches])
    targets = np.concatenate([b["targets"] for b in batches])
    order = np.argsort(inputs[:, 1])  # x[0] = i, in the column order given: scale, x
    i = np.arange(12, dtype=np.float32)
    np.testing.assert_array_equal(inputs[order], np.stack([i % 3, i, 2 * i], 1))  # ints not scaled
    np.testing.assert_array_equal(targets[order], np.stack([0.5 * i, -np.ones(12)], 1))


def test_regression_csv_with_a_float_label(tmp_path):
    path = tmp_path / "houses.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["rooms", "area", "price"])
        w.writerows([[r, 10.5 * r, 1.25 * r] for r in range(1, 9)])
    config = DataConfig(data=str(path), label_column="price", cache_dir=str(tmp_path / "cache"))
    train, _ = make_labelled_datasets(config, 8, seed=0)
    b = next(train)
    assert (train.num_features, train.num_outputs) == (2, 1) and b["targets"].shape == (8, 1)
    np.testing.assert_allclose(b["targets"][:, 0], 1.25 * b["inputs"][:, 0], rtol=1e-6)
    np.testing.assert_allclose(b["inputs"][:, 1], 10.5 * b["inputs"][:, 0], rtol=1e-6)


def test_string_labels_are_ids_in_sorted_order_across_train_and_eval(tmp_path):
    train_path, eval_path = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train_path.write_text("".join(
        json.dumps({"f": i, "animal": a}) + "\n" for i, a in enumerate(["dog", "cat", "dog", "emu"])
    ))
    eval_path.write_text(json.dumps({"animal": "ant", "f": 9}) + "\n")
    config = DataConfig(
        data=str(train_path), eval_data=str(eval_path), label_column="animal",
        cache_dir=str(tmp_path / "cache"),
    )
    train, evaluation = make_labelled_datasets(config, 4, seed=0)
    assert train.label_names == evaluation.label_names == ("ant", "cat", "dog", "emu")
    assert train.num_classes == 4
    b = next(train)
    by_feature = dict(zip(b["inputs"][:, 0].tolist(), b["targets"].tolist(), strict=True))
    assert by_feature == {0.0: 2, 1.0: 1, 2.0: 2, 3.0: 3}
    (e,) = list(evaluation)
    assert e["targets"][0] == 0 and e["inputs"][0, 0] == 9 and e["weights"].tolist() == [1, 0, 0, 0]


def test_class_label_names_and_uint8_arrays(tmp_path):
    path = tmp_path / "arr.parquet"
    pixels = np.arange(8 * 6, dtype=np.uint8).reshape(8, 2, 3) * 5
    datasets.Dataset.from_dict(
        {"a": list(pixels), "k": [i % 3 for i in range(8)]},
        features=datasets.Features(
            {"a": datasets.Array2D((2, 3), "uint8"), "k": datasets.ClassLabel(names=["x", "y", "z"])}
        ),
    ).to_parquet(str(path))
    config = DataConfig(data=str(path), label_column="k", cache_dir=str(tmp_path / "cache"))
    train, _ = make_labelled_datasets(config, 8, seed=0)
    assert train.label_names == ("x", "y", "z") and train.num_classes == 3
    b = next(train)
    row = np.argsort(b["inputs"][:, 0])
    np.testing.assert_allclose(b["inputs"][row], pixels.reshape(8, 6) / np.float32(255), atol=1e-7)
    np.testing.assert_array_equal(b["targets"][row], np.arange(8) % 3)


def test_language_model_datasets_refuse_a_label_column(digits, tmp_path):
    with pytest.raises(ValueError, match="make_labelled_datasets"):
        make_datasets(DataConfig(data=digits[0], label_column="label"), None, 8, 2)
