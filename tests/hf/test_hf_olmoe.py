"""OLMoE: qk-norm over the whole q and k projections (OLMo 2's) with pre-norms and a sparse MoE
in every layer (softmax router, top-k, not renormalised as the published model).

A tiny random HF model: logits equal transformers' on one device (its components' sharded checks
live with the families that carry them), greedy tokens equal, export then ``from_pretrained`` equal. Tolerance: 1e-4 on float32 logits, as for every family.
"""

import os
import sys

import numpy as np
import pytest
from transformers import OlmoeConfig

from shardzoo.models.hf import HFError, export_hf, load_hf_config
from shardzoo.sharding import get_rules
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import TOKENS, TOL, apply, one_device, randomized, saved  # noqa: E402

E, K = 4, 2
HF_CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_experts=E, num_experts_per_tok=K,
                 norm_topk_prob=False, eos_token_id=2)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF dir, HF model, reference logits): every weight random, norm scales near 1."""
    model = randomized(OlmoeConfig(**HF_CONFIG), seed=3)  # a seed whose greedy continuation varies (random models repeat)
    return saved(model, tmp_path_factory.mktemp("olmoe"))


def test_the_config_reads_as_qk_norm_over_the_projection_and_moe(built):
    path, model, _ = built
    config = load_hf_config(path)
    assert (config.qk_norm, config.norm_position, config.moe.num_local_experts, config.moe.norm_topk_prob) == (
        "projection", "pre", E, False)
    assert config.expert_size == 16 and config.moe_dispatch == "dropless" and config.router_z_loss_coef == 0
    assert config.num_params() == sum(p.numel() for p in model.parameters())


def test_logits_match_on_one_device(built):
    """OLMoE only recombines components sharded elsewhere: the qk-norm over the projection under
    fsdp_tp with test_hf_models' olmo2, the experts under fsdp_tp with its mixtral and under ep with
    test_hf_qwen3_moe's indexed dispatch (the top-k not renormalised: a per-token choice)."""
    path, _, ref = built
    one = one_device()
    module, _, params = load_hf(path, mesh=one, rules=get_rules("fsdp"))
    assert params["layers"]["attn"]["q_norm"]["scale"].shape == (2, 4, 8)  # [layers, heads, head_dim]
    assert params["layers"]["attn"]["k_norm"]["scale"].shape == (2, 2, 8)  # [layers, kv_heads, head_dim]
    got = apply(module, params, one)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


def test_greedy_generate_matches_transformers(built, parity):
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert (hf["model_type"], hf["num_experts"], hf["norm_topk_prob"]) == ("olmoe", E, False)
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def test_clip_qkv_is_refused_naming_it(tmp_path):
    """OLMoE's clamp of q, k and v is not implemented: a config that sets it does not import."""
    OlmoeConfig(**HF_CONFIG, clip_qkv=8.0).save_pretrained(tmp_path)
    with pytest.raises(HFError, match="clip_qkv=8.0 changes the model"):
        load_hf_config(str(tmp_path))
