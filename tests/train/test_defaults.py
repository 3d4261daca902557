"""The defaults every command shares (``train/defaults.py``): rules and mesh, sequence length,
and whether a tokenizer adds bos by itself."""

import json

import pytest

from shardzoo.data import load_tokenizer
from shardzoo.models import get_model
from shardzoo.sharding.mesh import describe_mesh
from shardzoo.train.defaults import adds_bos, default_seq_len, mesh_and_rules
from shardzoo.train.model_info import max_positions


def _bpe(tmp_path, post_processor=None):
    """A tiny BPE tokenizer dir with <s>/</s> (and tokenizer_config.json naming them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["a quick brown fox"] * 10, trainer)
    if post_processor is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=post_processor, special_tokens=[("<s>", tokenizer.token_to_id("<s>")),
                                                   ("</s>", tokenizer.token_to_id("</s>"))])
    tmp_path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return str(tmp_path)


@pytest.mark.parametrize("post_processor, expected", [
    ("<s> $A", True),  # Llama's post-processor starts every text with bos
    (None, False),  # no post-processor: nothing is added
    ("$A </s>", False),  # one that only appends eos adds no bos
])
def test_adds_bos_by_the_post_processor(tmp_path, post_processor, expected):
    path = _bpe(tmp_path / "tok", post_processor)
    assert adds_bos(load_tokenizer(path)) is expected
    assert adds_bos(path) is expected  # the same answer from a spec
    assert adds_bos(load_tokenizer("byte")) is False


def test_default_rules_and_mesh_on_eight_devices():
    mesh, rules = mesh_and_rules()
    assert rules.name == "fsdp" and describe_mesh(mesh).startswith("data=1,stage=1,fsdp=8")
    mesh, rules = mesh_and_rules(None, "tp")  # tensor parallel over every device
    assert "tensor=8" in describe_mesh(mesh)
    mesh, rules = mesh_and_rules(None, "dp")
    assert describe_mesh(mesh).startswith("data=8")
    mesh, rules = mesh_and_rules("fsdp=2,tensor=4", "fsdp_tp")  # what the user gave wins
    assert "fsdp=2" in describe_mesh(mesh) and "tensor=4" in describe_mesh(mesh)


def test_default_seq_len_is_the_runs_else_2048_at_most_the_models_positions():
    _, llama = get_model("llama-tiny")
    limit = max_positions(llama)
    assert default_seq_len(llama) == min(2048, limit)
    assert default_seq_len(llama, recorded=16) == 16
    assert default_seq_len(llama, recorded=10**6) == limit
    _, mlp = get_model("mlp-tiny")
    assert default_seq_len(mlp) == 2048
