"""Every local format, directories, globs, the embedded corpus and the spec syntax."""

import csv
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardzoo.data import DataConfig, load_source, load_tokenizer, make_datasets
from shardzoo.data.corpus import stdlib_corpus, stdlib_files
from shardzoo.data.sources import parse_hub_spec

DOCS = [f'document {i}\nwith, a comma and "quotes" ✓ {"z" * i}' for i in range(6)]
TOK = load_tokenizer("byte")


def write(tmp_path, fmt, column="body"):
    """DOCS in one format; returns the spec to load them (text: a directory of files)."""
    rows = [{column: d, "n": i} for i, d in enumerate(DOCS)]
    path = tmp_path / f"data.{fmt}"
    if fmt == "txt":
        path = tmp_path / "texts"
        path.mkdir()
        for i, d in enumerate(DOCS):
            (path / f"{i:02d}.txt").write_text(d)
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif fmt == "csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, [column, "n"])
            writer.writeheader()
            writer.writerows(rows)
    return str(path)


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "json", "parquet", "csv"])
def test_each_format_loads_every_document(tmp_path, fmt):
    spec = write(tmp_path, fmt)
    column = "text" if fmt == "txt" else "body"
    ds = load_source(spec, cache_dir=str(tmp_path / "cache"))
    assert list(ds[column]) == DOCS
    config = DataConfig(data=spec, text_column=column, cache_dir=str(tmp_path / "cache"))
    train, _ = make_datasets(config, TOK, 8, 2, seed=0)
    expected = np.concatenate([TOK.encode(d) + [TOK.eos_id] for d in DOCS])
    np.testing.assert_array_equal(train.rows.tokens[train.rows.segment_ids > 0], expected)


def test_glob_and_directory_read_files_in_sorted_order(tmp_path):
    root = tmp_path / "parts"
    (root / ".hidden").mkdir(parents=True)
    for i in (2, 0, 1):
        (root / f"part{i}.jsonl").write_text(json.dumps({"text": f"part {i}"}) + "\n")
    (root / "notes.log").write_text("not data")
    (root / ".hidden" / "x.jsonl").write_text(json.dumps({"text": "hidden"}) + "\n")
    by_glob = load_source(str(root / "part*.jsonl"), cache_dir=str(tmp_path / "c"))
    by_dir = load_source(str(root), cache_dir=str(tmp_path / "c"))
    assert list(by_glob["text"]) == list(by_dir["text"]) == ["part 0", "part 1", "part 2"]


def test_embedded_stdlib_corpus():
    files = stdlib_files()
    ds = load_source("stdlib")
    assert ds.column_names == ["text"] and len(ds) == len(files) > 10
    assert ds[0]["text"] == files[0].read_text(encoding="utf-8", errors="replace")
    assert [f.name for f in files] == sorted(f.name for f in files)
    assert sum(len(t.encode()) for t in ds["text"]) <= 4 << 20


def test_stdlib_corpus_needs_no_pickled_fingerprint(monkeypatch):
    """datasets 5.0.1 with pyarrow 25 could not dill-pickle a new dataset's state to fingerprint
    it (``PicklingError: Can't pickle <class 'MonthDayNano'>``): the corpus gives its own
    fingerprint, a hash of its texts, so that hashing is never asked for."""
    import pickle

    import datasets.arrow_dataset

    def unpicklable(dataset):
        raise pickle.PicklingError("Can't pickle <class 'MonthDayNano'>")

    monkeypatch.setattr(datasets.arrow_dataset, "generate_fingerprint", unpicklable)
    ds = load_source("stdlib")
    assert ds["text"] == [f.read_text(encoding="utf-8", errors="replace") for f in stdlib_files()]
    assert ds._fingerprint == load_source("stdlib")._fingerprint  # the same texts, the same cache key
    assert stdlib_corpus(max_files=3)._fingerprint != ds._fingerprint


def test_hub_spec_syntax():
    assert parse_hub_spec("hub:wikitext:wikitext-2-raw-v1@validation") == (
        "wikitext",
        "wikitext-2-raw-v1",
        "validation",
    )
    assert parse_hub_spec("hub:owner/name") == ("owner/name", None, "train")
    assert parse_hub_spec("owner/name@test") == ("owner/name", None, "test")
