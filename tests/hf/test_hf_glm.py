"""GLM, GLM-4 and GLM-4.5 (glm4_moe): partial rotary embeddings (GLM and GLM-4 on interleaved
pairs, GLM-4.5 rotate-half), q/k/v biases, GLM's fused ``gate_up_proj``, GLM-4's post-norms after
attention and MLP, and GLM-4.5's DeepSeek-V3 routing (sigmoid scores with a correction bias, the
best two of four expert groups, renormalised and scaled weights), a shared expert, a first dense
layer and qk-norm.

Tiny random HF models with every mechanism on (head_dim 16 apart from hidden / heads, half of it
rotating): logits equal transformers' on one device (GLM's under fsdp_tp on 8 devices too: the
other two recombine components sharded elsewhere), greedy tokens equal, export then ``from_pretrained`` equal; each mechanism moves
transformers' logits, so the parity tests could fail. Presets count as transformers' on the meta
device. Tolerance: 1e-4 on float32 logits.
"""

import copy
import os
import sys

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Glm4Config, Glm4MoeConfig, GlmConfig

from shardzoo.models.hf import config_to_hf, export_hf, family_of_model_type, load_hf_config
from shardzoo.models.hf.registry import PRESETS, arch_from_hf
from shardzoo.models.transformer import Transformer
from shardzoo.sharding import get_rules
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    TOKENS,
    TOL,
    apply,
    correction_bias,
    fsdp_tp_parity,
    hf_logits,
    one_device,
    randomized,
    saved,
)

E, K = 8, 2
DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, attention_bias=True)  # partial_rotary_factor: transformers' default 0.5
CONFIGS = {
    "glm": lambda **kw: GlmConfig(**DIMS, **kw),
    "glm4": lambda **kw: Glm4Config(**DIMS, **kw),
    # a dense layer, then two MoE layers: 8 experts in 4 groups, the best 2 groups kept, top-2
    "glm4_moe": lambda **kw: Glm4MoeConfig(**(DIMS | dict(num_hidden_layers=3)), n_routed_experts=E,
                                           num_experts_per_tok=K, moe_intermediate_size=16, n_shared_experts=1,
                                           n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                           first_k_dense_replace=1, use_qk_norm=True, **kw),
}
SEEDS = {"glm": 1, "glm4": 1, "glm4_moe": 1}


def variant(model, **config):
    """An HF model of ``model``'s weights under another config (strict=False: qk-norm off)."""
    hf_config = copy.deepcopy(model.config)
    for key, value in config.items():
        if key == "partial_rotary_factor":
            hf_config.rope_parameters[key] = value
        else:
            setattr(hf_config, key, value)
    other = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    other.load_state_dict(model.state_dict(), strict=False)
    return other


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    """(model_type, HF dir, HF model, reference logits): every weight random (biases too), norm
    scales near 1, the correction bias large enough to move the choice."""
    model = randomized(CONFIGS[request.param](), SEEDS[request.param], buffers=correction_bias)
    return request.param, *saved(model, tmp_path_factory.mktemp(request.param))


def test_the_config_reads_as_partial_rotary_with_the_familys_mechanisms(built):
    family, path, model, _ = built
    config = load_hf_config(path)
    assert (config.partial_rotary_factor, config.head_size, config.rope_dim) == (0.5, 16, 8)
    assert config.rope_interleaved == (family != "glm4_moe")
    assert config.attention_bias and not config.attention_out_bias
    assert config.norm_position == ("both" if family == "glm4" else "pre")
    if family == "glm4_moe":
        assert (config.moe.router_kind, config.moe.n_group, config.moe.topk_group) == ("sigmoid_groups", 4, 2)
        assert (config.moe.routed_scaling_factor, config.moe.shared_expert_intermediate_size, config.qk_norm) == (2.5, 16, "head")
        assert [s.mlp for s in config.layer_specs()] == ["dense", "moe", "moe"]
        assert config.layout().as_tuple() == (1, 1, 2)  # the dense layer unrolled, the MoE layers scanned
    assert config.num_params() == sum(p.numel() for p in model.parameters())


