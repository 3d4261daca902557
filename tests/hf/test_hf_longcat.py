"""LongCat-Flash: layers of two latent-attention + dense-MLP halves around a shortcut MoE
(``block_form="shortcut_moe"``), zero-computation experts in the router (``zero_expert_num``)
and latent attention's lora scaling (``lora_scaling``).

A tiny random HF model with every mechanism on: logits equal transformers' on one device, greedy
tokens equal over 16 (decoding from both halves' latent caches), export then ``from_pretrained``
equal; each new mechanism moves transformers' logits; the sharded checks of the new components:
the MoE with zero experts under ep (expert=4, data=2), the block under fsdp_tp (data 2, fsdp 2,
tensor 2). Tolerance: 1e-4 on float32 logits; parameter counts exact.
"""

import os
import sys

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LongcatFlashConfig

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
    correction_bias,
    hf_logits,
    load_ep,
    near_one,
    randomized,
    rewritten,
    saved,
    test_export_round_trip_loads_the_same_model,
    test_greedy_generate_matches_transformers,
    test_logits_match_on_one_device,
)

E, Z, K = 4, 4, 3  # routed experts, zero-computation experts, choices per token
# two layers (four halves) of latent attention (a query latent, interleaved rotary) and a dense
# MLP; each layer's shortcut MoE: 4 routed experts and 4 identity ones, top-3 of the softmax
# plus the correction bias, weights times 2.5
CONFIGS = {
    "longcat_flash": lambda: LongcatFlashConfig(
        vocab_size=128, hidden_size=32, ffn_hidden_size=48, num_layers=2, num_attention_heads=4, kv_lora_rank=16,
        q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8, v_head_dim=12, n_routed_experts=E,
        zero_expert_num=Z, moe_topk=K, expert_ffn_hidden_size=16, routed_scaling_factor=2.5, bos_token_id=None,
        eos_token_id=None, pad_token_id=None),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF dir, HF model, reference logits): every weight random, norm scales near 1, the
    correction bias large enough to move the choice."""
    model = randomized(CONFIGS["longcat_flash"](), 0, near_one(), correction_bias)
    return saved(model, tmp_path_factory.mktemp("longcat_flash"))


def test_the_config_reads_as_shortcut_layers_with_zero_experts(built):
    path, model, _ = built
    a = load_hf_config(path).arch
    assert (a.block_form, a.num_hidden_layers, a.intermediate_size) == ("shortcut_moe", 2, 48)
    assert (a.moe.num_local_experts, a.moe.zero_expert_num, a.moe.router_kind, a.moe.norm_topk_prob) == (
        E, Z, "softmax_bias", False)
    assert a.latent.lora_scaling and a.rope_interleaved
    # the correction bias is a buffer to transformers, as to the count
    assert load_hf_config(path).num_params() == sum(p.numel() for p in model.parameters())


def test_each_new_mechanism_moves_transformers_logits(built):
    """transformers' logits move without each mechanism, so the parity tests see all three: the
    zero experts never chosen (their correction bias -1e4), the lora scales 1, the shortcut MoE's
    output 0 (routed experts' down projections and zero experts both off)."""
    _, model, ref = built
    other = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager").eval()

    def moved(edit) -> float:
        other.load_state_dict(model.state_dict())
        with torch.no_grad():
            for layer in other.model.layers:
                edit(layer)
        return float(np.abs(hf_logits(other, TOKENS) - ref).max())

    def no_zero_experts(layer):
        layer.mlp.router.e_score_correction_bias[E:] = -1e4

    def unscaled(layer):
        for attn in layer.self_attn:
            attn.mla_scale_q_lora = attn.mla_scale_kv_lora = 1.0

    def no_shortcut(layer):
        no_zero_experts(layer)
        layer.mlp.experts.down_proj.zero_()

    assert moved(no_zero_experts) > 1e-2
    assert moved(unscaled) > 1e-2
    assert moved(no_shortcut) > 1e-2


def test_the_moe_with_zero_experts_under_ep(built):
    """ep on (expert=4, data=2): the routed experts one a device, the router's 8 columns (routed
    and zero experts) split too; the indexed dispatch with a slot for every routed choice drops
    none (the zero experts' choices take no slot and count as no drop); logits within 1e-4."""
    path, _, ref = built
    module, _, params, mesh = load_ep(path, moe_dispatch="indexed", capacity_factor=E / K)
    moe = params["layers"]["moe"]
    assert moe["wi_gate"].shape == (2, E, 32, 16) and moe["wi_gate"].addressable_shards[0].data.shape[1] == 1
    assert moe["router"]["kernel"].shape == (2, 32, E + Z) and moe["router_bias"].shape == (2, E + Z)
    assert moe["router"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "expert")
    got, state = apply_mutable(module, params, mesh, ["metrics"])
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    assert float(np.max(state["metrics"]["layers"]["moe"]["dropped_fraction"])) == pytest.approx(0, abs=1e-6)


def test_the_two_halves_under_fsdp_tp(built):
    """fsdp_tp on (data 2, fsdp 2, tensor 2): each half's latent expansion split over heads
    (tensor), its dense MLP over mlp (tensor) and embed (fsdp); logits within 1e-4."""
    path, _, ref = built
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
    spec = jax.sharding.PartitionSpec
    for half in ("half_0", "half_1"):
        layer = params["layers"][half]
        assert layer["attn"]["kv_b"]["kernel"].sharding.spec == spec(None, None, "tensor", None)
        assert layer["mlp"]["up"]["kernel"].sharding.spec == spec(None, "fsdp", "tensor")
    np.testing.assert_allclose(apply(module, params, mesh), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("change, message", [
    (dict(head_dim=16), r"head_dim=16: transformers' rotary embedding turns head_dim features"),
    (dict(router_bias=True), r"router_bias=True: transformers' LongCat-Flash router holds a bias it never adds"),
])
def test_what_transformers_computes_otherwise_is_refused(built, tmp_path, change, message):
    """A rotary width other than qk_rope_head_dim (transformers breaks), a router bias (built but
    never added by transformers): one error naming the field."""
    path, _, _ = built
    with pytest.raises(HFError, match=message):
        load_hf_config(rewritten(path, tmp_path / "changed", **change))


def test_the_chat_preset_has_its_published_size():
    """LongCat-Flash-Chat's "560 billion total parameters" (transformers' count of the preset on the
    meta device: tests/hf/test_hf_families.py)."""
    assert PRESETS["longcat-flash-chat"].num_params() == 560_664_958_976
