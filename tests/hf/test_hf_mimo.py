"""MiMo-V2-Flash: sliding and full layers with key/value heads of their own and sinks on the sliding ones
only (models/attention.py ``GlobalAttention``), values narrower than the q/k heads and scaled
(``ValueHeads``), a rotary base per layer kind on a third of each head, and DeepSeek-V3's router
(groups, correction bias) without shared experts after a dense first layer.

A tiny random HF model (full dense, sliding MoE, twice: two scanned periods; a window of 4 in 16 tokens): logits equal transformers' on one device and under fsdp_tp on 8 devices,
greedy tokens equal over 16, export then ``from_pretrained`` equal; each new mechanism moves the logits;
what shardzoo does not compute is refused naming the field. Tolerance: 1e-4 on float32 logits.
"""

import copy
import os
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, MiMoV2FlashConfig

from shardzoo.models import ModelError, apply_overrides
from shardzoo.models.arch import arch_of
from shardzoo.models.hf import HFError, family_of_config, load_hf_config
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402, F401  (test_*: the three proofs, collected here on this built)
    fsdp_tp_parity,
    hf_logits,
    near_one,
    one_device,
    randomized,
    rewritten,
    saved,
    test_export_round_trip_loads_the_same_model,
    test_greedy_generate_matches_transformers,
)

SWA, FULL = "sliding_attention", "full_attention"
ROPE = {FULL: {"rope_type": "default", "rope_theta": 50.0, "partial_rotary_factor": 0.334},
        SWA: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.334}}
# q/k heads of 12 (rotating 4 features), values of 8 times 0.5; the sliding layers 4 kv heads and sinks,
# the full ones 2; dense and MoE layers by turns, 8 experts in 4 groups (2 kept), top-2, scaled by 2.5
MIMO = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=12, v_head_dim=8, attention_value_scale=0.5, sliding_window=4,
            layer_types=[FULL, SWA, FULL, SWA], mlp_layer_types=["dense", "sparse"] * 2, rope_parameters=ROPE,
            n_routed_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=16, n_group=4, topk_group=2, routed_scaling_factor=2.5,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
CONFIGS = {"mimo_v2_flash": lambda: MiMoV2FlashConfig(**MIMO)}


def draw(name, p):
    """``near_one``, the sinks a whole normal (large enough to matter)."""
    return torch.randn_like(p) if name.endswith("sinks") else near_one()(name, p)


def correction_bias(name, b):
    return 0.3 * torch.randn_like(b) if name.endswith("e_score_correction_bias") else None


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF dir, HF model, reference logits): every weight random, norm scales near 1."""
    model = randomized(CONFIGS["mimo_v2_flash"](), 0, draw, correction_bias)
    return saved(model, tmp_path_factory.mktemp("mimo_v2_flash"))


def test_the_config_reads_each_layer_kind_and_each_mechanism_moves_the_logits(built):
    """The layers' shapes and sinks by kind, the values' width and scale, each kind's rotary base;
    transformers' logits move with the sinks, the value scale and the bases (so parity tests each)."""
    path, model, ref = built
    config = load_hf_config(path)
    a = config.arch
    assert (a.kv_heads, a.global_attention.num_key_value_heads, a.attention_sinks, a.global_attention.sinks) == (
        4, 2, True, False)
    assert (a.head_size, a.v_head_size, a.value_heads.scale, a.rope_dim) == (12, 8, 0.5, 4)
    assert (a.rope_theta, a.rope_local_base_freq, a.moe.router_kind, a.moe.shared_expert_intermediate_size) == (
        50.0, 10000.0, "sigmoid_groups", 0)
    assert [(s.window, s.mlp) for s in config.layer_specs()] == [(None, "dense"), (4, "moe")] * 2
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    layout = config.layout()
    assert (layout.period, layout.repeats) == (2, 2)  # two scanned periods
    with torch.no_grad():
        unsunk = copy.deepcopy(model)
        for layer in unsunk.model.layers:
            if layer.self_attn.sinks is not None:
                layer.self_attn.sinks.fill_(-1e4)
        assert np.abs(hf_logits(unsunk) - ref).max() > 1e-3
    for change in (dict(attention_value_scale=1.0), dict(rope_parameters={k: ROPE[SWA] for k in ROPE})):
        other = AutoModelForCausalLM.from_config(MiMoV2FlashConfig(**(MIMO | change)), attn_implementation="eager")
        other.load_state_dict(model.state_dict())
        assert np.abs(hf_logits(other.eval()) - ref).max() > 1e-3, change


def test_logits_match_on_one_device_and_under_fsdp_tp(built):
    """Each kind's kv heads, the sliding layers' sinks and the narrower values shard as the others."""
    path, _, ref = built
    fsdp_tp_parity(path, ref)
    _, _, params = load_hf(path, mesh=one_device())
    period = params["layers"]
    assert period["sub_1"]["attn"]["k"]["kernel"].shape == (2, 32, 4, 12)  # sliding: 4 kv heads
    assert period["sub_0"]["attn"]["v"]["kernel"].shape == (2, 32, 2, 8)  # full: 2, values of 8
    assert "sinks" in period["sub_1"]["attn"] and "sinks" not in period["sub_0"]["attn"]


def test_the_published_spelling_reads_sliding_window_size_as_transformers_does(built, tmp_path):
    """``sliding_window_size`` (the published config.json's) is the keys before the query: a window of one more."""
    path, _, _ = built
    assert load_hf_config(rewritten(path, tmp_path / "a", sliding_window_size=3)).sliding_window == 4


@pytest.mark.parametrize("change, field", [
    (dict(rope_parameters={FULL: ROPE[FULL] | {"rope_type": "linear", "factor": 2.0}, SWA: ROPE[SWA]}),
     "rope_parameters"),
    (dict(rope_parameters={FULL: ROPE[FULL], SWA: ROPE[SWA] | {"partial_rotary_factor": 0.5}}), "rope_parameters"),
    (dict(layer_types=[FULL, "chunked_attention", FULL, SWA]), "layer_types"),
    (dict(mlp_layer_types=["dense", "shared", "dense", "sparse"]), "mlp_layer_types"),
])
def test_what_shardzoo_does_not_compute_is_refused_naming_the_field(built, change, field, tmp_path):
    path, _, _ = built
    with pytest.raises(HFError, match=field) as e:
        load_hf_config(rewritten(path, tmp_path / "a", **change))
    assert "\n" not in str(e.value)


def test_value_heads_settings_are_checked_by_name():
    with pytest.raises(ModelError, match="attention_value_scale"):
        arch_of(num_attention_heads=4, hidden_size=32, attention_value_scale=0.0)
    with pytest.raises(ModelError, match="value_head_dim=4"):
        arch_of(num_attention_heads=4, hidden_size=32, value_head_dim=4, attn_output_gate=True)


@pytest.mark.parametrize("change, field", [(dict(num_global_key_value_heads=1), "num_key_value_heads"),
                                           (dict(global_attention_sinks=True), "global_attention_sinks"),
                                           (dict(attention_sinks=False), "attention_sinks")])
def test_what_transformers_cannot_build_does_not_export_as_mimo(built, change, field):
    """The full layers' kv heads not half the sliding ones', sinks on the full layers or none on the
    sliding ones: the config.json would read back apart, so the export names the field."""
    config = apply_overrides(load_hf_config(built[0]), change)
    with pytest.raises(HFError, match=field):
        family_of_config(config, "mimo_v2_flash")
