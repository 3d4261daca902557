"""DBRX and Phi-MoE: tiny random HF models with each mechanism on: logits equal transformers' on
one device, greedy tokens equal over 16, export then ``from_pretrained`` equal. Tolerance: 1e-4 on
float32 logits, as for every family. DBRX's merged expert tensors read straight into expert-sharded
leaves (ep); Phi-MoE's sparsemixer router moves the logits and runs under ep. Presets count as
transformers on the meta device (test_hf_families), the published ones as published.
"""

import os
import sys

import numpy as np
import pytest
import torch
from transformers import DbrxConfig, PhimoeConfig

from shardzoo.models.hf.registry import PRESETS
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402, F401  (test_*: the three proofs every family has, collected here on its built)
    TOKENS,
    TOL,
    apply,
    load_ep,
    near_one,
    one_device,
    randomized,
    saved,
    test_export_round_trip_loads_the_same_model,
    test_greedy_generate_matches_transformers,
    test_logits_match_on_one_device,
)

E, K = 4, 2
CONFIGS = {
    # fused q|k|v clipped at 0.5 (GQA), LayerNorms without bias, rotary base 500000 (top level and
    # attn_config agree); 4 experts top-2, renormalised, their tensors merged
    "dbrx": lambda: DbrxConfig(
        vocab_size=128, d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
        rope_parameters=dict(rope_type="default", rope_theta=500000.0),
        attn_config=dict(kv_n_heads=2, clip_qkv=0.5, rope_theta=500000.0),
        ffn_config=dict(ffn_hidden_size=16, moe_num_experts=E, moe_top_k=K)),
    # LayerNorms with bias, q/k/v/o and head biases, a window of 4, longrope scaled by its mscale
    # (16 tokens within original_max_position_embeddings); 4 experts by SparseMixer, its threshold
    # (router_jitter_noise) wide enough that each weight is a softmax over several logits
    "phimoe": lambda: PhimoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
        attention_bias=True, lm_head_bias=True, sliding_window=4, num_local_experts=E, router_jitter_noise=0.4,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.5, 2.0, 3.0],
                             long_factor=[2.0, 3.0, 4.0, 6.0], short_mscale=1.2, long_mscale=1.2,
                             original_max_position_embeddings=32)),
}
SEEDS = {"phimoe": 7}  # else 0; each with a varied greedy continuation
# LayerNorms' scales near 1 (DBRX's norm_1, norm_2, norm_f; not the attention under norm_attn_norm),
# every other weight 0.15 x normal
DRAWS = {"dbrx": near_one(lambda name, p: name.endswith(("norm_1.weight", "norm_2.weight", "norm_f.weight")))}


_BUILT = {}


def build(kind, tmp_path_factory):
    """(HF dir, HF model, reference logits) of ``CONFIGS[kind]``, built once for the module's tests."""
    if kind not in _BUILT:
        model = randomized(CONFIGS[kind](), SEEDS.get(kind, 0), DRAWS.get(kind, near_one()))
        _BUILT[kind] = saved(model, tmp_path_factory.mktemp(kind))
    return _BUILT[kind]


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    """Every weight random, norm scales near 1."""
    return build(request.param, tmp_path_factory)




# ------------------------------------------------------------------------------------- DBRX
@pytest.fixture(scope="module")
def dbrx(tmp_path_factory):
    return build("dbrx", tmp_path_factory)


def test_dbrx_merged_experts_load_expert_sharded_under_ep(dbrx):
    """``ffn.experts.mlp.w1`` [experts * ffn_hidden_size, d_model] splits into one expert per
    device of expert=4: each shard holds its own expert's rows, and the logits equal transformers'."""
    path, model, ref = dbrx
    module, _, params, mesh = load_ep(path, moe_dispatch="capacity", capacity_factor=E / K)
    wi_gate = params["layers"]["moe"]["wi_gate"]  # [layers, expert, embed, mlp]
    shard = wi_gate.addressable_shards[0]
    assert shard.data.shape[1] == 1
    e = shard.index[1].start
    w1 = model.transformer.blocks[0].ffn.experts.mlp.w1.detach().numpy().reshape(E, 16, 32)
    np.testing.assert_array_equal(np.asarray(shard.data)[0, 0], w1[e].T)
    np.testing.assert_allclose(apply(module, params, mesh), ref, atol=TOL, rtol=0)


def test_dbrx_clip_qkv_moves_the_logits(dbrx, tmp_path):
    """The clip at 0.5 bites on the tiny model: without it shardzoo's logits move past 1e-2."""
    from harness import rewritten  # noqa: PLC0415

    path, _, ref = dbrx
    import json

    with open(os.path.join(path, "config.json")) as f:
        attn = json.load(f)["attn_config"]
    unclipped = rewritten(path, tmp_path / "unclipped", attn_config=attn | dict(clip_qkv=None))
    module, _, params = load_hf(unclipped, mesh=one_device())
    assert np.abs(apply(module, params, one_device()) - ref).max() > 1e-2