def test_each_mechanism_moves_transformers_logits(built):
    """Without each mechanism transformers (or, for what its config cannot switch, shardzoo
    against transformers' reference) gives other logits: a family that dropped one could not
    pass the parity tests below."""
    family, path, model, ref = built
    moved = lambda other: np.abs(hf_logits(other) - ref).max()  # noqa: E731
    changes = {"whole-head rotary": variant(model, partial_rotary_factor=1.0)}
    state = model.state_dict()
    no_bias = variant(model)
    no_bias.load_state_dict({k: torch.zeros_like(v) if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))
                             else v for k, v in state.items()})
    changes["no q/k/v biases"] = no_bias
    if family == "glm4":
        plain = variant(model)
        for layer in plain.model.layers:
            layer.post_self_attn_layernorm = layer.post_mlp_layernorm = torch.nn.Identity()
        changes["no post-norms"] = plain
    if family == "glm4_moe":
        changes["no qk-norm"] = variant(model, use_qk_norm=False)
        changes["routed scaling 1"] = variant(model, routed_scaling_factor=1.0)
        changes["one group (no group limit)"] = variant(model, n_group=1, topk_group=1)
        unbiased = variant(model)
        unbiased.load_state_dict({k: torch.zeros_like(v) if "e_score_correction_bias" in k else v
                                  for k, v in state.items()})
        changes["no correction bias"] = unbiased
        no_shared = variant(model)
        no_shared.load_state_dict({k: torch.zeros_like(v) if "shared_experts.down_proj" in k else v
                                   for k, v in state.items()})
        changes["no shared expert"] = no_shared
        no_dense = variant(model)
        no_dense.load_state_dict({k: torch.zeros_like(v) if k == "model.layers.0.mlp.down_proj.weight" else v
                                  for k, v in state.items()})
        changes["no first dense MLP"] = no_dense
    else:
        swapped = variant(model)  # gate | up the other way round
        swapped.load_state_dict({k: torch.cat(v.chunk(2)[::-1]) if k.endswith("gate_up_proj.weight") else v
                                 for k, v in state.items()})
        changes["up | gate"] = swapped
    for name, other in changes.items():
        print(f"{family}: {name} moves transformers' logits by {moved(other):.2e}")
        assert moved(other) > 1e-3, name
    # rotate-half where transformers turns interleaved pairs (and the reverse for GLM-4.5)
    mesh = one_device()
    module, config, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp"))
    got = apply(Transformer(config.replace(rope_interleaved=not config.rope_interleaved)), params, mesh)
    print(f"{family}: the other rotary pairing is {np.abs(got - ref).max():.2e} off transformers")
    assert np.abs(got - ref).max() > 1e-3


