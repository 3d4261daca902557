"""More families that only combine existing components: Qwen3.5 dense and MoE (Qwen3-Next's
layers with the Gated DeltaNet's projections apart).

Tiny random HF models with each mechanism on: logits equal transformers' on one device, greedy
tokens equal over 16, export then ``from_pretrained`` equal. Tolerance: 1e-4 on float32 logits,
as for every family. The sharded checks belong to each component, on the family that brought it.
"""

import os
import sys

import numpy as np
import pytest
import torch
from transformers import (
    AfmoeConfig,
    AutoModelForCausalLM,
    Cohere2MoeConfig,
    CwmConfig,
    ExaoneMoeConfig,
    GraniteMoeHybridConfig,
    GraniteMoeSWAConfig,
    HyperCLOVAXConfig,
    HYV3Config,
    IQuestCoderConfig,
    Jais2Config,
    Lfm2MoeConfig,
    MiniCPM3Config,
    MiniCPM5MoeConfig,
    MiniMaxM2Config,
    Param2MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    SarvamMLAConfig,
    YoutuConfig,
)

from shardzoo.models.hf import export_hf
from shardzoo.models.hf.registry import families_markdown
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402, F401  (test_*: the three proofs every family has, collected here on its built)
    TOKENS,
    TOL,
    apply,
    hf_logits,
    mamba_draw,
    near_one,
    one_device,
    randomize,
    randomized,
    saved,
    test_export_round_trip_loads_the_same_model,
    test_greedy_generate_matches_transformers,
    test_logits_match_on_one_device,
)

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
# a Gated DeltaNet layer (two key heads, each serving two value heads) then an output-gated attention one
GDN = dict(head_dim=8, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
           linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12)
GRANITE4 = dict(layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
                mamba_d_state=8, mamba_chunk_size=8, num_local_experts=4, num_experts_per_tok=2,
                shared_intermediate_size=16, embedding_multiplier=4.0, residual_multiplier=0.5,
                attention_multiplier=0.3, logits_scaling=2.5)


def gdn_draw(name, p):
    """Qwen3-Next's: the gated norm's scale near 1, the zero-centred norms near 0, the rest 0.1 x normal."""
    if name.endswith("linear_attn.norm.weight"):
        return 1 + 0.1 * torch.randn_like(p)
    return 0.1 * torch.randn_like(p)


