"""Nemotron-H with MoE layers (Nemotron 3 Nano's): 5 layers M E * M E (mamba, MoE, attention
without positions, mamba, MoE). A MoE layer: DeepSeek-V3's sigmoid router (a random nonzero
``e_score_correction_bias``, 8 experts in 2 groups of which 1 is kept, top-2, renormalised, times
2.5) over plain experts (up, relu2, down: ``expert_type`` "plain", no ``wi_gate``) and a shared
plain MLP of its own width. Logits equal transformers' (eager) on one device (dropless), under
fsdp_tp, and under ep on 8 devices with the indexed, capacity and shard_map dispatches; the
correction bias and the scaling each move them; greedy tokens equal, export then
``from_pretrained`` equal, decoding from the cache equals the full forward, parameter counts
equal transformers' (and the ``nemotron-3-nano-30b-a3b`` preset's its published config's).
Tolerance: 1e-4 on float32 logits against transformers, 1e-5 shardzoo against itself.
"""

import json
import os
import sys

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, NemotronHConfig

from shardzoo.models.decode import cache_init_fn
from shardzoo.models.hf import HFError, export_hf, load_hf_config
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    TOL,
    apply_mutable,
    correction_bias,
    decoded,
    edit,
    mamba_draw,
    one_device,
    randomized,
    saved,
)

E, K = 8, 2
TYPES = ["linear_attention", "moe", "full_attention", "linear_attention", "moe"]


def hf_config(**kw):
    return NemotronHConfig(**(dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, head_dim=8, layers_block_type=TYPES, mamba_num_heads=8,
        mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=4, n_routed_experts=E, num_experts_per_tok=K,
        moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5) | kw))


# 8 rows: one for each of the 8 devices of shard_map's expert-parallel rows
TOKENS = np.random.default_rng(0).integers(0, 128, size=(8, 11)).astype(np.int32)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF dir, HF model, reference logits): every weight random as the mamba families draw them,
    the correction bias 0.3 x normal."""
    model = randomized(hf_config(), seed=1, draw=mamba_draw, buffers=correction_bias)
    return saved(model, tmp_path_factory.mktemp("nemotron_h_moe"), TOKENS)


def _apply(module, params, mesh, collections=()):
    return apply_mutable(module, params, mesh, collections, TOKENS)


def test_config_reads_moe_layers_with_plain_experts(built):
    path, _, _ = built
    config = load_hf_config(path)
    assert [(s.mixer, s.mlp) for s in config.layer_specs()] == [
        ("mamba", "none"), ("none", "moe"), ("attention", "none"), ("mamba", "none"), ("none", "moe")]
    a = config.arch
    assert (a.moe.expert_type, a.moe.router_kind, a.moe.num_local_experts, a.moe.num_experts_per_tok, a.moe.n_group, a.moe.topk_group) == (
        "plain", "sigmoid_groups", E, K, 2, 1)
    assert (a.expert_size, a.moe.shared_expert_intermediate_size, a.moe.routed_scaling_factor) == (16, 24, 2.5)
    assert a.mlp_type == "plain" and a.hidden_act == "relu2" and a.moe.router_aux_loss_coef == 0.0
    assert config.execution.moe_dispatch == "dropless"


def test_logits_match_on_one_device_and_under_fsdp_tp_and_the_router_matters(built):
    """The parity; the logits move > 1e-2 without the correction bias or with routed scaling 1,
    so both reach the result; the experts hold no gate."""
    path, _, ref = built
    module, config, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"))
    names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
    assert any(n.endswith("['moe']['wi_up']") for n in names) and not any("wi_gate" in n for n in names)
    got, _ = _apply(module, params, one_device())
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    unbiased = edit(params, "['router_bias']", lambda x: 0 * x)
    assert np.abs(_apply(module, unbiased, one_device())[0] - ref).max() > 1e-2
    unscaled = config.replace(routed_scaling_factor=1.0).build()
    assert np.abs(_apply(unscaled, params, one_device())[0] - ref).max() > 1e-2
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
    sharded, _ = _apply(module, params, mesh)
    np.testing.assert_allclose(sharded, ref, atol=TOL, rtol=0)
    print(f"max |logit diff| one device {np.abs(got - ref).max():.2e}, fsdp_tp {np.abs(sharded - ref).max():.2e}")


def test_logits_match_under_ep_with_every_capacity_dispatch(built):
    """Experts split 4 ways over ``expert``: the indexed and capacity dispatches (XLA's
    all-to-all) and shard_map's explicit one, capacity E / K (nothing dropped)."""
    path, _, ref = built
    mesh = make_mesh("expert=4,data=2")
    module, config, params = load_hf(path, mesh=mesh, rules=get_rules("ep"),
                                     overrides=dict(moe_dispatch="indexed", capacity_factor=E / K))
    leaves = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
    wi_up = next(x for n, x in leaves.items() if n.endswith("['moe']['wi_up']"))
    assert wi_up.addressable_shards[0].data.shape[-3] == wi_up.shape[-3] // 4  # 2 experts a device
    got, state = _apply(module, params, mesh, ["metrics"])
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    assert max(float(np.max(x)) for p, x in jax.tree_util.tree_leaves_with_path(state["metrics"])
               if "dropped_fraction" in jax.tree_util.keystr(p)) == pytest.approx(0)
    diffs = {"indexed": np.abs(got - ref).max()}
    for dispatch in ("capacity", "shard_map"):
        other = config.replace(moe_dispatch=dispatch).build(module.placement)
        out, _ = _apply(other, params, mesh)
        np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)
        diffs[dispatch] = np.abs(out - ref).max()
    print("ep max |logit diff|", {k: f"{v:.2e}" for k, v in diffs.items()})


