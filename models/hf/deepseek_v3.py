"""DeepSeek-V3: DeepSeek-V2's latent attention, dense prefix and shared experts
(``models/hf/deepseek_v2.py``), with V3's router and rotary layout.

The router (``sigmoid_groups``): sigmoid scores; the choice adds ``e_score_correction_bias``
(a buffer in transformers, saved with the weights; ``moe/router_bias`` here, not counted as a
parameter, as transformers does not), ranks the ``n_group`` groups by the sum of their two best
scores, keeps the ``topk_group`` best groups and takes the top-k there; the weights are the
unbiased scores, renormalised with ``norm_topk_prob``, times ``routed_scaling_factor``.
Rotary on interleaved pairs with ``rope_interleave`` (the default), else rotate-half.
While training, the bias's auxiliary-loss-free update is the execution field
``router_bias_update_rate`` (off by default; DeepSeek-V3 trained with 0.001: ``train/step.py``'s
``balance_router_bias``), and there is no load-balancing loss (``router_aux_loss_coef`` 0). transformers builds no multi-token-prediction layer for
the causal LM (``num_nextn_predict_layers`` changes no logit); YaRN as in V2.
"""

from __future__ import annotations

from shardzoo.models.hf import deepseek_v2, llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig
from shardzoo.models.moe_arch import NO_MOE

# DeepseekV3Config's fields and defaults (transformers 5; num_mtp_layers as config.json spells it)
SCHEMA = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
              num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
              n_routed_experts=256, output_router_logits=False, routed_scaling_factor=2.5, kv_lora_rank=512,
              q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
              topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
              hidden_act="silu", max_position_embeddings=4096, initializer_range=0.02, rms_norm_eps=1e-6,
              use_cache=True, pad_token_id=None, bos_token_id=0, eos_token_id=1, pretraining_tp=1,
              tie_word_embeddings=False, rope_parameters=None, rope_interleave=True, attention_bias=False,
              attention_dropout=0.0, num_nextn_predict_layers=1)
FEATURES = llama.ROTARY | {"latent_attention", "rope_interleaved", "moe", "moe_pattern", "expert_width",
                           "shared_experts", "routed_scaling", "sigmoid_router"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore("num_nextn_predict_layers")
    return deepseek_v2.latent_fields(hf) | deepseek_v2.moe_fields(hf) | dict(
        rope_interleaved=bool(hf.get("rope_interleave")), router_kind="sigmoid_groups",
        norm_topk_prob=hf.get("norm_topk_prob"), router_aux_loss_coef=0.0)


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    return deepseek_v2.latent_to_hf(a) | deepseek_v2.moe_to_hf(a) | dict(
        rope_interleave=a.rope_interleaved, norm_topk_prob=m.norm_topk_prob)


# deepseek-ai/DeepSeek-V3/config.json: 61 layers,
# the first 3 dense, 256 experts top-8 in 8 groups (4 kept) and one shared, 2048 wide.
V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
          num_attention_heads=128, max_position_embeddings=163840, rms_norm_eps=1e-6, kv_lora_rank=512,
          rope_scaling=dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
          q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_interleaved=True,
          num_local_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
          shared_expert_intermediate_size=2048, router_kind="sigmoid_groups", n_group=8, topk_group=4,
          norm_topk_prob=True, routed_scaling_factor=2.5, router_aux_loss_coef=0.0,
          mlp_layer_types=("dense",) * 3 + ("moe",) * 58, bos_token_id=0, eos_token_id=1, router_z_loss_coef=0.0)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=256, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, rope_interleaved=True, num_local_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, router_kind="sigmoid_groups", n_group=4,
            topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, router_aux_loss_coef=0.0,
            mlp_layer_types=("dense", "moe", "moe"), bos_token_id=None, eos_token_id=None, router_z_loss_coef=0.0)
DEEPSEEK_V3 = Family(
    "deepseek_v3", ("deepseek_v3",), "DeepseekV3ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, deepseek_v2.layer_weights, execution=mixtral.HF_MOE,
    presets={"deepseek-v3": V3, "deepseek-v3-tiny": TINY})
