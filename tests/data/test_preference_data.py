"""Preference pairs in TRL's formats: the tokens that score for conversational pairs under a chat
template equal TRL's; the implicit-prompt form reads as the explicit one; truncation is counted;
bad rows are refused naming file, row and column (or skipped and counted), and the CLI exits 2."""

import os
import sys
import warnings

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "train"))
from dpo_fixtures import CHAT_PAIRS, TEXT_PAIRS, save_llama, save_tokenizer, write_jsonl  # noqa: E402

from shardzoo.cli import main  # noqa: E402
from shardzoo.data import DataConfig, DataError, load_tokenizer  # noqa: E402
from shardzoo.data.loader import make_preference_datasets  # noqa: E402

SEQ = 96


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref")
    hf_tok = save_tokenizer(root / "tok")
    save_llama(root / "tok", len(hf_tok), seed=0)  # TRL needs a model beside the tokenizer
    return root / "tok"


def rows_of(path, tok_dir, tmp_path, batch=4, **kw):
    config = DataConfig(data=str(path), preference=True, cache_dir=str(tmp_path / "cache"), **kw)
    train, _ = make_preference_datasets(config, load_tokenizer(str(tok_dir)), SEQ, batch,
                                        process_index=0, process_count=1)
    return train


def scored(batch, i, j):
    return batch["targets"][i, j][batch["loss_mask"][i, j] > 0].tolist()


