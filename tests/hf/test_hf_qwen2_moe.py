"""Qwen2-MoE: Qwen2's attention (q/k/v biases) with MoE layers that add a shared expert, scaled
by the sigmoid of its gate (the ``shared_experts`` and ``shared_expert_gate`` features), dense
and MoE layers mixed (``decoder_sparse_step``), experts of their own width.

A tiny random HF model: logits equal transformers' on one device, under fsdp_tp and under ep on
8 devices (the indexed dispatch with a slot for every token: HF drops nothing), greedy tokens
equal, export then ``from_pretrained`` equal. Tolerance: 1e-4 on float32 logits, as for every family.
"""

import os
import sys

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2MoeConfig

from shardzoo.models.hf import config_to_hf, export_hf, load_hf_config
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    TOKENS,
    TOL,
    apply,
    apply_mutable,
    config_of,
    hf_logits,
    load_ep,
    one_device,
    randomized,
    saved,
)

E, K = 4, 2
# Layers 1 and 3 MoE (decoder_sparse_step 2), 0 and 2 dense: scanned as two periods of (D, M).
HF_CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, num_experts=E, num_experts_per_tok=K,
                 moe_intermediate_size=16, shared_expert_intermediate_size=24, decoder_sparse_step=2,
                 norm_topk_prob=True, router_aux_loss_coef=0.02)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF dir, HF model, reference logits): every weight random, norm scales near 1."""
    return saved(randomized(Qwen2MoeConfig(**HF_CONFIG), seed=1), tmp_path_factory.mktemp("qwen2_moe"))


def test_the_shared_expert_and_its_gate_matter(built):
    """Without the shared expert, or with its gate at sigmoid(0) = 1/2, transformers gives other
    logits: a model that dropped either could not pass the parity tests below."""
    path, model, ref = built
    for name in ("shared_expert.down_proj", "shared_expert_gate"):
        other = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager").eval()
        state = {k: (torch.zeros_like(v) if name in k else v) for k, v in model.state_dict().items()}
        other.load_state_dict(state)
        assert np.abs(hf_logits(other, TOKENS) - ref).max() > 1e-2, name
    config = load_hf_config(path)
    assert (config.moe.shared_expert_intermediate_size, config.moe.shared_expert_gate) == (24, True)
    assert [s.mlp for s in config.layer_specs()] == ["dense", "moe", "dense", "moe"]
    assert config.layout().as_tuple() == (0, 2, 2)  # scanned: two periods of (dense, MoE)
    hf_count = sum(p.numel() for p in model.parameters())
    assert config.num_params() == hf_count
    routed_idle = 2 * (E - K) * 3 * 32 * 16  # two MoE layers' experts not chosen; the shared one always runs
    assert config.num_params(active=True) == hf_count - routed_idle


def test_logits_match_on_one_device_and_under_fsdp_tp(built):
    path, _, ref = built
    one = one_device()
    module, _, params = load_hf(path, mesh=one, rules=get_rules("fsdp"))
    shared = params["layers"]["sub_1"]["shared_expert"]
    assert shared["gate"]["kernel"].shape == (2, 32, 24)  # [layers, embed, mlp]
    assert params["layers"]["sub_1"]["shared_expert_gate"]["kernel"].shape == (2, 32)
    got = apply(module, params, one)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
    kernel = params["layers"]["sub_1"]["shared_expert"]["up"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    got = apply(module, params, mesh)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


def test_logits_match_under_ep_on_8_devices_with_the_indexed_dispatch(built):
    path, _, ref = built
    # capacity factor E / K: every expert has a slot for every token, so nothing is dropped
    module, _, params, mesh = load_ep(path, moe_dispatch="indexed", capacity_factor=E / K)
    assert params["layers"]["sub_1"]["moe"]["wi_gate"].addressable_shards[0].data.shape[1] == 1  # 4 ways
    got, state = apply_mutable(module, params, mesh, ["metrics"])
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    assert float(np.max(state["metrics"]["layers"]["sub_1"]["moe"]["dropped_fraction"][0])) == pytest.approx(0)


def test_greedy_generate_matches_transformers(built, parity):
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert (hf["model_type"], hf["shared_expert_intermediate_size"], hf["mlp_only_layers"]) == ("qwen2_moe", 24,
                                                                                                [0, 2])
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def test_a_shared_expert_without_its_gate_is_no_qwen2_moe():
    """Qwen2-MoE always gates its shared expert: an ungated one (DeepSeek's) is refused, named."""
    config = config_of(Qwen2MoeConfig(**HF_CONFIG))
    ungated = config.replace(shared_expert_gate=False)
    from shardzoo.models.hf import HFError

    with pytest.raises(HFError, match="shared_expert_gate=False"):
        config_to_hf(ungated, family="qwen2_moe")
    dense = config.replace(num_local_experts=0, mlp_layer_types=None)  # a dense model has no MoE settings
    assert dense.moe is None


def test_a_sliding_window_on_the_layers_transformers_derives_equals_it(tmp_path):
    """use_sliding_window with max_window_layers: every other layer from layer 0, below it."""
    hf_config = Qwen2MoeConfig(**HF_CONFIG, use_sliding_window=True, sliding_window=4, max_window_layers=4)
    path, model, ref = saved(randomized(hf_config, seed=2), tmp_path)
    config = load_hf_config(path)
    assert [s.window for s in config.layer_specs()] == [4, None, 4, None]
    one = one_device()
    module, _, params = load_hf(path, mesh=one, rules=get_rules("fsdp"))
    got = apply(module, params, one)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
