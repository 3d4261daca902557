"""``shardzoo data``: the tokens of each row, which of them train, rows and truncation, for text,
prompt/completion, chat and labelled data, as training batches them; bad data is one line."""

import json

import numpy as np
import pytest

from shardzoo.cli import main
from shardzoo.data import DataConfig, load_tokenizer, make_datasets
from shardzoo.data.preview import format_row, row_tokens

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def run(capsys, *args):
    capsys.readouterr()
    rc = main(["data", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def show(capsys, *args):
    rc, out, err = run(capsys, *args, "--json")
    assert rc == 0, err
    return json.loads(out)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardzoo data: error: "), stderr
    return lines[0]


def text_of(tokens, train=None):
    return "".join(t["text"] for t in tokens if t["segment"] and (train is None or t["train"] == train))


def test_text_rows_match_the_training_batches(tmp_path, capsys):
    data = write_jsonl(tmp_path / "c.jsonl", [{"text": "the quick brown fox"}, {"text": "jumps over the lazy dog"}])
    p = show(capsys, "--data", data, "--seq-len", 16, "--batch-size", 2, "--rows", 4)
    s = p["train"]
    # 19 + 1 and 23 + 1 bytes with eos: 44 tokens, 3 rows of 16, 4 padding
    assert (p["layout"], s["documents"], s["tokens"], s["rows"], s["padding_tokens"]) == ("text", 2, 44, 3, 4)
    assert s["truncated_documents"] == s["tokens_cut"] == 0
    rows = p["shown"]
    assert len(rows) == 3 and text_of(rows[0]["tokens"]) == "the quick brown "
    # the first token of a row and of a document never trains (nothing predicts it); the rest do
    assert [t["train"] for t in rows[1]["tokens"][:6]] == [False, True, True, True, False, True]
    assert [t["text"] for t in rows[1]["tokens"][:5]] == ["f", "o", "x", "<eos>", "j"]
    # what trains is what the training batches weight
    train, _ = make_datasets(DataConfig(data=str(data)), None, 16, 2)
    weights = train.rows.batch(np.arange(3))["weights"]
    # 44 tokens less the 3 row starts and the second document's start
    assert s["train_tokens"] == int(weights.sum()) == 44 - 4
    assert sum(t["train"] for r in rows for t in r["tokens"]) == s["train_tokens"]


def test_prompt_completion_rows_train_the_completion_and_count_truncation(tmp_path, capsys):
    data = write_jsonl(tmp_path / "pc.jsonl", [{"q": "2+2=", "a": "4"}, {"q": "say hi: ", "a": "hello there, friend"}])
    p = show(capsys, "--data", data, "--prompt-column", "q", "--completion-column", "a", "--seq-len", 16,
             "--batch-size", 2)
    s = p["train"]
    assert (p["layout"], s["documents"], s["rows"]) == ("prompt/completion", 2, 2)
    assert s["truncated_documents"] == 1 and s["tokens_cut"] == 8 + 19 + 1 - 16
    first, second = (r["tokens"] for r in p["shown"])
    assert text_of(first, train=False) == "2+2=" and text_of(first, train=True) == "4<eos>"
    assert text_of(second, train=True) == "hello th"  # cut at 16 tokens: no eos
    assert sum(t["segment"] == 0 for t in first) == 16 - 6


def test_chat_rows_train_the_assistant_turns_only(tmp_path, capsys):
    tok = tmp_path / "tok"
    load_tokenizer("byte").save(str(tok))
    (tok / "chat_template.jinja").write_text(TEMPLATE)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}] * 2)
    p = show(capsys, "--data", data, "--chat-column", "messages", "--tokenizer", tok, "--seq-len", 80,
             "--batch-size", 1)
    (row,) = p["shown"][:1]
    # two conversations in one row, each "<user>hi</s>\n<assistant>" (no loss), "hello</s>\n" (loss)
    assert text_of(row["tokens"]) == ("<user>hi</s>\n<assistant>hello</s>\n" * 2).replace("\n", "\\n")
    assert text_of(row["tokens"], train=True) == "hello</s>\\n" * 2
    assert p["train"]["train_tokens"] == 2 * len("hello</s>\n")
    human = run(capsys, "--data", data, "--chat-column", "messages", "--tokenizer", tok, "--seq-len", 80,
                "--batch-size", 1, "--rows", 1)[1]
    assert "[[<|u|s|e|r|>|h|i|<|/|s|>|\\n|<|a|s|s|i|s|t|a|n|t|>]]|h|e|l|l|o|<|/|s|>|\\n||[[<|u|s" in human