CONFIGS = {
    "qwen3_5_text": lambda: Qwen3_5TextConfig(**DIMS, **GDN, attention_bias=True),
    # 4 experts top-2 (renormalised) and a gated shared expert in every layer
    "qwen3_5_moe_text": lambda: Qwen3_5MoeTextConfig(
        **{k: v for k, v in DIMS.items() if k != "intermediate_size"}, **GDN, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24),
    # conv, attention, conv layers; a dense layer then MoE (4 experts top-2, sigmoid scores with
    # their correction bias, scaled weights)
    "lfm2_moe": lambda: Lfm2MoeConfig(
        **(DIMS | dict(num_hidden_layers=3)), layer_types=["conv", "full_attention", "conv"], num_dense_layers=1,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, routed_scaling_factor=2.5),
    # the whole q and k projections normed, rotary on half of each head, 4 experts top-2 by sigmoid
    # scores with their correction bias
    "minimax_m2": lambda: MiniMaxM2Config(**DIMS, head_dim=16, rotary_dim=8, num_local_experts=4,
                                          num_experts_per_tok=2),
    # sliding, full (NoPE), sliding layers (a window of 4), qk-norm; a dense layer then MoE (4 groups
    # of 2 experts, 2 kept; a shared expert, scaled weights)
    "exaone_moe": lambda: ExaoneMoeConfig(
        **(DIMS | dict(num_hidden_layers=3)), sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    # mamba, attention (NoPE), mamba layers (chunks of 8 in a text of 16), each with 4 experts top-2
    # beside the shared MLP; Granite's multipliers
    "granitemoehybrid": lambda: GraniteMoeHybridConfig(**(DIMS | dict(num_hidden_layers=3)), **GRANITE4),
    # attention (rotary), mamba layers, no experts: the shared MLP is the dense one
    "granitemoehybrid_dense": lambda: GraniteMoeHybridConfig(
        **DIMS, **(GRANITE4 | dict(layer_types=["attention", "mamba"], num_local_experts=0,
                                   shared_intermediate_size=48, position_embedding_type="rope"))),
    # Cohere 2's parallel layers with RMSNorms: a dense full layer (rotating), then MoE layers (4
    # experts top-2 and a shared one added): sliding (rotary), full (NoPE)
    "cohere2_moe": lambda: Cohere2MoeConfig(
        **(DIMS | dict(num_hidden_layers=3)), head_dim=8, sliding_window=4, rms_norm_eps=1e-5, logit_scale=0.5,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], prefix_dense_intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, num_shared_experts=1, shared_expert_combination_strategy="sum"),
    # latent attention (q through its low rank), rotate-half rotary; MiniCPM's scales of the
    # embeddings, residual branches and logits
    "minicpm3": lambda: MiniCPM3Config(
        **(DIMS | dict(num_key_value_heads=4)), kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, scale_emb=4.0, scale_depth=0.8, dim_model_base=8,
        tie_word_embeddings=False),  # (tied, each token predicts itself)
    # Llama under its own model_type: q/k/v/o and MLP biases, head_dim apart from the width
    "iquestcoder": lambda: IQuestCoderConfig(**DIMS, head_dim=16, attention_bias=True, mlp_bias=True),
    # DeepSeek-V3 under its own model_type: latent attention (no query latent), a dense layer then
    # MoE (4 groups of 2 experts, 2 kept; a shared expert, scaled weights)
    "sarvam_mla": lambda: SarvamMLAConfig(
        **(DIMS | dict(num_hidden_layers=3, num_key_value_heads=4)), kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        n_group=4, topk_group=2),
    # GLM-4.5's MoE under its own model_type: full rotary, qk-norm, q/k/v biases; a dense layer then
    # MoE (4 groups of 2 experts, 2 kept; two shared experts, scaled weights)
    "param2moe": lambda: Param2MoeConfig(
        **(DIMS | dict(num_hidden_layers=3)), head_dim=8, attention_bias=True, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, n_group=4, topk_group=2, first_k_dense_replace=1,
        tie_word_embeddings=False),
    # DeepSeek-V3's latent attention (q through its low rank, interleaved rotary) in dense layers
    "youtu": lambda: YoutuConfig(
        **(DIMS | dict(num_key_value_heads=4)), kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, tie_word_embeddings=False),
    # full then sliding layers (a window of 4), llama3-scaled rotary
    "cwm": lambda: CwmConfig(**(DIMS | dict(num_hidden_layers=3, bos_token_id=1)), head_dim=8, sliding_window=4,
                             layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
    # Granite's multipliers with norms after attention and MLP too, logits multiplied
    "hyperclovax": lambda: HyperCLOVAXConfig(**DIMS, embedding_multiplier=4.0, residual_multiplier=0.5,
                                             attention_multiplier=0.3, logits_scaling=0.5, attention_bias=True),
    # LayerNorms with bias, q/k/v/o biases, a plain relu2 MLP with biases
    "jais2": lambda: Jais2Config(**DIMS, head_dim=8),
    # Granite-MoE-Shared's MLP (4 experts top-2, a shared one) under Granite-SWA's attention: sinks,
    # full then sliding layers (a window of 4), the middle layer NoPE
    "granitemoe_swa": lambda: GraniteMoeSWAConfig(
        **(DIMS | dict(num_hidden_layers=3)), num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=16,
        embedding_multiplier=4.0, residual_multiplier=0.5, sliding_window=4,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"], layer_rope_theta=[10000.0, 0, 10000.0]),
    # sandwich norms, qk-norm, gated attention output; sliding (rotary), full (NoPE), sliding layers;
    # embeddings scaled; a dense layer then MoE (4 experts top-2 by sigmoid scores with their
    # correction bias, scaled weights, a shared expert)
    "afmoe": lambda: AfmoeConfig(
        **(DIMS | dict(num_hidden_layers=3)), head_dim=8, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], mup_enabled=True, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1, num_dense_layers=1, route_scale=2.5),
    # q/k/v/o biases, qk-norm; a dense layer then MoE (4 experts top-2 by sigmoid scores with their
    # correction bias, scaled weights, a shared expert)
    "hy_v3": lambda: HYV3Config(**DIMS, head_dim=8, attention_bias=True, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=16, router_scaling_factor=2.5),
    # gated attention (q and gate per head in one projection) with q/k/v/o biases; a dense layer then
    # MoE (4 groups of 2 experts, 2 kept; a shared expert, scaled weights)
    "minicpm5_moe": lambda: MiniCPM5MoeConfig(
        **(DIMS | dict(num_hidden_layers=3)), head_dim=8, attention_bias=True, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, n_group=4, topk_group=2, routed_scaling_factor=2.5),
}
SEEDS = {"jais2": 5}  # else 0; each with a varied greedy continuation
DRAWS = {"qwen3_5_text": gdn_draw, "qwen3_5_moe_text": gdn_draw, "granitemoehybrid": mamba_draw,
         "granitemoehybrid_dense": mamba_draw,
         # LayerNorms with bias: their scales near 1, their biases small as every other weight
         "jais2": near_one(lambda name, p: "norm" in name and name.endswith("weight"))}


def router_bias(name, b):
    """A draw for ``randomize``'s buffers: a sigmoid router's correction bias, large enough to
    move the experts chosen."""
    return 0.3 * torch.randn_like(b) if name.endswith(("expert_bias", "e_score_correction_bias")) else None


BUFFERS = dict.fromkeys(("lfm2_moe", "minimax_m2", "exaone_moe", "sarvam_mla", "param2moe", "afmoe", "hy_v3", "minicpm5_moe"),
                         router_bias)
FORWARD = dict.fromkeys(("qwen3_5_text", "qwen3_5_moe_text"), dict(use_cache=False))


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    """(HF dir, HF model, reference logits): every weight random, norm scales near 1."""
    model = randomized(CONFIGS[request.param](), SEEDS.get(request.param, 0), DRAWS.get(request.param, near_one()),
                       BUFFERS.get(request.param))
    return saved(model, tmp_path_factory.mktemp(request.param), **FORWARD.get(request.param, {}))




def test_the_readme_lists_the_registry_families():
    """README's list of families is the registry's (``python -m shardzoo.models.hf --markdown``)."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    listed = readme.split("<!-- families: begin -->\n", 1)[1].split("<!-- families: end -->", 1)[0]
    assert listed == families_markdown()
    assert "- hybrid (" in listed and "`qwen3_5_text`" in listed and "`granitemoehybrid`" in listed


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_the_text_model_of_a_multimodal_qwen3_5_checkpoint(kind, tmp_path, capfd):
    """A tiny ``qwen3_5`` / ``qwen3_5_moe`` checkpoint (a one-block vision tower around the text
    model) imports as its text model, saying the vision tower is left out: its logits on text
    within 1e-4 of the conditional-generation model's (text positions: its multimodal rotary is
    plain rotary), and it exports as the text-only model_type, which transformers loads with
    those logits."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    text = CONFIGS[f"{kind}_text"]().to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, out_hidden_size=32,
                  num_position_embeddings=16)
    config = (Qwen3_5Config if kind == "qwen3_5" else Qwen3_5MoeConfig)(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    from transformers import AutoModelForImageTextToText

    model = randomize(AutoModelForImageTextToText.from_config(config, attn_implementation="eager").eval(), gdn_draw)
    assert type(model).__name__.endswith("ForConditionalGeneration")
    path, _, ref = saved(model, tmp_path / kind, use_cache=False)
    module, loaded, params = load_hf(path, mesh=one_device())
    assert "left out" in capfd.readouterr().err
    np.testing.assert_allclose(apply(module, params, one_device()), ref, atol=TOL, rtol=0)
    # the family the import records (a checkpoint of this model exports as it)
    assert export_hf(loaded, params, str(tmp_path / "text"), family=f"{kind}_text")["model_type"] == f"{kind}_text"
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "text", attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(back, use_cache=False), ref, atol=TOL, rtol=0)
