"""The text model of a multimodal checkpoint: a tiny random ``gemma3`` (Gemma3ForConditionalGeneration,
a one-layer SigLIP vision tower) imports as its ``gemma3_text`` language model, saying once that the
vision tower is left out (a tiny ``mistral3`` likewise: its logits); its logits and greedy tokens on text equal transformers' (fp32, 1e-4); it
exports text-only as ``gemma3_text``, and, with ``--into`` the original, as the whole checkpoint: the
vision tower's tensors unchanged and the trained language model's logits (1e-4).
"""

import json
import os
import sys

import jax
import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
)

from shardzoo import cli
from shardzoo.models.hf import HFError, load_hf_config
from shardzoo.train.io.hf_io import load_hf
from shardzoo.train.io.sources import load_model_and_params

sys.path.insert(0, os.path.dirname(__file__))
from harness import TOKENS, TOL, apply, bpe_tokenizer, hf_logits, one_device, randomize, saved  # noqa: E402

TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"], bos_token_id=1, eos_token_id=2)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF dir, the multimodal model, its logits of TOKENS): every weight random, norms near 1."""
    torch.manual_seed(0)
    config = Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4, image_token_index=127)
    model = randomize(AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval())
    assert type(model) is Gemma3ForConditionalGeneration
    return saved(model, tmp_path_factory.mktemp("gemma3"))


def test_the_text_model_imports_with_transformers_logits(built, capfd):
    path, _, ref = built
    config = load_hf_config(path)
    assert "left out" in capfd.readouterr().err  # said once, on stderr
    assert config.num_hidden_layers == 2 and config.qk_norm == "head" and config.sliding_window == 4
    module, _, params = load_hf(path, mesh=one_device())
    assert "left out" not in capfd.readouterr().err
    np.testing.assert_allclose(apply(module, params, one_device()), ref, atol=TOL, rtol=0)


def test_greedy_generate_matches_transformers(built, parity):
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_mistral3_text_model_imports_with_transformers_logits(tmp_path):
    """Mistral 3 (a Pixtral vision tower around a Mistral text model): the text model's logits."""
    text = {k: v for k, v in TEXT.items() if k not in ("query_pre_attn_scalar", "layer_types")} | dict(
        model_type="mistral", sliding_window=None)
    vision = dict(VISION, model_type="pixtral", head_dim=8)
    torch.manual_seed(0)
    model = randomize(Mistral3ForConditionalGeneration(
        Mistral3Config(text_config=text, vision_config=vision, image_token_index=127)).eval())
    path, _, ref = saved(model, tmp_path / "mistral3")
    assert load_hf_config(path).num_hidden_layers == 2
    module, _, params = load_hf(path, mesh=one_device())
    np.testing.assert_allclose(apply(module, params, one_device()), ref, atol=TOL, rtol=0)


def test_a_multimodal_config_without_text_config_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    with pytest.raises(HFError, match="a gemma3 config.json needs its text_config") as e:
        load_hf_config(str(tmp_path))
    assert "\n" not in str(e.value)


def test_trained_text_model_exports_text_only_and_back_into_the_whole_checkpoint(built, tmp_path, capfd):
    """``train --init-from`` the multimodal directory, ``export-hf`` it (gemma3_text, loaded by
    transformers with the run's logits) and ``export-hf --into`` the original (a
    Gemma3ForConditionalGeneration: its vision tensors the original's, its logits the run's)."""
    path, model, ref = built
    hf_dir, run, data = str(tmp_path / "hf"), str(tmp_path / "run"), str(tmp_path / "data.jsonl")
    os.symlink(path, hf_dir)
    text = [f"the {w} sat on the mat and the dog ran to the {w}." for w in ("cat", "bird", "fox", "cow")]
    bpe_tokenizer(path, text)
    with open(data, "w") as f:
        f.writelines(json.dumps({"text": line}) + "\n" for line in text * 4)
    assert cli.main(["train", "--init-from", hf_dir, "--data", data, "--out", run, "--steps", "2",
                     "--batch-size", "8", "--seq-len", "16", "--lr", "3e-3", "--warmup-steps", "0",
                     "--save-every", "2", "--eval-every", "0", "--rules", "fsdp", "--mesh", "fsdp=8"]) == 0
    module, _, params, _ = load_model_and_params(run)
    trained = np.asarray(jax.jit(lambda p, x: module.apply({"params": p}, x))(params, TOKENS))
    assert np.abs(trained - ref).max() > 1e-3  # training changed the language model

    text_only, whole = str(tmp_path / "text"), str(tmp_path / "whole")
    assert cli.main(["export-hf", run, text_only]) == 0
    with open(os.path.join(text_only, "config.json")) as f:
        assert json.load(f)["model_type"] == "gemma3_text"
    back = AutoModelForCausalLM.from_pretrained(text_only, attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(back), trained, atol=TOL, rtol=0)

    assert cli.main(["export-hf", run, whole, "--into", hf_dir]) == 0
    full = Gemma3ForConditionalGeneration.from_pretrained(whole, attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(full), trained, atol=TOL, rtol=0)
    want, got = model.state_dict(), full.state_dict()
    assert sorted(got) == sorted(want)
    for name in (n for n in want if "language_model" not in n and n != "lm_head.weight"):
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    assert os.path.isfile(os.path.join(whole, "tokenizer.json"))

    capfd.readouterr()
    assert cli.main(["export-hf", run, str(tmp_path / "no"), "--into", text_only]) == 2
    err = capfd.readouterr().err.strip()
    assert "--into" in err and "not a multimodal checkpoint" in err and "\n" not in err
    assert not os.path.exists(tmp_path / "no")