def test_dbrx_reads_attn_config_rope_theta_without_a_top_level_base(dbrx, tmp_path):
    """A published config.json (transformers 4's spelling): the base in attn_config only."""
    from harness import config_of  # noqa: PLC0415

    path, model, _ = dbrx
    raw = model.config.to_dict()
    raw.pop("rope_parameters")
    assert config_of(raw).arch.rope_theta == 500000.0
    assert config_of(raw | dict(rope_parameters=dict(rope_type="default", rope_theta=1e4))).arch.rope_theta == 1e4


@pytest.mark.parametrize("ffn, message", [
    (dict(ffn_act_fn={"name": "gelu"}), "ffn_act_fn name 'gelu'"),
    (dict(moe_normalize_expert_weights=2.0), "moe_normalize_expert_weights=2.0"),
    (dict(uniform_expert_assignment=True), "uniform_expert_assignment=true"),
])
def test_dbrx_refuses_ffn_settings_it_does_not_compute(dbrx, ffn, message):
    """One line naming ffn_config and the setting; the published files' other PretrainedConfig
    keys in ffn_config (top_k, temperature...) are no reason to refuse."""
    from harness import config_of  # noqa: PLC0415

    from shardzoo.models.hf import HFError

    raw = dbrx[1].config.to_dict()
    with pytest.raises(HFError, match=f"ffn_config=.*{message}"):
        config_of(raw | dict(ffn_config=raw["ffn_config"] | ffn))
    assert config_of(raw | dict(ffn_config=raw["ffn_config"] | dict(top_k=50, temperature=1.0))) == config_of(raw)


# ---------------------------------------------------------------------------------- Phi-MoE
@pytest.mark.parametrize("eps", [0.01, 0.4])
def test_sparsemixer_equals_transformers_at_eval(eps):
    """shardzoo's SparseMixer (weights and experts) on random logits of 8 experts, ties broken
    alike: within 1e-6 of transformers' ``sparsemixer`` in eval mode."""
    import jax.numpy as jnp
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    from shardzoo.models.moe_routing import _sparsemixer

    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    want_w, want_i = sparsemixer(logits, jitter_eps=eps, training=False)
    got_w, got_i = _sparsemixer(jnp.asarray(logits.numpy()), eps)
    np.testing.assert_array_equal(np.asarray(got_i), want_i.numpy())
    np.testing.assert_allclose(np.asarray(got_w), want_w.numpy(), atol=1e-6, rtol=0)
    assert 0.05 < float(np.asarray(got_w).std())  # not all weights 1 (the mask keeps more than the best)


@pytest.fixture(scope="module")
def phimoe(tmp_path_factory):
    return build("phimoe", tmp_path_factory)


def test_phimoe_sparsemixer_moves_the_logits(phimoe):
    """The router read as Mixtral's (softmax top-2, renormalised) moves the logits past 1e-2."""
    path, _, ref = phimoe
    module, _, params = load_hf(path, mesh=one_device(), overrides=dict(router_kind="softmax", norm_topk_prob=True))
    assert np.abs(apply(module, params, one_device()) - ref).max() > 1e-2


def test_phimoe_matches_under_ep(phimoe):
    """Experts split 4 ways (expert=4, data=2), dropless: the logits equal transformers'."""
    path, _, ref = phimoe
    module, _, params, mesh = load_ep(path)
    assert params["layers"]["moe"]["wi_gate"].addressable_shards[0].data.shape[1] == 1
    np.testing.assert_allclose(apply(module, params, mesh), ref, atol=TOL, rtol=0)


def test_phimoe_refuses_what_transformers_does_not_compute(phimoe, tmp_path):
    """A top-k other than 2 (SparseMixer picks 2 whatever it says), unequal mscales."""
    from harness import rewritten  # noqa: PLC0415

    from shardzoo.models.hf import HFError, load_hf_config

    path = phimoe[0]
    with pytest.raises(HFError, match="num_experts_per_tok=3: Phi-MoE's SparseMixer always picks 2"):
        load_hf_config(rewritten(path, tmp_path / "k3", num_experts_per_tok=3))
    rope = phimoe[1].config.rope_parameters | dict(long_mscale=1.5)
    with pytest.raises(HFError, match="long_mscale=1.5 differs from short_mscale=1.2"):
        load_hf_config(rewritten(path, tmp_path / "mscale", rope_parameters=rope))


# ----------------------------------------------------------------------------------- presets
def test_presets_have_the_published_parameter_counts():
    """(transformers' count on the meta device: test_hf_families' test of every preset.)"""
    assert PRESETS["dbrx-132b"].num_params() == 131_596_523_520  # "132B total parameters"
    assert PRESETS["phimoe-3.5"].num_params() == 41_873_153_344  # "41.9B params"