def test_parameter_count_equals_transformers(built):
    path, model, _ = built
    config = load_hf_config(path)
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    # active: the router, K of the E experts (up and down: no gate) and the shared expert
    assert config.num_params() - config.num_params(active=True) == 2 * (E - K) * 2 * 32 * 16


def test_decoding_from_the_cache_equals_the_full_forward(built):
    """A prefill of 6 tokens then 5 single steps give the full forward's logits (1e-5)."""
    path, _, _ = built
    module, _, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"), scan_layers=False)
    tokens = TOKENS[:4]
    full, _ = apply_mutable(module, params, one_device(), (), tokens)
    cache = jax.jit(cache_init_fn(module, tokens.shape[0], tokens.shape[1]))(params)
    got = decoded(module, params, cache, tokens, prefill=6)
    np.testing.assert_allclose(got, full, atol=1e-5, rtol=1e-5)
    print(f"max |decode - forward| {np.abs(got - full).max():.2e}")


def test_greedy_generate_matches_transformers(built, parity):
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert hf["layers_block_type"] == TYPES
    assert (hf["n_routed_experts"], hf["moe_intermediate_size"], hf["moe_shared_expert_intermediate_size"],
            hf["n_group"], hf["topk_group"], hf["routed_scaling_factor"]) == (E, 16, 24, 2, 1, 2.5)
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def test_latent_experts_are_refused_in_one_line(tmp_path):
    hf_config(moe_latent_size=16).save_pretrained(tmp_path)
    with pytest.raises(HFError, match=r"moe_latent_size=16: .*hidden_size") as info:
        load_hf_config(str(tmp_path))
    assert "\n" not in str(info.value)


# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16's config.json (transformers 4.55's keys)
NANO = dict(architectures=["NemotronHForCausalLM"], attention_bias=False, attention_dropout=0.0, bos_token_id=1,
            chunk_size=128, conv_kernel=4, eos_token_id=2, expand=2, head_dim=128, hidden_dropout=0.0,
            hidden_size=2688, hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
            initializer_range=0.02, intermediate_size=1856, layer_norm_epsilon=1e-05, mamba_head_dim=64,
            mamba_hidden_act="silu", mamba_num_heads=64, mamba_proj_bias=False, mamba_ssm_cache_dtype="float32",
            max_position_embeddings=262144, mlp_bias=False, mlp_hidden_act="relu2", model_type="nemotron_h",
            moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, n_group=1, n_groups=8,
            n_routed_experts=128, n_shared_experts=1, norm_eps=1e-05, norm_topk_prob=True, num_attention_heads=32,
            num_experts_per_tok=6, num_hidden_layers=52, num_key_value_heads=2, num_logits_to_keep=1,
            pad_token_id=0, partial_rotary_factor=1.0, rescale_prenorm_residual=True, residual_in_fp32=False,
            rope_theta=10000, routed_scaling_factor=2.5, sliding_window=None, ssm_state_size=128,
            tie_word_embeddings=False, time_step_floor=0.0001, time_step_max=0.1, time_step_min=0.001,
            topk_group=1, torch_dtype="bfloat16", use_bias=False, use_cache=True, use_conv_bias=True,
            use_mamba_kernels=True, vocab_size=131072)


def test_the_published_nemotron_3_nano_config_reads_as_the_preset(tmp_path):
    """It reads as the ``nemotron-3-nano-30b-a3b`` preset, whose parameter count is transformers'
    count of that config (meta device), its active count about 3.5B."""
    from shardzoo.models import get_config

    (tmp_path / "config.json").write_text(json.dumps(NANO))
    preset = get_config("nemotron-3-nano-30b-a3b")
    assert load_hf_config(str(tmp_path)).arch == preset.arch
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(NemotronHConfig.from_pretrained(tmp_path))
    count = sum(p.numel() for p in model.parameters())
    assert preset.num_params() == count
    assert 3e9 < preset.num_params(active=True) < 4e9
    print(f"nemotron-3-nano-30b-a3b: {count:,} parameters, {preset.num_params(active=True):,} active")


def test_what_nemotron_h_cannot_express_is_refused_in_one_line(built):
    """Gated experts do not export as Nemotron-H; plain experts take no expert biases or clamps."""
    from shardzoo.models import ModelError
    from shardzoo.models.hf.registry import config_to_hf

    path, _, _ = built
    config = load_hf_config(path)
    with pytest.raises(HFError, match=r"plain experts .*expert_type='gated'"):
        config_to_hf(config.replace(expert_type="gated"), family="nemotron_h")
    with pytest.raises(ModelError, match=r"expert_type='plain' .*expert_bias=True"):
        config.replace(expert_bias=True)
