"""Kimi-Linear: Kimi delta attention layers (models/kimi_delta.py) beside latent attention without
positions, DeepSeek-V3's MoE (sigmoid router with its correction bias, a shared expert).

A tiny random HF model of 4 layers (KDA, KDA, MLA, KDA; a dense first layer, then MoE), run by
shardzoo in chunks of 5 tokens (16-token rows: 4 chunks, the last one cut) where transformers
runs one chunk of 64: logits equal transformers' on one device and under fsdp_tp on 8 devices
(its MoE, DeepSeek-V3's, under ep: test_hf_deepseek); greedy tokens equal over 16; decoding from the cache equals the full forward; export
then ``from_pretrained`` equal; the parameter count equals transformers'. Tolerance: 1e-4 on
float32 logits against transformers, 1e-5 shardzoo against itself.
"""

import os
import sys

import jax
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P
from transformers import KimiLinearConfig

from shardzoo.models import kimi_delta as kd
from shardzoo.models.decode import cache_init_fn
from shardzoo.models.hf import export_hf, load_hf_config
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    TOKENS,
    TOL,
    apply,
    config_of,
    correction_bias,
    decoded,
    edit,
    one_device,
    randomized,
    saved,
)

LINEAR = dict(num_heads=2, head_dim=8, short_conv_kernel_size=4, kda_layers=[1, 2, 4], full_attn_layers=[3])
CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4,
              v_head_dim=8, linear_attn_config=LINEAR, num_experts=4, num_experts_per_token=2,
              moe_intermediate_size=16, num_shared_experts=1, first_k_dense_replace=1, num_expert_group=2,
              topk_group=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CHUNK = dict(linear_attention_chunk=5)
SCALE = 0.1  # random weights of this size keep fp32 rounding within 1e-4 through 4 layers


def draw(name, p):
    """Norm weights near 1; slow decays (A = exp(A_log) in [0.05, 0.5), softplus(dt_bias) about
    0.13) so that a state carries across chunks; the rest SCALE x normal."""
    if "norm" in name:
        return 1 + 0.1 * torch.randn_like(p)
    if name.endswith("A_log"):
        return torch.log(0.05 + 0.45 * torch.rand_like(p))
    if name.endswith("dt_bias"):
        return -2 + 0.5 * torch.randn_like(p)
    return SCALE * torch.randn_like(p)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    model = randomized(KimiLinearConfig(**CONFIG), seed=1, draw=draw, buffers=correction_bias)
    return saved(model, tmp_path_factory.mktemp("kimi_linear"), use_cache=False)


def _load(path, mesh=None, rules="fsdp"):
    return load_hf(path, mesh=mesh or one_device(), rules=get_rules(rules), overrides=CHUNK)


def test_config_reads_the_layer_pattern(built):
    config = load_hf_config(built[0])
    assert [s.mixer for s in config.layer_specs()] == ["kimi_delta", "kimi_delta", "attention", "kimi_delta"]
    assert [s.mlp for s in config.layer_specs()] == ["dense", "moe", "moe", "moe"]
    assert all(s.rope == "none" for s in config.layer_specs())  # latent attention without positions
    assert config.kimi_delta == kd.KimiDelta(num_heads=2, head_dim=8, conv_kernel=4)
    assert (config.moe.router_kind, config.moe.n_group, config.moe.routed_scaling_factor) == ("sigmoid_groups", 2, 2.446)
    assert type(config).from_dict(config.to_dict()) == config  # the sub-record through a checkpoint's JSON


def test_kimi_k3_additions_are_refused():
    """Kimi K3's output gate on latent attention and its KDA gate settings, which transformers'
    KimiLinear ignores, are one-line errors naming the key."""
    from shardzoo.models.hf import HFError

    for key, value in (("mla_use_output_gate", True), ("linear_attn_config", dict(LINEAR, gate_lower_bound=-5.0))):
        with pytest.raises(HFError, match=key.split("_config")[0]):
            config_of(dict(_published(), **{key: value}))


def test_a_bad_kda_size_is_one_line():
    from shardzoo.models import ModelError, get_model

    with pytest.raises(ModelError, match=r"kimi_delta: .*conv_kernel=1 must be set, conv_kernel >= 2"):
        get_model("kimi-linear-tiny", kimi_delta={"num_heads": 4, "head_dim": 16, "conv_kernel": 1})


def test_logits_match_on_one_device_and_under_fsdp_tp(built):
    """KDA split over its heads; its MoE (DeepSeek-V3's) under ep: test_hf_deepseek."""
    path, _, ref = built
    module, _, params = _load(path)
    got = apply(module, params, one_device())
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = _load(path, mesh, "fsdp_tp")
    kda = params["layers_0"]["linear_attn"]  # layer 0 unrolled (dense), layers 1 (KDA) and 3 (KDA) too
    assert kda["q"]["kernel"].sharding.spec == P("fsdp", "tensor", None)  # [embed, linear_heads, key_dim]
    assert kda["f_b"]["kernel"].sharding.spec == P(None, "tensor", None)  # [value_dim (rank), heads, key_dim]
    assert kda["conv_v"].sharding.spec == P(None, "tensor", None)  # [conv_width, linear_heads, value_dim]
    assert kda["dt_bias"].sharding.spec == P("tensor", None) and kda["A_log"].sharding.spec == P("tensor")
    assert kda["out"]["kernel"].sharding.spec == P("tensor", None, "fsdp")
    sharded = apply(module, params, mesh)
    np.testing.assert_allclose(sharded, ref, atol=TOL, rtol=0)
    print(f"max |logit diff| one device {np.abs(got - ref).max():.2e}, fsdp_tp {np.abs(sharded - ref).max():.2e}")


