"""Hybrid families: OLMo hybrid (Gated DeltaNet layers, pre-norm, beside OLMo 3's post-norm
attention layers: the per-layer ``norm_positions``; the Gated DeltaNet's doubled rate and its gated
norm's own epsilon; conv1d stored as q_conv1d | k_conv1d | v_conv1d, a Weight's ``pieces``); Ling's
bailing_hybrid (KDA with full-rank decay and gate projections and the bounded decay, beside latent
attention gated per head; DeepSeek-V3's MoE).

Tiny random HF models with each mechanism on: logits equal transformers' on one device, greedy
tokens equal over 16, export then ``from_pretrained`` equal; the new pieces' own checks (each moves
the logits; fsdp_tp on 8 devices equals one device). Tolerance: 1e-4 on float32 logits against
transformers, 1e-5 shardzoo against itself.
"""

import dataclasses
import os
import sys

import jax
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P
from transformers import BailingHybridConfig, OlmoHybridConfig

from shardzoo.models import get_config
from shardzoo.models.hf import export_hf
from shardzoo.models.hf.registry import config_to_hf
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.sharding.partition import activate
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402, F401  (test_*: the three proofs every family has, collected here on its built)
    TOKENS,
    TOL,
    apply,
    config_of,
    edit,
    one_device,
    randomized,
    saved,
    test_export_round_trip_loads_the_same_model,
    test_greedy_generate_matches_transformers,
    test_logits_match_on_one_device,
)

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
# OLMo hybrid: a linear then an attention layer, two value heads per key head, the rate doubled,
# q/k/v/o biases, rotary on the attention layer
OLMO_HYBRID = dict(layer_types=["linear_attention", "full_attention"],
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                   linear_allow_neg_eigval=True, attention_bias=True)

# Ling: KDA, latent attention (interleaved rotary, a gate per head), KDA layers; a dense layer then MoE
# (4 groups of 2 experts, 2 kept; a shared expert, scaled weights)
BAILING = dict(num_hidden_layers=3, num_key_value_heads=4, head_dim=8, kv_lora_rank=16, qk_nope_head_dim=8,
               qk_rope_head_dim=8, v_head_dim=12, num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
               n_group=4, topk_group=2, first_k_dense_replace=1, rope_theta=10000.0,
               layer_types=["linear_attention", "full_attention", "linear_attention"])


def delta_draw(name, p):
    """A Gated DeltaNet's: A = exp(A_log) in [0.5, 2.5], norm scales near 1, the rest 0.15 x normal."""
    if "A_log" in name:
        return torch.log(torch.rand_like(p) * 2 + 0.5)
    if "norm" in name:
        return 1 + 0.1 * torch.randn_like(p)
    return 0.15 * torch.randn_like(p)


def correction_bias(name, b):
    """A draw for ``randomize``'s buffers: the sigmoid router's correction bias, large enough to
    move the experts chosen."""
    return 0.3 * torch.randn_like(b) if name.endswith("e_score_correction_bias") else None


CONFIGS = {
    "olmo_hybrid": lambda: OlmoHybridConfig(**(DIMS | OLMO_HYBRID)),
    "bailing_hybrid": lambda: BailingHybridConfig(**(DIMS | BAILING)),
}
DRAWS = {"olmo_hybrid": delta_draw, "bailing_hybrid": delta_draw}
BUFFERS = {"bailing_hybrid": correction_bias}
FORWARD = dict.fromkeys(CONFIGS, dict(use_cache=False))


def _build(kind, tmp_path_factory):
    """(HF dir, HF model, reference logits) of ``kind``: every weight random."""
    model = randomized(CONFIGS[kind](), 0, DRAWS[kind], BUFFERS.get(kind))
    return saved(model, tmp_path_factory.mktemp(kind), **FORWARD.get(kind, {}))


@pytest.fixture(scope="module")
def olmo_hybrid(tmp_path_factory):
    return _build("olmo_hybrid", tmp_path_factory)


@pytest.fixture(scope="module")
def bailing_hybrid(tmp_path_factory):
    return _build("bailing_hybrid", tmp_path_factory)


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request):
    """Each family's model for the three proofs every family has: its own fixture's, built once."""
    return request.getfixturevalue(request.param)


