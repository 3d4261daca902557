"""A vocabulary a tensor-parallel rule table cannot split (131 over tensor=2, as GPT-2's 50257):
the embedding and head are padded (``vocab_pad_multiple``), the padding's logits masked, and
every number is the unpadded one-device model's: logits (1e-5 on the real vocab), the loss,
and the export transformers reads (1e-4 against its own logits, the harness's tolerance)."""

import os
import sys

import jax
import numpy as np
import optax
import pytest
from transformers import AutoModelForCausalLM, GPT2Config

from shardzoo.models.hf import export_hf
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import TOKENS, TOL, apply, hf_logits, near_one, one_device, randomized, saved  # noqa: E402

VOCAB = 131


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A tiny random GPT-2 (tied embeddings, learned positions) of 131 ids: its dir and logits."""
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
                        eos_token_id=2)
    return saved(randomized(config, 0, near_one()), tmp_path_factory.mktemp("gpt2") / "hf")


def _loss(logits) -> float:
    targets = np.roll(TOKENS, -1, axis=1)
    return float(optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean())


def test_a_vocab_the_tensor_axis_does_not_divide_is_padded_and_every_number_stays(gpt2, tmp_path):
    path, _, ref = gpt2
    module, config, params = load_hf(path, mesh=one_device())
    plain = apply(module, params, one_device())
    assert config.padded_vocab == VOCAB and plain.shape[-1] == VOCAB
    np.testing.assert_allclose(plain, ref, atol=TOL, rtol=0)

    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, padded, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
    assert (padded.vocab_pad_multiple, padded.padded_vocab) == (128, 256)
    assert params["embed"]["embedding"].shape == (256, 32)
    np.testing.assert_array_equal(np.asarray(params["embed"]["embedding"])[VOCAB:], 0.0)  # zero rows
    out = apply(module, params, mesh)
    assert out.shape[-1] == 256 and np.all(out[..., VOCAB:] == np.finfo(np.float32).min)  # never sampled
    np.testing.assert_allclose(out[..., :VOCAB], plain, atol=1e-5, rtol=0)
    assert abs(_loss(out) - _loss(plain)) < 1e-5  # the padding is in no logsumexp

    export_hf(padded, params, str(tmp_path / "out"), family="gpt2")  # stripped: transformers loads it
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert back.config.vocab_size == VOCAB
    np.testing.assert_allclose(hf_logits(back), ref, atol=TOL, rtol=0)
    assert jax.device_count() == 8


def test_training_under_a_tensor_table_pads_says_so_and_matches_the_unpadded_run(tmp_path, capsys):
    """``train`` of a 301-id GPT-2 under fsdp_tp on 8 devices: the first lines say the padding,
    the losses equal fsdp's unpadded run (the padded model draws the same initial numbers;
    1e-5), and its checkpoint exports the real 301 rows."""
    import json

    from shardzoo import cli

    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} of a tiny corpus"}) + "\n" for i in range(40)))
    losses = {}
    for rules, mesh in (("fsdp_tp", "data=2,fsdp=2,tensor=2"), ("fsdp", "fsdp=8")):
        out = tmp_path / rules
        capsys.readouterr()
        assert cli.main(["train", "--model", "gpt2-tiny", "--override", "vocab_size=301", "--data", str(data),
                         "--out", str(out), "--rules", rules, "--mesh", mesh, "--steps", "3", "--batch-size", "8",
                         "--seq-len", "16", "--save-every", "0", "--eval-every", "0", "--warmup-steps", "0"]) == 0
        said = "vocab_size 301 is not divisible by mesh axes tensor (2): embedding and head padded to 384 rows"
        assert (said in capsys.readouterr().out) == (rules == "fsdp_tp")
        losses[rules] = [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").open()) if "loss" in r]
    np.testing.assert_allclose(losses["fsdp_tp"], losses["fsdp"], atol=1e-5, rtol=0)
    assert cli.main(["export-hf", str(tmp_path / "fsdp_tp"), str(tmp_path / "hf")]) == 0
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert back.config.vocab_size == 301 and back.get_input_embeddings().weight.shape[0] == 301
