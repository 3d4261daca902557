"""Each bad labelled data set is a one-line DataError naming the file and the column."""

import json
import re

import datasets
import numpy as np
import PIL.Image
import pytest

from shardzoo.data import DataConfig, DataError, make_labelled_datasets
from shardzoo.sharding import get_rules, make_mesh


def run(tmp_path, data, batch=2, label_column="label", mesh=None, rules=None, **kw):
    config = DataConfig(data=data, label_column=label_column, cache_dir=str(tmp_path / "c"), **kw)
    return make_labelled_datasets(config, batch, mesh=mesh, rules=rules, seed=0)


def jsonl(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def fails(pattern, tmp_path, data, **kw):
    with pytest.raises(DataError) as caught:
        run(tmp_path, data, **kw)
    message = str(caught.value)
    assert "\n" not in message, message
    assert re.search(pattern, message), message
    return message


def test_missing_label_column_lists_the_columns(tmp_path):
    path = jsonl(tmp_path, [{"x": 1, "y": 2}] * 4)
    fails(rf"data '{path}' has no column 'label' \(--label-column\); its columns are: x, y",
          tmp_path, path)


def test_missing_feature_column_lists_the_columns(tmp_path):
    path = jsonl(tmp_path, [{"x": 1, "label": 2}] * 4)
    fails(rf"data '{path}' has no column 'z' \(--feature-columns\); its columns are: x, label",
          tmp_path, path, feature_columns=("x", "z"))


def test_no_feature_column_besides_the_label(tmp_path):
    path = jsonl(tmp_path, [{"label": 2}] * 4)
    fails(rf"data '{path}' has no feature columns besides the label 'label'", tmp_path, path)
    both = jsonl(tmp_path, [{"x": 1, "label": 2}] * 4, "both.jsonl")
    fails("column 'label' .* is both the label and a feature", tmp_path, both,
          feature_columns=("x", "label"))


def test_non_numeric_feature_column(tmp_path):
    path = jsonl(tmp_path, [{"x": 1, "name": "ann", "label": 0}] * 4)
    fails(rf"column 'name' of data '{path}' holds string, not numbers", tmp_path, path)


def test_ragged_list_features(tmp_path):
    path = jsonl(tmp_path, [{"x": [1, 2], "label": 0}, {"x": [1, 2], "label": 1},
                            {"x": [1, 2, 3], "label": 0}])
    fails(rf"column 'x' of data '{path}': lists of different lengths \(row 0 has 2 values, "
          "row 2 has 3\\)", tmp_path, path)


def test_missing_feature_values(tmp_path):
    path = jsonl(tmp_path, [{"x": 1.0, "label": 0}, {"x": None, "label": 1}, {"x": 2.0, "label": 0}])
    fails(rf"column 'x' of data '{path}': 1 of 3 rows have no value \(first: row 1\)",
          tmp_path, path)


def test_integer_labels_with_missing_rows_read_as_floats(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("x,label\n1,2\n2,\n3,1\n4,0\n")
    fails(rf"column 'label' of data '{path}': 1 of 4 rows have no value \(first: row 1\) \(an "
          "integer label column with missing values reads as floats\\)", tmp_path, str(path))


def test_float_labels_with_nan(tmp_path):
    path = tmp_path / "n.csv"
    path.write_text("x,label\n1,0.5\n2,nan\n3,1.5\n")
    message = fails(rf"column 'label' of data '{path}': 1 of 3 rows have no value \(first: "
                    "row 1\\)$", tmp_path, str(path))
    assert "integer" not in message


def test_label_of_another_kind(tmp_path):
    path = jsonl(tmp_path, [{"x": 1, "label": {"a": 1}}] * 3)
    fails(rf"column 'label' of data '{path}' holds struct<a: int64>: a label must be", tmp_path, path)


def test_negative_class_id(tmp_path):
    path = jsonl(tmp_path, [{"x": 1, "label": 0}, {"x": 2, "label": -1}])
    fails(rf"column 'label' of data '{path}': row 1 has label -1; class ids must be 0 or more",
          tmp_path, path)


def test_images_of_different_sizes(tmp_path):
    path = tmp_path / "im.parquet"
    images = [np.zeros((8, 8), np.uint8), np.zeros((8, 8), np.uint8), np.zeros((7, 8), np.uint8)]
    datasets.Dataset.from_dict(
        {"image": [PIL.Image.fromarray(a) for a in images], "label": [0, 1, 0]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")}),
    ).to_parquet(str(path))
    fails(rf"column 'image' of data '{path}': images of different shapes \(row 0: \[8, 8\] "
          r"uint8, row 2: \[7, 8\] uint8\)", tmp_path, str(path))


def test_eval_data_with_other_features_or_labels(tmp_path):
    train = jsonl(tmp_path, [{"x": [1, 2], "label": 0}] * 4)
    wider = jsonl(tmp_path, [{"x": [1, 2, 3], "label": 0}] * 2, "wide.jsonl")
    fails(rf"data '{wider}' has 3 features per example but '{train}' has 2 \(columns x\)",
          tmp_path, train, eval_data=wider)
    missing = jsonl(tmp_path, [{"y": [1, 2], "label": 0}] * 2, "other.jsonl")
    fails(rf"data '{missing}' has no column 'x' \(--feature-columns\)", tmp_path, train,
          eval_data=missing)
    named = jsonl(tmp_path, [{"x": [1, 2], "label": "cat"}] * 2, "named.jsonl")
    fails("label column 'label' holds different kinds of labels", tmp_path, train, eval_data=named)


def test_fewer_examples_than_one_batch(tmp_path):
    path = jsonl(tmp_path, [{"x": 1, "label": 0}] * 3)
    fails(rf"data '{path}': 3 examples, fewer than one global batch of 4", tmp_path, path, batch=4)


def test_label_column_with_prompt_column(tmp_path):
    path = jsonl(tmp_path, [{"x": 1, "label": 0}] * 3)
    fails("--label-column cannot be combined with --prompt-column", tmp_path, path,
          prompt_column="x", completion_column="label")


def test_batch_not_divisible_by_its_shards(tmp_path):
    path = jsonl(tmp_path, [{"x": i, "label": 0} for i in range(8)])
    fails("global batch size 4 is not divisible by its 8 shards", tmp_path, path, batch=4,
          mesh=make_mesh("data=8"), rules=get_rules("dp"))
