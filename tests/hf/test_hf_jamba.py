"""Jamba: Mamba1 layers (models/mamba1.py, with weighted norms of dt, B and C) and attention
layers without positions, each followed by a dense MLP or a MoE, by period and offset.

A tiny random HF model of 4 layers (mamba1, mamba1, attention, mamba1; MoE on layers 1 and 3,
4 experts top-2): logits equal transformers' on one device (1e-4), the norms' weights move them,
greedy tokens equal over 16, export then ``from_pretrained`` equal, the parameter count equals
transformers' (and Jamba-v0.1's preset count, on the meta device). The mixer's sharded, decoding
and context-parallel checks are Mamba's (test_hf_mamba.py, tests/models/test_mamba1.py).
"""

import os
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, JambaConfig

from shardzoo.models.hf import HFError, export_hf, load_hf_config
from shardzoo.sharding import get_rules
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import TOL, apply, edit, mamba_draw, one_device, randomized, rewritten, saved  # noqa: E402

CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, attn_layer_period=4, attn_layer_offset=2,
              mamba_d_state=8, mamba_dt_rank=6)
TOKENS = np.random.default_rng(0).integers(0, 128, size=(4, 11)).astype(np.int32)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF dir, HF model, reference logits): A = -exp(A_log) in [-2.5, -0.5], norms near 1, the rest 0.2 x normal."""
    return saved(randomized(JambaConfig(**CONFIG), seed=1, draw=mamba_draw), tmp_path_factory.mktemp("jamba"), TOKENS)


def test_config_reads_the_layer_pattern(built):
    config = load_hf_config(built[0])
    assert config.layer_types == ("mamba1", "mamba1", "full_attention", "mamba1")
    assert config.mlp_layer_types == ("dense", "moe", "dense", "moe") and not config.moe.norm_topk_prob
    assert config.mamba1.bcdt_norm_weights and config.mamba1.bcdt_rms_eps == 1e-6
    assert config.rope_layers == (False,) * 4  # no positions in Jamba's attention


def test_logits_match_transformers_and_the_norms_weights_matter(built):
    path, model, ref = built
    module, config, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"))
    got = apply(module, params, one_device(), TOKENS)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    for suffix in ("['dt_norm']", "['b_norm']"):
        assert np.abs(apply(module, edit(params, suffix, lambda x: x * 1.5), one_device(), TOKENS) - ref).max() > 1e-2
    print(f"max |logit diff| {np.abs(got - ref).max():.2e}")


def test_greedy_generate_matches_transformers(built, parity):
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    # the largest period and offset that give the pattern (attention on layer 2 of 4: every 4th from 2)
    assert (hf["attn_layer_period"], hf["attn_layer_offset"], hf["expert_layer_period"], hf["expert_layer_offset"]) \
        == (4, 2, 2, 1)
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def test_a_bad_offset_is_one_line(built, tmp_path):
    with pytest.raises(HFError, match=r"attn_layer_offset=4: attn_layer_offset must be an integer in \[0, "
                                      r"attn_layer_period=4\)"):
        load_hf_config(rewritten(built[0], tmp_path, attn_layer_offset=4))


def test_the_preset_counts_as_transformers_counts():
    """ai21labs/Jamba-v0.1 (transformers' defaults) on the meta device."""
    from shardzoo.models import get_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(JambaConfig())
    assert get_config("jamba-v0.1").num_params() == sum(p.numel() for p in model.parameters())
