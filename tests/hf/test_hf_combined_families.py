"""Families that only combine existing components: Helium (interleaved rotary, q/k/v and MLP
biases), VaultGemma (Gemma 2 with pre-norms only), Granite-MoE-Shared (Granite-MoE's multipliers
and experts with a fused shared expert), HunYuan-MoE (HunYuan's attention, softmax experts and a
shared one), dots.llm1 (Qwen3's attention with sliding layers, DeepSeek-V3's MoE), GLM-4.7-Flash
(DeepSeek-V3 with its MoE layers listed), GPT-J (Phi's parallel block, interleaved partial rotary),
Persimmon (Phi's attention, q|k|v fused per head, in a sequential block), EXAONE 3 (Llama under
other names), Solar Open (GLM-4.5's MoE in every layer under Llama's attention), InternLM3 (Llama
under its bias names), FlexOlmo (OLMoE with OLMo 2's post-norms), Sarvam-MoE
(GLM-4.5 under other names, q|k|v fused), Granite-SWA (Granite with sliding layers, sinks, NoPE layers).

Tiny random HF models with each mechanism on: logits equal transformers' on one device, greedy
tokens equal over 16, export then ``from_pretrained`` equal. Tolerance: 1e-4 on float32 logits,
as for every family. The sharded checks belong to each component, on the family that brought it.
"""

import os
import sys

import pytest
from transformers import (
    Dots1Config,
    ExaoneConfig,
    FlexOlmoConfig,
    Glm4MoeLiteConfig,
    GPTJConfig,
    GraniteMoeSharedConfig,
    GraniteSWAConfig,
    HeliumConfig,
    HunYuanMoEV1Config,
    InternLM3Config,
    PersimmonConfig,
    SarvamMoEConfig,
    SolarOpenConfig,
    VaultGemmaConfig,
)

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402, F401  (test_*: the three proofs every family has, collected here on its built)
    TOKENS,
    TOL,
    apply,
    correction_bias,
    near_one,
    one_device,
    randomized,
    saved,
    test_export_round_trip_loads_the_same_model,
    test_greedy_generate_matches_transformers,
    test_logits_match_on_one_device,
)

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
CONFIGS = {
    "helium": lambda: HeliumConfig(**DIMS, head_dim=8, attention_bias=True, mlp_bias=True),
    # a sliding then a global layer, a window of 4 in a text of 16, caps that clip
    "vaultgemma": lambda: VaultGemmaConfig(**DIMS, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
                                           attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "granitemoeshared": lambda: GraniteMoeSharedConfig(
        **DIMS, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=16, embedding_multiplier=4.0,
        residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.5),
    # qk-norm after the rotation, q/k/v/o biases, 4 experts top-2 and a shared expert in every layer
    "hunyuan_v1_moe": lambda: HunYuanMoEV1Config(**DIMS, head_dim=8, num_experts=4, moe_topk=2, attention_bias=True),
    # qk-norm, a dense layer then MoE (4 groups of 2 experts, 2 kept; a shared expert, scaled weights),
    # full then sliding layers (a window of 4)
    "dots1": lambda: Dots1Config(**(DIMS | dict(num_hidden_layers=3)), n_routed_experts=8, num_experts_per_tok=2,
                                 moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
                                 topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, sliding_window=4,
                                 max_window_layers=1),
    # latent attention (q through its low rank), MoE, dense, MoE layers
    "glm4_moe_lite": lambda: Glm4MoeLiteConfig(
        **(DIMS | dict(num_hidden_layers=3, num_key_value_heads=4)), kv_lora_rank=16, q_lora_rank=24,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, n_group=4, topk_group=2, mlp_layer_types=["sparse", "dense", "sparse"]),
    # parallel attention and MLP, interleaved rotary on half of each head, a biased head
    "gptj": lambda: GPTJConfig(vocab_size=128, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, bos_token_id=None,
                               eos_token_id=None),
    # q|k|v fused per head, LayerNorms of each query and key head, rotary on half of each head, relu2
    "persimmon": lambda: PersimmonConfig(**{k: v for k, v in DIMS.items() if k != "num_key_value_heads"}),
    # Llama under GPT-2-like names, q/k/v/o and MLP biases
    "exaone": lambda: ExaoneConfig(**DIMS, attention_bias=True, mlp_bias=True),
    # q/k/v biases, MoE in every layer (4 groups of 2 experts, 2 kept; a shared expert, scaled weights)
    "solar_open": lambda: SolarOpenConfig(
        **{k: v for k, v in DIMS.items() if k != "intermediate_size"}, head_dim=8, attention_bias=True,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_group=4, topk_group=2,
        routed_scaling_factor=2.5),
    # Llama with q/k/v/o and MLP biases, head_dim apart from the width
    "internlm3": lambda: InternLM3Config(**DIMS, head_dim=16, attention_bias=True, mlp_bias=True),
    # OLMoE's experts (4, top-2, renormalised) and qk-norm with OLMo 2's post-norms, q/k/v/o biases
    "flex_olmo": lambda: FlexOlmoConfig(**DIMS, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                        attention_bias=True),
    # GLM-4.5's model with q|k|v fused (GQA), q/k/v biases, full rotary: a dense layer, then MoE
    "sarvam_moe": lambda: SarvamMoEConfig(
        **(DIMS | dict(num_hidden_layers=3)), head_dim=8, attention_bias=True, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, n_group=4, topk_group=2),
    # sinks, full then sliding layers (a window of 4), the middle layer NoPE; the attention scale
    # attention_multiplier (1: not 1/sqrt(head_dim); the other multipliers are Granite's, tested there)
    "granite_swa": lambda: GraniteSWAConfig(
        **(DIMS | dict(num_hidden_layers=3)), sliding_window=4, layer_types=["full_attention", "sliding_attention",
                                                                             "sliding_attention"],
        layer_rope_theta=[10000.0, 0, 10000.0]),
}
SEEDS = {"flex_olmo": 4, "granite_swa": 2}  # else 0; each with a varied greedy continuation
# GPT-2's names: its LayerNorm scales near 1 (ln_1, ln_f)
DRAWS = {"gptj": near_one(lambda name, p: "ln_" in name and name.endswith("weight"))}
BUFFERS = dict.fromkeys(("dots1", "glm4_moe_lite", "solar_open", "sarvam_moe"), correction_bias)  # the routers' correction bias


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    """(HF dir, HF model, reference logits): every weight random, norm scales near 1."""
    model = randomized(CONFIGS[request.param](), SEEDS.get(request.param, 0), DRAWS.get(request.param, near_one()),
                       BUFFERS.get(request.param))
    return saved(model, tmp_path_factory.mktemp(request.param))