def test_each_mechanism_changes_the_logits(built):
    """Each mechanism, changed, moves the logits away from transformers' (so the parity above
    could fail): the decay per channel (dt_bias of one channel), its scale per head (A_log), the
    rate (b), the convolution's taps, the output gate (g_b), the norm's weight."""
    path, _, ref = built
    module, _, params = _load(path)
    edits = {"channel decay": ("['linear_attn']['dt_bias']", lambda x: x.at[..., 0].add(3.0)),
             "head decay": ("['linear_attn']['A_log']", lambda x: x + 1.0),
             "rate": ("['linear_attn']['b']['kernel']", lambda x: 0 * x),
             "taps": ("['linear_attn']['conv_q']", lambda x: x[::-1]),
             "gate": ("['linear_attn']['g_b']['kernel']", lambda x: 0 * x),
             "norm": ("['linear_attn']['norm']", lambda x: x + 1.0),
             "delta attention": ("['linear_attn']['out']['kernel']", lambda x: 0 * x)}
    for name, (suffix, fn) in edits.items():
        assert np.abs(apply(module, edit(params, suffix, fn), one_device()) - ref).max() > 1e-2, name


def test_parameter_count_equals_transformers(built):
    _, model, _ = built
    assert load_hf_config(built[0]).num_params() == sum(p.numel() for p in model.parameters())


def test_the_48b_preset_counts_as_transformers_does():
    """kimi-linear-48b-a3b: 49,122,675,072 parameters, transformers' count of the published config
    (KimiLinearForCausalLM on the meta device)."""
    from shardzoo.models import get_config

    config = get_config("kimi-linear-48b-a3b")
    assert config.num_params() == 49_122_675_072
    assert config.arch == config_of(_published()).arch


def _published() -> dict:
    """moonshotai/Kimi-Linear-48B-A3B-Instruct/config.json (its architecture's fields)."""
    return dict(architectures=["KimiLinearForCausalLM"], model_type="kimi_linear", vocab_size=163840,
                hidden_size=2304, head_dim=72, intermediate_size=9216, num_hidden_layers=27, num_attention_heads=32,
                num_key_value_heads=32, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                tie_word_embeddings=False, first_k_dense_replace=1, moe_intermediate_size=1024, moe_layer_freq=1,
                moe_renormalize=True, moe_router_activation_func="sigmoid", num_experts=256,
                num_experts_per_token=8, num_shared_experts=1, routed_scaling_factor=2.446, use_grouped_topk=True,
                num_expert_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True, num_nextn_predict_layers=0,
                model_max_length=1048576, bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
                linear_attn_config=dict(full_attn_layers=[4, 8, 12, 16, 20, 24, 27], head_dim=128,
                                        kda_layers=[1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22,
                                                    23, 25, 26], num_heads=32, short_conv_kernel_size=4))


def test_decoding_from_the_cache_equals_the_full_forward(built):
    """A prefill of 7 tokens (chunks of 5) then 9 single steps give the full forward's logits:
    each KDA layer's cache carries its state and the convolution's last 3 inputs across calls."""
    path, _, _ = built
    module, _, params = _load(path)
    full = apply(module, params, one_device())
    cache = jax.jit(cache_init_fn(module, TOKENS.shape[0], TOKENS.shape[1]))(params)
    kda = cache["layers_0"]["linear_attn"]
    assert kda["recurrent_state"].value.shape == (4, 2, 8, 8)  # [batch, linear_heads, key_dim, value_dim]
    assert kda["conv_q"].value.shape == (4, 3, 2, 8)  # [batch, conv_width - 1, linear_heads, key_dim]
    got = decoded(module, params, cache, TOKENS, prefill=7)
    np.testing.assert_allclose(got, full, atol=1e-5, rtol=1e-5)


def test_greedy_generate_matches_transformers(built, parity):
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert hf["model_type"] == "kimi_linear" and hf["linear_attn_config"]["kda_layers"] == [1, 2, 4]
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def test_train_init_from_the_hf_dir_under_fsdp_then_export_loads_in_transformers(tmp_path, parity):
    """``shardzoo train --init-from`` the tiny Kimi-Linear under fsdp on 8 devices with LoRA adapters
    (KDA's projections among them): the loss falls; the run's checkpoint (its config's kimi_delta
    record through JSON) exports merged to what transformers loads and computes as the run does
    (1e-4). KDA's gradients of every weight: tests/models/test_kimi_delta.py."""
    model = randomized(KimiLinearConfig(**CONFIG), seed=3, draw=draw, buffers=correction_bias)
    config = parity.trains_from_hf_dir(tmp_path, model, TOKENS[:2], True, TOL)
    assert config.kimi_delta == kd.KimiDelta(num_heads=2, head_dim=8, conv_kernel=4)
