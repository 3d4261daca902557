"""A.X-K1 (DeepSeek-V3 with a norm of each MoE layer's output: the MoE record's ``post_moe_norm``),
Flint (Qwen3-MoE with sinks, NoPE full layers, an ungated shared expert and the ``sigmoid`` top-k
router) and ModernBERT's decoder (no pre-norm on the first layer: ``first_attn_norm``; the
prediction head: ``head_transform``).

Tiny random HF models with each mechanism on: logits equal transformers' on one device, greedy
tokens equal over 16, export then ``from_pretrained`` equal. Each new mechanism moves the logits,
and its sharded check: the MoE output norm under fsdp_tp and ep (A.X-K1), the sigmoid router
under ep (Flint), the first layer and the head under fsdp_tp (ModernBERT). Tolerance: 1e-4 on
float32 logits against transformers.
"""

import os
import sys

import jax
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AXK1Config, FlintConfig, ModernBertDecoderConfig

from shardzoo.models import ModelError
from shardzoo.models.hf import load_hf_config
from shardzoo.models.hf.base import HFError
from shardzoo.models.hf.registry import PRESETS
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402, F401  (test_*: the three proofs every family has, collected here on its built)
    TOKENS,
    TOL,
    apply,
    apply_mutable,
    config_of,
    load_ep,
    near_one,
    one_device,
    randomized,
    saved,
    test_export_round_trip_loads_the_same_model,
    test_greedy_generate_matches_transformers,
)

E, K = 8, 2
DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
CONFIGS = {
    # latent attention through a query latent (interleaved rotary); a dense layer then MoE (4 groups
    # of 2 experts, 2 kept; a shared expert, scaled weights), each MoE output RMSNorm'd
    "axk1": lambda: AXK1Config(
        **DIMS, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=16, n_group=4,
        topk_group=2, routed_scaling_factor=2.5),
    # qk-norm, sinks; full (NoPE), sliding (rotary, a window of 4), full (NoPE) layers; a dense layer
    # then MoE (8 experts top-2 by sigmoid scores, renormalised; a shared expert always added)
    "flint": lambda: FlintConfig(
        **DIMS, num_key_value_heads=2, head_dim=8, attention_bias=True, sliding_window=4,
        layer_types=["full_attention", "sliding_attention", "full_attention"], mlp_only_layers=[0],
        num_experts=E, num_experts_per_tok=K, moe_intermediate_size=16, shared_expert_intermediate_size=24),
    # LayerNorms with bias; the first layer without its own pre-norm; full, sliding (a window of 4),
    # full layers, each kind with its base; q/k/v/o and GeGLU biases; the prediction head, a
    # decoder bias
    "modernbert-decoder": lambda: ModernBertDecoderConfig(
        **(DIMS | dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)), cls_token_id=1, sep_token_id=2,
        local_attention=8, layer_types=["full_attention", "sliding_attention", "full_attention"], norm_bias=True,
        attention_bias=True, mlp_bias=True),
}
# LayerNorms with bias: their scales near 1, their biases small as every other weight
DRAWS = {"modernbert-decoder": near_one(lambda name, p: "norm" in name and name.endswith("weight"))}


def buffers(name, b):
    """A draw for ``randomize``'s buffers: the correction bias large enough to move the choice."""
    return 0.3 * torch.randn_like(b) if name.endswith("e_score_correction_bias") else None


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    """(HF dir, HF model, reference logits): every weight random, norm scales near 1."""
    model = randomized(CONFIGS[request.param](), 0, DRAWS.get(request.param, near_one()), buffers)
    return saved(model, tmp_path_factory.mktemp(request.param))


def test_logits_match_on_one_device(built, parity):
    path, model, ref = built
    _, module, config, params = parity.load(path)
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    got = apply(module, params, one_device())
    print(f"{model.config.model_type}: max |logit diff| {np.abs(got - ref).max():.2e}")
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


# each family's new mechanisms, switched off (or, for ModernBERT's first pre-norm, on: a LayerNorm
# of scale 1 and bias 0 added) with the same weights
SWITCHED = {"axk1": [dict(post_moe_norm=False)], "flint": [dict(router_kind="softmax")],
            "modernbert-decoder": [dict(head_transform=None), dict(first_attn_norm=True)]}