def edited_logits(module, params, edits) -> list[np.ndarray]:
    """The one-device logits of ``params`` under each of ``edits`` ({suffix: fn}, harness ``edit``),
    compiled once."""
    forward = jax.jit(lambda p: module.apply({"params": p}, TOKENS))
    with activate(one_device()):
        return [np.asarray(forward(edit(params, suffix, fn))) for suffix, fn in edits.items()]


def fsdp_tp_matches(path, ref, leaves) -> None:
    """The HF directory ``path`` under fsdp_tp on 8 devices: each of ``leaves`` ({path in the params:
    spec}) so split, the logits equal one device's (2e-5: Ling's sums split over devices round apart by
    up to 1.3e-5 through KDA's chunk inverses, latent attention and the experts) and ``ref`` (1e-4)."""
    module, _, params = load_hf(path, mesh=one_device())
    got = apply(module, params, one_device())
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
    for keys, spec in leaves.items():
        leaf = params
        for key in keys:
            leaf = leaf[key]
        assert leaf.sharding.spec == spec, keys
    sharded = apply(module, params, mesh)
    np.testing.assert_allclose(sharded, got, atol=2e-5, rtol=0)
    np.testing.assert_allclose(sharded, ref, atol=TOL, rtol=0)


# ------------------------------------------------------------------------------ OLMo hybrid
def test_olmo_hybrid_reads_its_layers_and_shards_under_fsdp_tp(olmo_hybrid):
    """A pre-norm linear layer and a post-norm attention layer; under fsdp_tp on 8 devices the
    logits equal one device's (1e-5) and transformers' (1e-4)."""
    path, model, ref = olmo_hybrid
    config = config_of(model.config)
    assert config.norm_positions == ("pre", "post") and config.num_params() == sum(
        p.numel() for p in model.parameters())
    assert config.linear_attention.allow_neg_eigval and config.linear_attention.norm_eps == 1e-5
    fsdp_tp_matches(path, ref, {("layers_0", "linear_attn", "q", "kernel"): P("fsdp", "tensor", None),
                                ("layers_1", "attn", "q", "kernel"): P("fsdp", "tensor", None)})


def test_olmo_hybrid_mechanisms_move_the_logits(olmo_hybrid):
    """The doubled rate, the gated norm's own epsilon (at 1: rms_norm_eps's 1e-6 is too close to
    FLA's 1e-5 to show on these weights), and each layer's norm placement: the attention layers'
    post-norms put before attention and MLP instead."""
    path, _, ref = olmo_hybrid
    module, config, params = load_hf(path, mesh=one_device())
    for change in (dict(linear_allow_neg_eigval=False), dict(linear_norm_eps=1.0)):
        assert np.abs(apply(config.replace(**change).build(), params, one_device()) - ref).max() > 1e-2, change
    pre = config.replace(norm_positions=("pre", "pre"))
    moved = dict(params, layers_1={{"post_attn_norm": "attn_norm", "post_mlp_norm": "mlp_norm"}.get(k, k): v
                                   for k, v in params["layers_1"].items()})
    assert np.abs(apply(pre.build(), moved, one_device()) - ref).max() > 1e-2
    # and the rate's projection zeroed (beta = 1, or 0.5 without the doubling) moves the logits
    rate = edited_logits(module, params, {"['linear_attn']['b']['kernel']": lambda x: 0 * x})[0]
    assert np.abs(rate - ref).max() > 1e-2


def test_olmo_hybrid_nope_reads_and_writes_a_null_rope_theta():
    """The released checkpoints' ``rope_parameters: {rope_theta: null}``: no layer rotates, and the
    export writes it back so."""
    config = config_of(OlmoHybridConfig(**(DIMS | OLMO_HYBRID), rope_parameters={"rope_type": "default",
                                                                               "rope_theta": None}))
    assert config.rope_layers == (False,) * 2 and {s.rope for s in config.layer_specs()} == {"none"}
    assert config_to_hf(config)["rope_parameters"]["rope_theta"] is None


