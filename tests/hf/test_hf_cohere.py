"""Cohere (Command R): the parallel residual from one LayerNorm without bias, rotary
embeddings on interleaved pairs (a feature of the shared layers), logits times ``logit_scale``
(a feature too), the per-head qk LayerNorm with a weight per head (``use_qk_norm``), gated
SwiGLU, tied embeddings.

A tiny random HF model with every mechanism on (qk-norm, q/k/v/o biases, a logit scale far from
1): logits equal transformers' on one device and under fsdp_tp on 8 devices, greedy tokens equal,
export then ``from_pretrained`` equal. Tolerance: 1e-4 on float32 logits.
"""

import os
import sys

import numpy as np
import pytest
from transformers import AutoModelForCausalLM, CohereConfig

from shardzoo.models.hf import HFError, config_to_hf, export_hf, load_hf_config
from shardzoo.models.transformer import Transformer
from shardzoo.sharding import get_rules
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import TOKENS, TOL, apply, fsdp_tp_parity, hf_logits, one_device, randomized, saved  # noqa: E402

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
CONFIG = dict(DIMS, use_qk_norm=True, attention_bias=True, logit_scale=0.3, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF dir, HF model, reference logits): every weight random (biases too), norm scales near 1."""
    model = randomized(CohereConfig(**CONFIG), seed=8)  # a seed whose greedy continuation varies
    return saved(model, tmp_path_factory.mktemp("cohere"))


def test_config_reads_coheres_mechanisms(built):
    config = load_hf_config(built[0])
    assert config.block_form == "parallel" and config.rope_interleaved and config.qk_norm == "heads"
    assert (config.norm_type, config.mlp_type, config.logit_scale) == ("layernorm_no_bias", "gated", 0.3)
    assert config.tie_word_embeddings and config.attention_bias and config.attention_out_bias


def test_interleaved_rotary_and_the_logit_scale_matter(built):
    """The same weights with rotate-half rotary, or without the logit scale, give other logits
    than transformers': a family that dropped either could not pass the parity tests below."""
    path, _, ref = built
    mesh = one_device()
    module, config, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp"))
    np.testing.assert_allclose(apply(module, params, mesh), ref, atol=TOL, rtol=0)
    for change in (dict(rope_interleaved=False), dict(logit_scale=1.0)):
        got = apply(Transformer(config.replace(**change)), params, mesh)
        assert np.abs(got - ref).max() > 1e-2, change


def test_the_qk_norm_matters(built):
    _, model, ref = built
    other = AutoModelForCausalLM.from_config(CohereConfig(**(CONFIG | dict(use_qk_norm=False))),
                                             attn_implementation="eager").eval()
    other.load_state_dict(model.state_dict(), strict=False)
    assert np.abs(hf_logits(other, TOKENS) - ref).max() > 1e-2


def test_logits_match_on_one_device_and_under_fsdp_tp(built):
    path, model, ref = built
    got, sharded = fsdp_tp_parity(path, ref)
    print(f"max |logit diff| one device {np.abs(got - ref).max():.2e}, fsdp_tp {np.abs(sharded - ref).max():.2e}")


def test_greedy_generate_matches_transformers(built, parity):
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert hf["model_type"] == "cohere" and hf["logit_scale"] == 0.3 and hf["use_qk_norm"] is True
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def test_a_family_without_interleaved_rotary_refuses_to_export_it(built):
    config = load_hf_config(built[0])
    with pytest.raises(HFError, match=r"phi cannot express feature .*rope_interleaved \(rope_interleaved=True\)"):
        config_to_hf(config, family="phi")
