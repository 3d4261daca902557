"""dots.llm1 (``dots1``): Qwen3's attention (qk-norm of each head before the rotation, one
``attention_bias`` flag for q/k/v/o) with sliding layers where ``layer_types`` says (by default
the layers from ``max_window_layers`` on, when ``sliding_window`` is set), and DeepSeek-V3's MoE
after ``first_k_dense_replace`` dense layers, with GLM-4.5's tensors (models/hf/glm4_moe.py):
a sigmoid router with its correction bias and groups, ``routed_scaling_factor``,
``n_shared_experts`` shared ones.
"""

from __future__ import annotations

from shardzoo.models.arch import FULL, SLIDING
from shardzoo.models.hf import deepseek_v2, glm4_moe, llama, mixtral, qwen3
from shardzoo.models.hf.base import Family, HFConfig, layer_types
from shardzoo.models.moe_arch import NO_MOE

# Dots1Config's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=152064, hidden_size=4608, intermediate_size=10944, moe_intermediate_size=1408,
              num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=32, n_shared_experts=None,
              n_routed_experts=None, output_router_logits=False, n_group=1, topk_group=1, num_experts_per_tok=None,
              first_k_dense_replace=0, norm_topk_prob=False, hidden_act="silu", max_position_embeddings=2048,
              initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, tie_word_embeddings=False,
              rope_parameters=None, attention_bias=False, attention_dropout=0.0, routed_scaling_factor=1.0,
              sliding_window=4096, max_window_layers=62, layer_types=None, pad_token_id=None, bos_token_id=None,
              eos_token_id=None, head_dim=None)
FEATURES = qwen3.FEATURES | glm4_moe.FEATURES - {"partial_rotary"}


def _window(hf: HFConfig) -> dict:
    window, n, start = hf.get("sliding_window"), hf.get("num_hidden_layers"), hf.get("max_window_layers")
    types = hf.get("layer_types") or [SLIDING if window is not None and i >= start else FULL for i in range(n)]
    if window is None or SLIDING not in types:
        return dict(sliding_window=None, layer_types=None)
    return dict(sliding_window=window, layer_types=tuple(types))


def from_hf(hf: HFConfig) -> dict:
    bias = hf.get("attention_bias")
    return llama.rotary_fields(hf) | _window(hf) | deepseek_v2.moe_fields(hf) | dict(
        qk_norm="head", attention_bias=bias, attention_out_bias=bias, router_kind="sigmoid_groups",
        norm_topk_prob=hf.get("norm_topk_prob"), router_aux_loss_coef=0.0)


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    types = layer_types(a)
    return llama.rotary_to_hf(a) | deepseek_v2.moe_to_hf(a) | dict(
        attention_bias=a.attention_bias, norm_topk_prob=m.norm_topk_prob, sliding_window=a.sliding_window,
        layer_types=types, max_window_layers=types.index(SLIDING) if SLIDING in types else a.num_hidden_layers)


DOTS1 = Family(
    "dots1", ("dots1",), "Dots1ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, glm4_moe.layer_weights, execution=mixtral.HF_MOE,
    presets={"dots1-tiny": glm4_moe.TINY | dict(partial_rotary_factor=1.0, attention_bias=False)})
