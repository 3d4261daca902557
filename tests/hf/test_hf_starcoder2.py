"""StarCoder2: LayerNorms with biases, q/k/v/o and MLP biases (``use_bias``), a plain GELU MLP
(``c_fc``, ``c_proj``), rotary and a sliding window, on the shared layers (no new mechanism).

A tiny random HF model, its window (4) shorter than the 16 tokens: logits equal transformers'
on one device (no fsdp_tp run: its components are sharded with the families that carry them,
test_hf_models' gpt2 and qwen2_window_layers, test_hf_dense_variants' arcee), greedy tokens
equal, export then ``from_pretrained`` equal. Tolerance: 1e-4 on float32 logits, as for every family.
"""

import os
import sys

import numpy as np
import pytest
from transformers import AutoModelForCausalLM, Starcoder2Config

from shardzoo.models.hf import export_hf, load_hf_config

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402, F401  (test_logits_match_on_one_device: collected here on its built)
    TOKENS,
    TOL,
    hf_logits,
    near_one,
    randomized,
    saved,
    test_logits_match_on_one_device,
)

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
CONFIG = dict(DIMS, sliding_window=4, use_bias=True, rope_theta=5000.0, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF dir, HF model, reference logits): every weight random (biases too), norm scales near 1."""
    model = randomized(Starcoder2Config(**CONFIG), seed=0,
                       draw=near_one(lambda name, p: "norm" in name and name.endswith("weight")))
    return saved(model, tmp_path_factory.mktemp("starcoder2"))


def test_config_reads_starcoder2s_mechanisms(built):
    config = load_hf_config(built[0])
    assert (config.norm_type, config.mlp_type, config.hidden_act, config.sliding_window) == (
        "layernorm", "plain", "gelu_pytorch_tanh", 4)
    assert config.attention_bias and config.attention_out_bias and config.mlp_bias
    assert config.tie_word_embeddings and config.layer_types is None


def test_the_window_and_the_biases_matter(built):
    """Without the window, or without the biases, transformers gives other logits."""
    path, model, ref = built
    for change in (dict(sliding_window=None), dict(use_bias=False)):
        other = AutoModelForCausalLM.from_config(Starcoder2Config(**(CONFIG | change)),
                                                 attn_implementation="eager").eval()
        other.load_state_dict(model.state_dict(), strict=False)
        assert np.abs(hf_logits(other, TOKENS) - ref).max() > 1e-2, change


def test_greedy_generate_matches_transformers(built, parity):
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert hf["model_type"] == "starcoder2" and hf["use_bias"] is True and hf["sliding_window"] == 4
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)