@pytest.mark.parametrize("built", ["glm4_moe"], indirect=True)
def test_routing_drops_experts_and_groups(built):
    """transformers' router gives tokens different expert pairs, from at most two groups."""
    family, _, model, _ = built
    seen = []
    hook = model.model.layers[1].mlp.gate.register_forward_hook(lambda m, i, out: seen.append(out[2]))
    hf_logits(model)
    hook.remove()
    chosen = seen[0].tolist()
    assert len({tuple(sorted(r)) for r in chosen}) >= 5
    assert all(len({e // 2 for e in r}) <= 2 for r in chosen)


@pytest.mark.parametrize("built", ["glm4", "glm4_moe"], indirect=True)
def test_logits_match_on_one_device(built, parity):
    """GLM-4 and GLM-4.5 only recombine components sharded elsewhere: GLM's fused gate_up and
    rotary below; post-norms: test_hf_models' olmo2; DeepSeek-V3's routing with a shared expert
    and a dense first layer, under fsdp_tp and ep: test_hf_deepseek's v3."""
    family, path, _, ref = built
    _, module, _, params = parity.load(path)
    got = apply(module, params, one_device())
    print(f"{family} max |logit diff| one device {np.abs(got - ref).max():.2e}")
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("built", ["glm"], indirect=True)
def test_logits_match_on_one_device_and_under_fsdp_tp(built):
    """GLM's fused gate_up split into the MLP's tensor-split halves, its partial interleaved rotary."""
    family, path, _, ref = built
    got, sharded = fsdp_tp_parity(path, ref)
    print(f"{family} max |logit diff| one device {np.abs(got - ref).max():.2e}, "
          f"fsdp_tp {np.abs(sharded - ref).max():.2e}")


def test_greedy_generate_matches_transformers(built, parity):
    _, path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    family, path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert (hf["model_type"], hf["partial_rotary_factor"]) == (family, 0.5)
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


@pytest.mark.parametrize("family", ["glm", "glm4_moe"])
def test_yarn_on_the_rotating_part_matches_transformers(family, tmp_path):
    """YaRN over the rotating quarter of each head (factor 8 from 8 positions, 16 tokens):
    frequencies from the rotary dims only, cos/sin scaled, interleaved for GLM."""
    yarn = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=8, rope_theta=1000.0,
                partial_rotary_factor=0.25)
    path, _, ref = saved(randomized(CONFIGS[family](rope_parameters=yarn), 0, buffers=correction_bias), tmp_path)
    one = one_device()
    module, config, params = load_hf(path, mesh=one, rules=get_rules("fsdp"))
    assert (config.rope_dim, config.rope_scaling_dict["rope_type"]) == (4, "yarn")
    got = apply(module, params, one)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["glm", "glm4_moe"])
def test_config_json_without_the_glm_defaults_reads_as_transformers_does(family):
    """No partial_rotary_factor (0.5), num_key_value_heads (GLM 2, GLM-4.5 8) nor head_dim (GLM
    128; GLM-4.5 hidden / heads): the architecture transformers builds."""
    raw = dict(model_type=family, vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=16, pad_token_id=0)
    hf = CONFIGS[family]().__class__.from_dict(raw)
    config = arch_from_hf(family_of_model_type(family), raw)
    assert config.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"] == 0.5
    assert config.kv_heads == hf.num_key_value_heads == (2 if family == "glm" else 8)
    assert config.head_size == getattr(hf, "head_dim", 64 // 16) == (128 if family == "glm" else 4)


# zai-org/GLM-4.5-Air's config.json (as transformers 4.54 printed it loading that model)
PUBLISHED_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": [151329, 151336, 151338], "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 10944, "max_position_embeddings": 131072,
    "model_type": "glm4_moe", "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8,
    "num_hidden_layers": 46, "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "pad_token_id": 151329,
    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16",
    "transformers_version": "4.54.1", "use_cache": True, "use_qk_norm": False, "vocab_size": 151552,
}


def test_the_published_glm_4_5_air_config_reads_as_the_preset():
    assert arch_from_hf(family_of_model_type("glm4_moe"), PUBLISHED_AIR) == PRESETS["glm-4.5-air"].arch
    written = config_to_hf(PRESETS["glm-4.5-air"])  # what export writes: the published values
    shared = set(written) & set(PUBLISHED_AIR) - {"torch_dtype"}
    assert len(shared) > 25 and {k: written[k] for k in shared} == {k: PUBLISHED_AIR[k] for k in shared}


@pytest.mark.parametrize("name", ["glm-tiny", "glm4-tiny", "glm4-moe-tiny", "glm-4.5-air"])
def test_presets_count_as_transformers_on_the_meta_device(name):
    config = PRESETS[name]
    with torch.device("meta"):  # shapes only, no weights
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config_to_hf(config)))
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    if name == "glm-4.5-air":
        assert config.num_params() == 106_852_245_504  # "106B total parameters"
