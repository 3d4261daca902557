"""DeepSeek-V2 and V3: multi-head latent attention (a query latent in V3's test, a plain q
projection in V2's), a first dense layer, shared experts beside routed ones, V2's group-limited
softmax router and V3's sigmoid router with its correction bias and groups.

Tiny random HF models (latent ranks below the heads' total widths): logits equal transformers'
on one device (V3's under fsdp_tp and under ep on 8 devices too: V2 adds no sharded component),
greedy tokens equal (decoding from the latent cache), export then ``from_pretrained`` equal. Tolerance: 1e-4 on float32 logits.
"""

import os
import sys

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

from shardzoo.models.hf import export_hf, load_hf_config
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    TOKENS,
    TOL,
    apply,
    apply_mutable,
    correction_bias,
    hf_logits,
    load_ep,
    one_device,
    randomized,
    saved,
)

E, K = 8, 2
DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=16,
            first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
CONFIGS = {
    # no query latent; two shared experts; the best two of four groups (two experts each) by their best probability
    "v2": lambda **kw: DeepseekV2Config(**DIMS, q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy",
                                        n_group=4, topk_group=2, routed_scaling_factor=1.5, **kw),
    # a query latent; sigmoid router, four groups ranked by their two best biased scores, two kept
    "v3": lambda **kw: DeepseekV3Config(**DIMS, q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2,
                                        routed_scaling_factor=2.5, **kw),
}


def build(hf_config, path, seed=1):
    """(HF dir, HF model, reference logits): every weight random, norm scales near 1, the
    correction bias large enough to move the choice."""
    return saved(randomized(hf_config, seed, buffers=correction_bias), path)


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    """(version, HF dir, HF model, reference logits)."""
    return request.param, *build(CONFIGS[request.param](), tmp_path_factory.mktemp(f"deepseek_{request.param}"))


def test_the_config_reads_as_latent_attention_with_a_dense_prefix(built):
    version, path, model, _ = built
    config = load_hf_config(path)
    assert (config.latent.kv_lora_rank, config.latent.q_lora_rank) == (16, None if version == "v2" else 24)
    assert config.moe.router_kind == ("softmax_groups" if version == "v2" else "sigmoid_groups")
    assert config.moe.shared_expert_intermediate_size == (32 if version == "v2" else 16)
    assert [s.mlp for s in config.layer_specs()] == ["dense", "moe", "moe"]
    assert config.layout().as_tuple() == (1, 1, 2)  # the dense layer unrolled, the MoE layers scanned
    assert config.num_params() == sum(p.numel() for p in model.parameters())


def test_routing_picks_different_experts_per_token(built):
    """The reference routes tokens of one row to different experts (else routing is untested)."""
    _, _, model, _ = built
    seen = []
    hook = model.model.layers[1].mlp.gate.register_forward_hook(lambda m, i, out: seen.append(out[2]))
    hf_logits(model, TOKENS)
    hook.remove()
    chosen = {tuple(sorted(r)) for r in seen[0].tolist()}
    assert len(chosen) >= 3


@pytest.mark.parametrize("built", ["v3"], indirect=True)
def test_v3_correction_bias_and_scaling_matter(built):
    """Without V3's correction bias (it moves the choice only) or with another routed scaling,
    transformers gives other logits: a model that ignored either could not pass the parity tests."""
    version, path, model, ref = built
    other = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager").eval()
    state = {k: (torch.zeros_like(v) if "e_score_correction_bias" in k else v) for k, v in model.state_dict().items()}
    other.load_state_dict(state)
    assert np.abs(hf_logits(other, TOKENS) - ref).max() > 1e-3
    other.load_state_dict(model.state_dict())
    for layer in other.model.layers[1:]:
        layer.mlp.gate.routed_scaling_factor = 1.0
    assert np.abs(hf_logits(other, TOKENS) - ref).max() > 1e-3