def test_labelled_rows_show_class_names_and_counts(tmp_path, capsys):
    data = tmp_path / "pets.csv"
    data.write_text("w,h,label\n" + "".join(f"{i},{i % 3},{['cat', 'dog', 'eel'][i % 3]}\n" for i in range(10)))
    p = show(capsys, "--data", data, "--label-column", "label", "--batch-size", 2, "--rows", 3,
             "--eval-fraction", "0.2")
    assert (p["task"], p["features"], p["classes"]) == ("classification", 2, ["cat", "dog", "eel"])
    assert p["train"]["examples"] + p["eval"]["examples"] == 10 and p["eval"]["examples"] == 2
    assert sum(p["train"]["class_counts"].values()) == 8
    for item in p["shown"]:
        assert item["class"] == ["cat", "dog", "eel"][int(item["features"][0]) % 3]
    human = run(capsys, "--data", data, "--label-column", "label", "--batch-size", 2)[1]
    assert "3 classes (cat, dog, eel)" in human and "label 0 (cat)" in human


def test_format_row_brackets_what_does_not_train():
    class Tok:
        bos_id, eos_id, pad_id = 257, 258, 256

        def decode(self, ids, skip_special=True):
            return bytes(i for i in ids if i < 256).decode()

    from shardzoo.data.packing import Rows

    rows = Rows(np.asarray([[97, 98, 258, 99, 100, 256]], np.int32), np.asarray([[1, 1, 1, 2, 2, 0]], np.int32),
                np.asarray([[1, 1, 1, 1, 1, 0]], bool), 256)
    line = format_row(0, row_tokens(rows, 0, Tok()))
    assert line == "row 0: 6 tokens, 2 documents, 3 train\n  [[a]]|b|<eos>||[[c]]|d + 1 x <pad>"


@pytest.mark.parametrize("flags, expected", [
    (["--data", "MISSING.jsonl"], "MISSING.jsonl"),
    (["--text-column", "body"], "has no column 'body'"),
    (["--prompt-column", "text"], "--prompt-column and --completion-column must be given together"),
    (["--split", "eval"], "--split eval: this data spec holds out no eval split"),
    (["--rows", "-1"], "--rows must be 0 or more"),
    (["--seq-len", "0"], "--seq-len must be at least 1"),
])
def test_bad_data_flags_are_one_line(snapshot, tmp_path, flags, expected, capsys):
    data = write_jsonl(tmp_path / "c.jsonl", [{"text": "the quick brown fox"}, {"text": None}])
    args = ["--data", data, "--skip-missing", *flags]
    before = snapshot(tmp_path)
    rc, out, err = run(capsys, *args)
    line = one_line(err)
    assert rc == 2 and expected in line, line
    assert out == "" and snapshot(tmp_path) == before


def test_a_null_text_is_refused_as_training_refuses_it(tmp_path, capsys):
    data = write_jsonl(tmp_path / "c.jsonl", [{"text": "the quick brown fox"}, {"text": None}])
    rc, out, err = run(capsys, "--data", data)
    line = one_line(err)
    assert rc == 2 and "row 2 has no value in column 'text'" in line and "--skip-missing" in line, line


def test_special_tokens_show_their_text_and_an_end_of_turn_equal_to_pad_is_not_padding(tmp_path, capsys):
    """A chat tokenizer whose end of turn is also its pad id (GPT-2 style): ``<|user|>`` and
    ``<|endoftext|>`` print as themselves inside the row, padding only where the row is padding."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = tmp_path / "tok"
    tok.mkdir()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|user|>", "<|assistant|>"]
    bpe.train_from_iterator(["hi", "hello"] * 4, trainers.BpeTrainer(
        vocab_size=270, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(tok / "tokenizer.json"))
    (tok / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "chat_template": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|endoftext|>{% endfor %}"}))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}])
    flags = ["--data", data, "--chat-column", "messages", "--tokenizer", tok, "--seq-len", 12, "--batch-size", 1]
    (row,) = show(capsys, *flags)["shown"]
    words = [t["text"] for t in row["tokens"] if t["segment"]]
    assert words == ["<|user|>", "hi", "<|endoftext|>", "<|assistant|>", "hello", "<|endoftext|>"], words
    pad_id = load_tokenizer(str(tok)).pad_id
    assert row["tokens"][2]["id"] == row["tokens"][-1]["id"] == pad_id  # the same id, told apart by segment
    # the loss mask: the assistant's reply and its end of turn train, the user's turn does not
    assert [t["train"] for t in row["tokens"] if t["segment"]] == [False] * 4 + [True] * 2
    human = run(capsys, *flags)[1]
    assert "[[<|user|>|hi|<|endoftext|>|<|assistant|>]]|hello|<|endoftext|> + 6 x <pad>" in human, human
