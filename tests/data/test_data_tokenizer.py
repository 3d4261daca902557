"""The byte tokenizer and Hugging Face tokenizer files (a tiny BPE trained here)."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shardzoo.data import ByteTokenizer, DataConfig, DataError, load_tokenizer, make_datasets

TEXTS = ["hello world, the quick brown fox", "jumps over the lazy dog", "grüße — ünïcode ✓"]


def tiny_bpe(special=("<|endoftext|>",)):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS * 20, trainer)
    return tok


def test_byte_tokenizer_round_trip_and_ids():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.spec == "byte"
    text = "héllo ✓\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == text  # special ids decode to nothing
    assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
    assert max(tok.pad_id, tok.bos_id, tok.eos_id) < tok.vocab_size <= 512
    np.testing.assert_array_equal(tok.encode_batch([text])[0], ids)


def test_byte_tokenizer_saves_and_loads_from_its_directory(tmp_path):
    load_tokenizer("byte").save(str(tmp_path / "tok"))
    assert isinstance(load_tokenizer(str(tmp_path / "tok")), ByteTokenizer)


def test_hf_tokenizer_from_file_and_directory(tmp_path):
    bpe = tiny_bpe()
    bpe.save(str(tmp_path / "tokenizer.json"))
    eot = bpe.token_to_id("<|endoftext|>")
    for spec in (tmp_path / "tokenizer.json", tmp_path):
        tok = load_tokenizer(str(spec))
        assert tok.vocab_size == bpe.get_vocab_size()
        assert (tok.eos_id, tok.bos_id, tok.pad_id) == (eot, eot, eot)  # GPT-2 style fallbacks
        for text in TEXTS + ["unseen wörds\n  and spaces"]:
            ids = tok.encode(text)
            assert ids == bpe.encode(text).ids and eot not in ids
            assert tok.decode(ids) == text
        assert load_tokenizer(tok.spec).encode(TEXTS[0]) == tok.encode(TEXTS[0])


def test_hf_model_directory_special_tokens_from_config_files(tmp_path):
    bpe = tiny_bpe(special=("<s>", "</s>", "<pad>", "<|endoftext|>"))
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>", "pad_token": None})
    )
    (tmp_path / "config.json").write_text(json.dumps({"pad_token_id": bpe.token_to_id("<pad>")}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.bos_id == bpe.token_to_id("<s>")
    assert tok.eos_id == bpe.token_to_id("</s>")  # the config wins over the <|endoftext|> guess
    assert tok.pad_id == bpe.token_to_id("<pad>")

    tok.save(str(tmp_path / "saved"))
    again = load_tokenizer(str(tmp_path / "saved"))
    assert (again.bos_id, again.eos_id, again.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert again.encode(TEXTS[2]) == tok.encode(TEXTS[2])


def test_eos_id_list_in_config_json(tmp_path):
    bpe = tiny_bpe(special=("<|end|>", "<|eot|>"))
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(
        json.dumps({"eos_token_id": [bpe.token_to_id("<|eot|>"), 0]})
    )
    assert load_tokenizer(str(tmp_path)).eos_id == bpe.token_to_id("<|eot|>")


def test_tokenizer_without_eos_is_an_error(tmp_path):
    tiny_bpe(special=()).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataError, match="tokenizer.json: no end-of-text token"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))


def test_packed_rows_with_the_hf_tokenizer(tmp_path):
    tiny_bpe().save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 4))
    config = DataConfig(
        data=str(path), tokenizer=str(tmp_path / "tokenizer.json"), cache_dir=str(tmp_path)
    )
    train, _ = make_datasets(config, None, 8, 2, seed=0)  # tokenizer=None loads config.tokenizer
    tokens = train.rows.tokens[train.rows.segment_ids > 0]
    expected = np.concatenate([tok.encode(t) + [tok.eos_id] for t in TEXTS * 4])
    np.testing.assert_array_equal(tokens, expected)
