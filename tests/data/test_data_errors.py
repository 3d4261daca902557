"""Each bad input is a DataError (a UserError) whose message names the file, column or spec."""

import json

import pytest

from shardzoo.data import DataConfig, DataError, load_tokenizer, make_datasets
from shardzoo.errors import UserError

TOK = load_tokenizer("byte")


def run(tmp_path, data, seq_len=8, batch=2, **kw):
    config = DataConfig(data=data, cache_dir=str(tmp_path / "cache"), **kw)
    return make_datasets(config, TOK, seq_len, batch, seed=0)


def jsonl(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_data_error_is_a_user_error():
    assert issubclass(DataError, UserError)


def test_missing_file(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=f"data file '{missing}' does not exist"):
        run(tmp_path, missing)


def test_missing_column_lists_the_columns(tmp_path):
    path = jsonl(tmp_path, [{"body": "x" * 40, "id": 1}])
    with pytest.raises(
        DataError,
        match=rf"'{path}' has no column 'text' \(--text-column\); its columns are: body, id",
    ):
        run(tmp_path, path)
    with pytest.raises(
        DataError, match="no column 'q' \\(--prompt-column\\); its columns are: body, id"
    ):
        run(tmp_path, path, prompt_column="q", completion_column="body")


def test_column_that_is_not_text(tmp_path):
    path = jsonl(tmp_path, [{"text": "x", "id": 1}])
    with pytest.raises(DataError, match=f"column 'id' of data '{path}' holds"):
        run(tmp_path, path, text_column="id")


@pytest.mark.parametrize("content", ["", '{"text": ""}\n{"text": ""}\n'])
def test_empty_dataset(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=f"data '{path}': empty dataset"):
        run(tmp_path, str(path))


def test_fewer_tokens_than_one_batch(tmp_path):
    path = jsonl(tmp_path, [{"text": "tiny"}])
    with pytest.raises(
        DataError, match=f"data '{path}': 5 tokens .*fewer than one global batch of 2 x 8 = 16"
    ):
        run(tmp_path, path)
    sft = jsonl(tmp_path, [{"p": "a", "c": "b"}], "sft.jsonl")
    with pytest.raises(
        DataError, match=f"data '{sft}': 1 examples, fewer than one global batch of 2"
    ):
        run(tmp_path, sft, prompt_column="p", completion_column="c")


@pytest.mark.parametrize("spec", ["hub:someone/some_dataset@train", "someone/some_dataset"])
def test_offline_hub_name(tmp_path, spec):
    with pytest.raises(
        DataError, match=f"data '{spec}' .*Hub dataset 'someone/some_dataset' cannot be loaded"
    ):
        run(tmp_path, spec)


def test_glob_directory_and_format_errors(tmp_path):
    with pytest.raises(DataError, match="matches no files"):
        run(tmp_path, str(tmp_path / "*.parquet"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="empty_dir' holds no data files"):
        run(tmp_path, str(tmp_path / "empty_dir"))
    jsonl(tmp_path / "empty_dir", [{"text": "abc"}])
    (tmp_path / "empty_dir" / "b.csv").write_text("text\nabc\n")
    with pytest.raises(DataError, match="mixes formats \\(csv, json\\)"):
        run(tmp_path, str(tmp_path / "empty_dir"))


def test_bad_options(tmp_path):
    path = jsonl(tmp_path, [{"text": "x" * 40}])
    with pytest.raises(DataError, match="--prompt-column and --completion-column"):
        run(tmp_path, path, prompt_column="text")
    with pytest.raises(DataError, match="not both"):
        run(tmp_path, path, eval_data=path, eval_fraction=0.1)
    with pytest.raises(DataError, match=f"data '{path}' has 1 document: --eval-fraction needs"):
        run(tmp_path, path, eval_fraction=0.5)
    with pytest.raises(DataError, match="tokenizer 'missing_tok.json': no such file"):
        make_datasets(DataConfig(data=path, tokenizer="missing_tok.json"), None, 8, 2)
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(DataError, match="broken holds no tokenizer.json"):
        load_tokenizer(str(broken))
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="tokenizer file .*broken/tokenizer.json: cannot load"):
        load_tokenizer(str(broken))


def test_a_missing_value_is_refused_naming_its_row_and_column_or_skipped_and_counted(tmp_path, capfd):
    """A null text (or prompt, or completion) is never trained on as an empty text: one line
    naming the row and column, or, with skip_missing, the other rows and a count."""
    rows = [{"text": "some text " * 4}, {"text": None}] + [{"text": "more text " * 4}] * 8
    path = jsonl(tmp_path, rows)
    with pytest.raises(DataError, match=rf"data '{path}': row 2 has no value in column 'text' "
                                        r"\(null; 1 of 10 rows lack one\).*--skip-missing"):
        run(tmp_path, path)
    train, _ = run(tmp_path, path, skip_missing=True)
    assert "skipped 1 of 10 rows with no value in 'text'" in capfd.readouterr().err
    full, _ = run(tmp_path, jsonl(tmp_path, [r for r in rows if r["text"]], "clean.jsonl"))
    assert train.batches_per_epoch == full.batches_per_epoch  # the same rows as without the null one
    pairs = [{"prompt": "q", "completion": "a"}] * 8 + [{"prompt": "q", "completion": None}]
    path = jsonl(tmp_path, pairs, "pairs.jsonl")
    with pytest.raises(DataError, match=r"row 9 has no value in column 'completion'"):
        run(tmp_path, path, prompt_column="prompt", completion_column="completion")