def test_logits_match_on_one_device_and_under_fsdp_tp(built):
    """V3's latent attention (a query latent besides V2's latent key and value) under fsdp_tp; V2's
    on one device, its plain q projection being any family's."""
    version, path, _, ref = built
    one = one_device()
    module, _, params = load_hf(path, mesh=one, rules=get_rules("fsdp"))
    attn = params["layers"]["attn"]
    assert attn["kv_a"]["kernel"].shape == (2, 32, 16)  # [layers, embed, kv_lora]
    assert attn["kv_b"]["kernel"].shape == (2, 16, 4, 20)  # [layers, kv_lora, heads, k_nope + v]
    assert ("q_a" in attn) == (version == "v3")
    got = apply(module, params, one)
    print(f"{version} one device max |logit diff| {np.abs(got - ref).max():.2e}")
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    if version == "v2":
        return
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
    kernel = params["layers"]["attn"]["kv_b"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor", None)  # latent replicated
    got = apply(module, params, mesh)
    print(f"{version} fsdp_tp max |logit diff| {np.abs(got - ref).max():.2e}")
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("built", ["v3"], indirect=True)
def test_logits_match_under_ep_on_8_devices(built):
    """V3's experts under ep; V2's are the same experts, its group-limited softmax choice one per
    token (its parity: one device above)."""
    version, path, _, ref = built
    module, _, params, mesh = load_ep(path, moe_dispatch="indexed", capacity_factor=E / K)
    assert params["layers"]["moe"]["wi_gate"].addressable_shards[0].data.shape[1] == 2  # 4 ways
    got, state = apply_mutable(module, params, mesh, ["metrics"])
    print(f"{version} ep max |logit diff| {np.abs(got - ref).max():.2e}")
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    assert float(np.max(state["metrics"]["layers"]["moe"]["dropped_fraction"])) == pytest.approx(0)


def test_greedy_generate_matches_transformers_from_the_latent_cache(built, parity):
    _, path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])
    module, _, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"))
    cache = jax.eval_shape(lambda p: module.apply({"params": p}, np.zeros((1, 24), np.int32),
                                                  positions=np.zeros((1, 24), np.int32), decode=True,
                                                  mutable=["cache"])[1], params)["cache"]
    attn = cache["layers"]["attn"]
    assert sorted(attn) == ["cache_index", "cached_latent", "cached_rope_key", "cached_segment_ids"]
    assert attn["cached_latent"].value.shape[-1] + attn["cached_rope_key"].value.shape[-1] == 16 + 8


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    version, path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert (hf["model_type"], hf["first_k_dense_replace"]) == (f"deepseek_{version}", 1)
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def test_v3_rotate_half_without_rope_interleave(tmp_path):
    path, _, ref = build(CONFIGS["v3"](rope_interleave=False), tmp_path)
    assert load_hf_config(path).rope_interleaved is False
    one = one_device()
    module, _, params = load_hf(path, mesh=one, rules=get_rules("fsdp"))
    got = apply(module, params, one)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("version", list(CONFIGS))
def test_yarn_with_its_latent_softmax_scale_matches_transformers(version, tmp_path):
    """YaRN at the published configs' factor 40 over a short original context (so the ramp
    falls inside the rotary dims), with ``mscale_all_dim`` != ``mscale``: the rotary frequencies,
    the cos/sin factor and latent attention's mscale**2 on the softmax scale must all be right."""
    yarn = dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=8, beta_fast=32, beta_slow=1,
                mscale=1.0, mscale_all_dim=0.707, rope_theta=10000.0)
    path, _, ref = build(CONFIGS[version](rope_parameters=yarn, max_position_embeddings=320), tmp_path)
    config = load_hf_config(path)
    assert dict(config.rope_scaling)["rope_type"] == "yarn"
    assert config.attention_scale == pytest.approx(16 ** -0.5 * (0.1 * 0.707 * np.log(40) + 1) ** 2, rel=1e-12)
    one = one_device()
    module, _, params = load_hf(path, mesh=one, rules=get_rules("fsdp"))
    got = apply(module, params, one)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    export_hf(config, params, str(tmp_path / "out"))
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert back.config.rope_parameters["mscale_all_dim"] == 0.707
    np.testing.assert_allclose(hf_logits(back, TOKENS), ref, atol=TOL, rtol=0)


def test_v3_train_init_from_the_hf_dir_under_fsdp_then_export_loads_in_transformers(tmp_path, parity):
    """``shardzoo train --init-from`` a tiny DeepSeek V3 (query latent, sigmoid router with groups,
    a shared expert, a dense first layer) under fsdp on 8 devices, every weight trained: the loss
    falls; the export loads in transformers and computes what the run computes (1e-4). LoRA on
    latent attention: test_lora_peft's latent-attention test."""
    model = randomized(CONFIGS["v3"](), seed=7)
    config = parity.trains_from_hf_dir(tmp_path, model, TOKENS[:2], False, TOL)
    assert config.latent.kv_lora_rank == 16 and config.moe.router_kind == "sigmoid_groups"
