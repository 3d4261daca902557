"""Chat rows (--chat-column): loss only on assistant turns, with and without {% generation %}
markers, through truncation and packing; transformers' assistant masks agree; a template whose
assistant turns cannot be found is refused."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shardzoo.data import DataConfig, DataError, load_tokenizer, make_datasets
from shardzoo.data.chat import ChatRenderer, encode_chat

# A Phi-3-like template: role header, content, end-of-turn. MARKED puts the assistant's content and
# end-of-turn inside {% generation %}; PLAIN is the same text without markers.
MARKED = (
    "{% for m in messages %}<|{{ m.role }}|>\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|end|>\n{% endgeneration %}"
    "{% else %}{{ m.content }}<|end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PLAIN = MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# Qwen2.5-like ChatML: a default system turn when the chat has none.
CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou help.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Marks the last message, so a prefix renders unlike the whole conversation; no markers.
UNMASKABLE = "{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}"

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]
# The rendered two-turn chat, piece by piece, and whether the piece is a loss target (worked by hand).
PIECES = [
    ("<|system|>\nBe brief.<|end|>\n", 0),
    ("<|user|>\nHi<|end|>\n", 0),
    ("<|assistant|>\n", 0),  # the generation prompt: never a target
    ("Hello!<|end|>\n", 1),
    ("<|user|>\n2+2?<|end|>\n", 0),
    ("<|assistant|>\n", 0),
    ("4<|end|>\n", 1),
]
TEXT = "".join(p for p, _ in PIECES)
TARGETS = 14 + 9  # len("Hello!<|end|>\n") + len("4<|end|>\n")


def byte_tokenizer(tmp_path, template, name="tok"):
    """A saved byte tokenizer with ``template`` as its chat_template.jinja."""
    directory = tmp_path / name
    load_tokenizer("byte").save(str(directory))
    (directory / "chat_template.jinja").write_text(template)
    return load_tokenizer(str(directory))


def write_chats(path, chats, column="messages"):
    path.write_text("".join(json.dumps({column: c, "id": i}) + "\n" for i, c in enumerate(chats)))
    return str(path)


def batches(path, tok, seq_len, batch, tmp_path, **kw):
    config = DataConfig(data=path, chat_column="messages", cache_dir=str(tmp_path / "cache"), **kw)
    train, _ = make_datasets(config, tok, seq_len, batch, process_index=0, process_count=1)
    return train


def expected_weights(pieces, seq_len):
    """The weights of one row holding ``pieces``: the weight at t is for predicting token t + 1."""
    target = np.concatenate([np.full(len(p.encode()), flag, np.float32) for p, flag in pieces])
    weights = np.zeros(seq_len, np.float32)
    weights[: len(target) - 1] = target[1:]
    return weights


@pytest.mark.parametrize("template", [MARKED, PLAIN], ids=["generation-markers", "prefixes"])
def test_two_turn_chat_has_loss_on_assistant_content_and_end_of_turn_only(template, tmp_path):
    tok = byte_tokenizer(tmp_path, template)
    seq_len = len(TEXT) + 6
    path = write_chats(tmp_path / "chat.jsonl", [CHAT])
    row = {k: v[0] for k, v in next(batches(path, tok, seq_len, 1, tmp_path)).items()}
    assert tok.decode(row["inputs"][row["segment_ids"] > 0]) == TEXT
    np.testing.assert_array_equal(row["weights"], expected_weights(PIECES, seq_len))
    assert row["weights"].sum() == TARGETS
    # each weighted target is an assistant character: "Hello!<|end|>\n" and "4<|end|>\n"
    assert tok.decode(row["targets"][row["weights"] > 0]) == "Hello!<|end|>\n4<|end|>\n"


def test_truncation_and_packing_keep_each_conversation_and_its_mask(tmp_path):
    tok = byte_tokenizer(tmp_path, MARKED)
    chats = [CHAT[1:3], CHAT[3:], CHAT, CHAT[1:3], [CHAT[1], {"role": "assistant", "content": "x" * 90}]]
    seq_len = 96  # rows: chats 0 and 1 (47 + 44 tokens), 2 (119, cut), 3, 4 (131, cut)
    path = write_chats(tmp_path / "chats.jsonl", chats)
    renderer = ChatRenderer(MARKED, {}, "test", "messages")
    wanted = [encode_chat(renderer, tok, c, i) for i, c in enumerate(chats)]
    rows = batches(path, tok, seq_len, 1, tmp_path).rows
    got = []
    for r in range(len(rows)):
        batch = rows.batch(np.array([r]))
        seg, weights = batch["segment_ids"][0], batch["weights"][0]
        for s in range(1, seg.max() + 1):
            (where,) = np.nonzero(seg == s)
            got.append(where)
            ids, mask = wanted[len(got) - 1]
            n = min(len(ids), seq_len)
            assert len(where) == n and where[0] + n - 1 == where[-1]  # whole and contiguous
            np.testing.assert_array_equal(batch["inputs"][0][where], ids[:n])
            np.testing.assert_array_equal(batch["positions"][0][where], np.arange(n))
            # weight t predicts token t + 1 of the same conversation; none past its end
            np.testing.assert_array_equal(weights[where], np.append(mask[1:n], 0))
        assert weights[seg == 0].sum() == 0
    assert len(got) == len(chats)
    assert [len(ids) for ids, _ in wanted] == [47, 44, 119, 47, 131]
    assert len(rows) == 4 and rows.segment_ids[0].max() == 2  # the first row holds two


def tiny_hf_tokenizer(directory, template, in_config):
    """A byte-level BPE with chat special tokens, saved by transformers with ``template`` either
    in tokenizer_config.json or as chat_template.jinja."""
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
                "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([TEXT * 3, "the answer is four, hello there"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                   additional_special_tokens=specials[1:], chat_template=template)
    fast.save_pretrained(str(directory))
    if in_config:  # the older form: the template inside tokenizer_config.json
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config["chat_template"] = (directory / "chat_template.jinja").read_text()
        config_file.write_text(json.dumps(config))
        (directory / "chat_template.jinja").unlink()
    return fast


FAMILIES = {  # template, conversation, what the masked tokens decode to
    "phi3-like": (MARKED, CHAT, "Hello!<|end|>\n4<|end|>\n"),
    "chatml": (CHATML, CHAT[1:], "Hello!<|im_end|>\n4<|im_end|>\n"),
}


@pytest.mark.parametrize("family, in_config", [("phi3-like", False), ("phi3-like", True),
                                               ("chatml", False)])
def test_hf_tokenizer_masks_equal_transformers_assistant_masks_and_save_keeps_the_template(
        family, in_config, tmp_path):
    marked, chat, answers = FAMILIES[family]
    fast = tiny_hf_tokenizer(tmp_path / "hf", marked, in_config)
    want = fast.apply_chat_template(chat, tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)
    tok = load_tokenizer(str(tmp_path / "hf"))
    assert tok.chat_template.source == marked
    ids, mask = encode_chat(ChatRenderer(marked, tok.special_tokens, "t", "messages"), tok, chat, 0)
    assert ids.tolist() == list(want["input_ids"])
    assert mask.astype(int).tolist() == list(want["assistant_masks"])
    assert fast.decode(ids[mask]) == answers
    # the same text without markers: prefixes find the same tokens
    plain = marked.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    _, by_prefix = encode_chat(ChatRenderer(plain, tok.special_tokens, "t", "messages"), tok, chat, 0)
    np.testing.assert_array_equal(by_prefix, mask)

    tok.save(str(tmp_path / "saved"))
    config = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    assert (config.get("chat_template") == marked) == in_config
    assert (tmp_path / "saved" / "chat_template.jinja").exists() != in_config
    assert load_tokenizer(str(tmp_path / "saved")).chat_template.source == marked


@pytest.mark.parametrize("case", ["unmaskable", "no template", "no assistant", "cut before the assistant",
                                  "not messages"])
def test_chats_that_cannot_be_masked_are_refused(case, tmp_path):
    chats = [CHAT] * 4
    tok = byte_tokenizer(tmp_path, MARKED)
    if case == "unmaskable":
        tok, expected = byte_tokenizer(tmp_path, UNMASKABLE, "bad"), "cannot be found"
    elif case == "no template":
        tok, expected = load_tokenizer("byte"), "has no chat template"
    elif case == "no assistant":
        chats, expected = [CHAT[:2]] * 4, "no assistant token in any conversation"
    elif case == "cut before the assistant":  # its first token is the 98th of the conversation
        long = [{"role": "system", "content": "Be brief." * 5}, *CHAT[1:3]]
        chats, expected = [long] * 4, "no assistant token within the first --seq-len 64"
    else:
        chats, expected = [[{"role": "user"}]] * 4, "not a {role, content} mapping"
    path = write_chats(tmp_path / "chats.jsonl", chats)
    with pytest.raises(DataError, match=expected) as info:
        batches(path, tok, 64, 1, tmp_path)
    assert "\n" not in str(info.value) and "messages" in str(info.value)


# --------------------------------------------------------------------------- the command line
TINY = ["--override", "hidden_size=32", "--override", "intermediate_size=64",
        "--override", "num_hidden_layers=1", "--override", "num_key_value_heads=4"]
QA = [("Hi", "Hello!"), ("2+2?", "4"), ("Name?", "Zoo."), ("Bye", "See you."),
      ("Color?", "Blue."), ("Yes?", "No."), ("Up?", "Down."), ("Sky?", "Big.")]


def train_args(tmp_path, tokenizer, out):
    chats = [[CHAT[0], {"role": "user", "content": q}, {"role": "assistant", "content": a}]
             for q, a in QA] * 8
    data = write_chats(tmp_path / "chat.jsonl", chats)
    return ["train", "--model", "llama-tiny", *TINY, "--data", data, "--chat-column", "messages",
            "--tokenizer", str(tokenizer), "--out", str(out), "--steps", "16", "--batch-size", "8",
            "--seq-len", "64", "--lr", "1e-2", "--warmup-steps", "2", "--log-every", "1",
            "--save-every", "0", "--eval-every", "0"]


def test_cli_chat_fine_tune_loss_falls_and_export_keeps_the_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from shardzoo.cli import main
    from shardzoo.train.metrics import read_metrics

    tiny_hf_tokenizer(tmp_path / "tok", MARKED, in_config=False)
    run, exported = tmp_path / "run", tmp_path / "exported"
    assert main(train_args(tmp_path, tmp_path / "tok", run)) == 0
    losses = [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 16 and np.mean(losses[-3:]) < np.mean(losses[:3]) - 1.0, losses
    assert (run / "tokenizer" / "chat_template.jinja").read_text() == MARKED

    assert main(["export-hf", str(run), str(exported)]) == 0
    assert (exported / "chat_template.jinja").read_text() == MARKED
    assert AutoTokenizer.from_pretrained(str(exported)).chat_template == MARKED


def test_cli_template_without_findable_turns_exits_2_with_one_line_and_writes_nothing(
        tmp_path, capsys):
    from shardzoo.cli import main

    tiny_hf_tokenizer(tmp_path / "tok", UNMASKABLE, in_config=False)
    capsys.readouterr()
    assert main(train_args(tmp_path, tmp_path / "tok", tmp_path / "run")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardzoo train: error: chat template "), lines
    assert "cannot be found" in lines[0] and "--chat-column messages" in lines[0]
    assert not (tmp_path / "run").exists()