def trl_tokenized(tok_dir, pairs):
    """TRL's DPOTrainer's tokenization of ``pairs`` (prompt_ids, chosen_ids, rejected_ids)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tok_dir))
    args = DPOConfig(output_dir=str(tok_dir / "trl"), report_to=[], use_cpu=True, bf16=False, max_length=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(pairs),
                             processing_class=tok)
    return [trainer.train_dataset[i] for i in range(len(pairs))]


def test_conversational_pairs_score_the_tokens_trl_scores(tok_dir, tmp_path):
    want = trl_tokenized(tok_dir, CHAT_PAIRS)
    data = rows_of(write_jsonl(tmp_path / "chat.jsonl", CHAT_PAIRS), tok_dir, tmp_path)
    batch = next(data.with_rows(data.rows, in_order=True))
    tok = load_tokenizer(str(tok_dir))
    for i, ex in enumerate(want):
        n = len(ex["prompt_ids"])
        assert tok.decode(ex["chosen_ids"]).startswith(CHAT_PAIRS[i]["chosen"][0]["content"])  # the turn, no header
        for j, which in enumerate(("chosen_ids", "rejected_ids")):
            assert batch["inputs"][i, j, :n].tolist() == ex["prompt_ids"]
            assert scored(batch, i, j) == ex[which]
    # text pairs too: prompt, then completion and eos
    want = trl_tokenized(tok_dir, TEXT_PAIRS)
    data = rows_of(write_jsonl(tmp_path / "text.jsonl", TEXT_PAIRS), tok_dir, tmp_path)
    batch = next(data.with_rows(data.rows, in_order=True))
    for i, ex in enumerate(want):
        assert [scored(batch, i, 0), scored(batch, i, 1)] == [ex["chosen_ids"], ex["rejected_ids"]]
        assert ex["chosen_ids"][-1] == tok.eos_id


def test_the_implicit_prompt_form_reads_as_the_explicit_one(tok_dir, tmp_path):
    implicit = [{"chosen": p["prompt"] + p["chosen"], "rejected": p["prompt"] + p["rejected"]} for p in CHAT_PAIRS]
    a = rows_of(write_jsonl(tmp_path / "explicit.jsonl", CHAT_PAIRS), tok_dir, tmp_path)
    b = rows_of(write_jsonl(tmp_path / "implicit.jsonl", implicit), tok_dir, tmp_path)
    ba, bb = next(a.with_rows(a.rows, in_order=True)), next(b.with_rows(b.rows, in_order=True))
    for key in ("inputs", "targets", "loss_mask"):
        np.testing.assert_array_equal(ba[key], bb[key])


def test_truncation_keeps_the_prompt_end_and_completion_start_and_counts_pairs(tok_dir, tmp_path):
    path = write_jsonl(tmp_path / "text.jsonl", TEXT_PAIRS)
    full = rows_of(path, tok_dir, tmp_path)
    cut = rows_of(path, tok_dir, tmp_path, max_prompt_length=5, max_completion_length=6)
    a, b = next(full.with_rows(full.rows, in_order=True)), next(cut.with_rows(cut.rows, in_order=True))
    for i in range(len(TEXT_PAIRS)):
        prompt = full.rows.prompt_lengths[i]
        assert cut.rows.prompt_lengths[i] == min(prompt, 5)
        assert b["inputs"][i, 0, : cut.rows.prompt_lengths[i]].tolist() == \
            a["inputs"][i, 0, prompt - cut.rows.prompt_lengths[i]: prompt].tolist()  # the prompt's end
        for j in range(2):
            assert scored(b, i, j) == scored(a, i, j)[:6]
    expected = [bool(full.rows.prompt_lengths[i] > 5 or (full.rows.lengths[i] - full.rows.prompt_lengths[i] > 6).any())
                for i in range(len(TEXT_PAIRS))]
    assert b["truncated"].tolist() == [float(e) for e in expected] and sum(expected) > 0
    assert not a["truncated"].any()


BAD = [
    ("missing_column", lambda r: [{k: v for k, v in p.items() if k != "rejected"} for p in r],
     r"no column 'rejected'"),
    ("null", lambda r: r[:2] + [{**r[2], "chosen": None}] + r[3:], r"row 3 has no value in column 'chosen'"),
    ("empty", lambda r: r[:1] + [{**r[1], "rejected": ""}] + r[2:], r"row 2, column 'rejected': empty completion"),
    ("identical", lambda r: r[:3] + [{**r[3], "rejected": r[3]["chosen"]}],
     r"row 4, column 'chosen': identical to column 'rejected'"),
]


@pytest.mark.parametrize("name,edit,message", BAD, ids=[b[0] for b in BAD])
def test_a_bad_row_is_refused_naming_file_row_and_column(tok_dir, tmp_path, name, edit, message):
    path = write_jsonl(tmp_path / f"{name}.jsonl", edit(list(TEXT_PAIRS) * 2))
    with pytest.raises(DataError, match=message) as e:
        rows_of(path, tok_dir, tmp_path)
    assert path in str(e.value) and "\n" not in str(e.value)


def test_skip_missing_skips_and_counts_bad_pairs(tok_dir, tmp_path, capsys):
    rows = list(TEXT_PAIRS) * 2
    rows[1] = {**rows[1], "rejected": rows[1]["chosen"]}
    rows[5] = {**rows[5], "chosen": ""}
    data = rows_of(write_jsonl(tmp_path / "bad.jsonl", rows), tok_dir, tmp_path, skip_missing=True)
    assert len(data.rows) == 6
    assert "skipped 2 of 8 bad preference pairs" in capsys.readouterr().err


def test_the_cli_exits_2_with_one_line_on_a_bad_row(tok_dir, tmp_path, capsys):
    rows = list(TEXT_PAIRS) * 2
    rows[6] = {**rows[6], "chosen": ""}
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    rc = main(["train", "--task", "dpo", "--data", path, "--init-from", str(tok_dir), "--out",
               str(tmp_path / "out"), "--batch-size", "8", "--seq-len", str(SEQ), "--steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert any("row 7, column 'chosen': empty completion" in line and path in line for line in err), err
    assert not os.path.exists(tmp_path / "out" / "checkpoints")


def test_a_row_mixing_text_and_conversations_is_refused(tok_dir, tmp_path):
    rows = list(CHAT_PAIRS)
    rows[2] = {**rows[2], "rejected": "no"}
    with pytest.raises(DataError, match=r"row 3, column 'rejected': holds a str, but the data's 'chosen' column "
                                        r"holds conversations"):
        rows_of(write_jsonl(tmp_path / "mixed.jsonl", rows), tok_dir, tmp_path)