def test_each_new_mechanism_moves_the_logits(built):
    """With each mechanism switched the logits move by more than 1e-2, where as imported they
    are transformers' (test_logits_match_on_one_device)."""
    path, model, ref = built
    _, config, params = load_hf(path, mesh=one_device())
    for fields in SWITCHED[model.config.model_type]:
        other = config.replace(**fields)
        assert other.arch != config.arch, fields
        weights = params
        if fields.get("first_attn_norm"):
            norm = {"scale": np.ones(32, np.float32), "bias": np.zeros(32, np.float32)}
            weights = params | {"layers_0": params["layers_0"] | {"attn_norm": norm}}
        got = apply(other.build(), weights, one_device())
        assert np.abs(got - ref).max() > 1e-2, fields


@pytest.mark.parametrize("built", ["axk1", "flint"], indirect=True)
def test_the_moe_options_under_fsdp_tp_and_ep(built):
    """The options' sharded checks, within 1e-4 of transformers' logits: A.X-K1's output norm (its
    scale over embed, fsdp-split) under fsdp_tp on (data 2, fsdp 2, tensor 2); both under ep
    (expert=4, data=2, a slot for every token: none dropped)."""
    path, model, ref = built
    if model.config.model_type == "axk1":
        mesh = make_mesh("data=2,fsdp=2,tensor=2")
        module, _, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
        scale = params["layers"]["post_moe_norm"]["scale"]
        assert scale.shape == (2, 32) and scale.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
        np.testing.assert_allclose(apply(module, params, mesh), ref, atol=TOL, rtol=0)
    module, _, params, mesh = load_ep(path, moe_dispatch="indexed", capacity_factor=E / K)
    got, state = apply_mutable(module, params, mesh, ["metrics"])
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    dropped = [x for p, x in jax.tree_util.tree_leaves_with_path(state["metrics"])
               if "dropped_fraction" in jax.tree_util.keystr(p)]
    assert dropped and float(np.max([np.max(x) for x in dropped])) == pytest.approx(0)


@pytest.mark.parametrize("built", ["flint"], indirect=True)
def test_flint_reads_its_layers_as_transformers_builds_them(built):
    path, _, _ = built
    config = load_hf_config(path)
    assert config.rope_layers == (False, True, False) and config.attention_sinks
    assert [s.mlp for s in config.layer_specs()] == ["dense", "moe", "moe"]
    assert (config.moe.router_kind, config.moe.shared_expert_gate) == ("sigmoid", False)


@pytest.mark.parametrize("built", ["modernbert-decoder"], indirect=True)
def test_modernberts_head_and_first_layer_under_fsdp_tp(built):
    """The prediction head (its dense mlp-split over tensor, as an MLP's up) and the first layer
    without a pre-norm under fsdp_tp on (data 2, fsdp 2, tensor 2): within 1e-4 of transformers'."""
    path, _, ref = built
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, config, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
    assert [s.attn_norm for s in config.layer_specs()] == [False, True, True] and "attn_norm" not in params["layers_0"]
    assert params["head_dense"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    np.testing.assert_allclose(apply(module, params, mesh), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("kind, changes, field", [
    ("modernbert-decoder", dict(classifier_bias=True), "classifier_bias"),  # the head's dense has no bias here
    ("modernbert-decoder", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e5},
                                                 "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 1e4}}), "rope_parameters"),
    ("axk1", dict(q_lora_rank=None), "q_lora_rank"),
    ("flint", dict(num_experts=0), "num_experts"),
])
def test_what_the_families_cannot_express_is_refused_naming_the_field(kind, changes, field):
    """One HFError naming the config.json field (the command line prints it as one line, exit 2)."""
    hf = CONFIGS[kind]().to_dict() | changes
    with pytest.raises(HFError, match=field) as refused:
        config_of(hf)
    assert len(str(refused.value).splitlines()) == 1


def test_a_reward_model_on_modernberts_prediction_head_is_refused():
    """transformers' ModernBERT classifier (``head``, ``classifier``) is not the score head shardzoo
    reads: the combination is one ModelError naming head_transform, not a silent other model."""
    with pytest.raises(ModelError, match="head_transform='gelu'"):
        PRESETS["modernbert-decoder-tiny"].replace(score_head=True)


def test_modernberts_older_config_json_gives_its_bases_without_rope_parameters():
    """global_rope_theta and local_rope_theta (config.json files of transformers 4) are the two
    kinds' bases, as transformers reads them."""
    hf = {k: v for k, v in CONFIGS["modernbert-decoder"]().to_dict().items() if k != "rope_parameters"}
    hf |= dict(global_rope_theta=80000.0, local_rope_theta=160000.0)
    config = config_of(hf)
    assert (config.rope_theta, config.rope_local_base_freq) == (80000.0, 160000.0)
    want = AutoConfig.for_model(**hf).rope_parameters
    assert (want["full_attention"]["rope_theta"], want["sliding_attention"]["rope_theta"]) == (80000.0, 160000.0)