def test_olmo_hybrid_7b_preset_counts_as_transformers_does():
    """olmo-hybrid-7b: OlmoHybridConfig's defaults (transformers' allenai/Olmo-Hybrid-7B) on the meta device."""
    config = get_config("olmo-hybrid-7b")
    assert config.num_params() == 7_430_870_688
    assert config.arch == config_of(OlmoHybridConfig(rope_parameters={"rope_type": "default",
                                                                      "rope_theta": None})).arch


# ------------------------------------------------------------------------------ Ling (bailing_hybrid)
def test_ling_reads_its_layers_and_shards_under_fsdp_tp(bailing_hybrid):
    """KDA, head-gated latent attention, KDA; the parameter count is transformers'; under fsdp_tp
    on 8 devices the full-rank gates and the head gate split over their heads."""
    path, model, ref = bailing_hybrid
    config = config_of(model.config)
    assert [s.mixer for s in config.layer_specs()] == ["kimi_delta", "attention", "kimi_delta"]
    assert config.kimi_delta.full_rank_gate and config.kimi_delta.gate_lower_bound == -5.0 and config.attn_head_gate
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    fsdp_tp_matches(path, ref, {("layers_0", "linear_attn", "f", "kernel"): P("fsdp", "tensor", None),
                                ("layers_1", "attn", "head_gate", "kernel"): P("fsdp", "tensor")})


def test_ling_mechanisms_move_the_logits(bailing_hybrid):
    """The bounded decay (softplus's in its place), the full-rank decay and gate projections, the
    head gate (zeroed: every head halved)."""
    path, _, ref = bailing_hybrid
    module, config, params = load_hf(path, mesh=one_device())
    softplus = config.replace(kimi_delta=dataclasses.replace(config.kimi_delta, gate_lower_bound=None))
    assert np.abs(apply(softplus.build(), params, one_device()) - ref).max() > 1e-2
    zeroed = ("['linear_attn']['f']['kernel']", "['linear_attn']['g']['kernel']", "['attn']['head_gate']['kernel']")
    for suffix, got in zip(zeroed, edited_logits(module, params, dict.fromkeys(zeroed, lambda x: 0 * x)), strict=True):
        assert np.abs(got - ref).max() > 1e-2, suffix


def test_ling_refuses_the_experts_swiglu_clipping(tmp_path):
    """A nonzero ``expert_swiglu_limit_list`` (clipping shardzoo does not compute): one line naming it."""
    from shardzoo.models.hf import HFError

    with pytest.raises(HFError, match="expert_swiglu_limit_list"):
        config_of(BailingHybridConfig(**(DIMS | BAILING), expert_swiglu_limit_list=[0, 7.0, 7.0]))


def test_ling_3_flash_preset_counts_as_transformers_does():
    """ling-3.0-flash: BailingHybridConfig's defaults (transformers' inclusionAI/Ling-3.0-Flash) on the meta device."""
    config = get_config("ling-3.0-flash")
    assert config.num_params() == 124_414_191_072
    assert config.arch == config_of(BailingHybridConfig()).arch


def test_olmo_hybrid_convolution_pieces_read_in_any_split(olmo_hybrid, tmp_path):
    """transformers saves conv1d as three equal thirds (27, 27, 26 rows of 80 here); an export writes
    q_conv1d, k_conv1d, v_conv1d at their own widths (16, 16, 48), as converted checkpoints hold
    them: both read as the same taps."""
    from safetensors.numpy import load_file

    path, _, _ = olmo_hybrid
    _, config, params = load_hf(path)
    assert [load_file(f"{path}/model.safetensors")[f"model.layers.0.linear_attn.{n}_conv1d.weight"].shape[0]
            for n in "qkv"] == [27, 27, 26]
    export_hf(config, params, str(tmp_path))
    written = load_file(f"{tmp_path}/model.safetensors")
    assert [written[f"model.layers.0.linear_attn.{n}_conv1d.weight"].shape[0] for n in "qkv"] == [16, 16, 48]
    _, _, back = load_hf(str(tmp_path))
    for n in "qkv":
        np.testing.assert_array_equal(back["layers_0"]["linear_attn"][f"conv_{n}"],
                                      params["layers_0"]["linear_attn"][f"conv_{n}"])
