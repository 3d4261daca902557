"""Mellum (JetBrains, ``mellum``): Qwen3-MoE's attention (qk-norm, one bias flag) and MoE (a
softmax router, top-k, renormalised when ``norm_topk_prob``; the experts as Qwen3-MoE stores
them) with per-layer patterns: ``layer_types`` (sliding layers of ``sliding_window``) and
``mlp_layer_types`` ("dense" MLPs ``intermediate_size`` wide, "sparse" MoE). Its rotary is per
layer kind (``rope_parameters`` keyed ``full_attention`` / ``sliding_attention``): the full
layers' base and scaling, the sliding layers' own base, unscaled (shardzoo's
``rope_local_base_freq``); both kinds rotate the same fraction of each head. The
multi-token-prediction layer (``num_nextn_predict_layers``, tensors under ``mtp.``) is not part
of the causal LM transformers builds: shardzoo reads neither."""

from __future__ import annotations

from shardzoo.models.arch import DENSE, FULL, MOE, SLIDING
from shardzoo.models.hf import llama, mixtral, qwen3_moe
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    HFError,
    layer_types,
    rope,
    sizes,
    sizes_to_hf,
)
from shardzoo.models.moe_arch import NO_MOE

DEFAULT_ROPE = {FULL: dict(rope_type="default", rope_theta=500000.0),
                SLIDING: dict(rope_type="default", rope_theta=10000.0)}
# MellumConfig's fields and defaults (transformers 5.25; num_experts and num_mtp_layers are its
# attribute_map's names of num_local_experts and num_nextn_predict_layers)
SCHEMA = dict(vocab_size=98304, hidden_size=2304, intermediate_size=7168, num_hidden_layers=28,
              num_attention_heads=32, num_key_value_heads=4, hidden_act="silu", max_position_embeddings=131072,
              initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, tie_word_embeddings=False,
              rope_parameters=None, attention_bias=False, sliding_window=1024, attention_dropout=0.0,
              moe_intermediate_size=896, num_experts_per_tok=8, num_local_experts=64, norm_topk_prob=True,
              output_router_logits=False, router_aux_loss_coef=0.001, pad_token_id=None, bos_token_id=None,
              eos_token_id=None, head_dim=128, layer_types=None, mlp_layer_types=None,
              num_nextn_predict_layers=None, mtp_layer_types=None, mtp_mlp_layer_types=None)
FEATURES = qwen3_moe.FEATURES | {"layer_pattern", "local_rope", "partial_rotary"}
MLP_KINDS = {"dense": DENSE, "sparse": MOE}


def per_kind_rope(hf: HFConfig, default: dict) -> dict:
    """The full layers' rotary base and scaling and the sliding layers' base from ``rope_parameters``
    keyed by layer kind (``default``: the family's, per kind); one rotated fraction for both."""
    params = hf.get("rope_parameters") or default
    full = rope(hf, dict(params.get(FULL) or default[FULL]), theta=default[FULL]["rope_theta"])
    local = rope(hf, dict(params.get(SLIDING) or default[SLIDING]), theta=default[SLIDING]["rope_theta"])
    if local["rope_scaling"]:
        raise HFError(f"{hf.where}: rope scaling of the {SLIDING} layers ({local['rope_scaling']['rope_type']}) "
                      "is not supported; only the full layers'")
    if local["partial_rotary_factor"] != full["partial_rotary_factor"]:
        raise HFError(f"{hf.where}: rope_parameters: partial_rotary_factor {full['partial_rotary_factor']} "
                      f"({FULL}) and {local['partial_rotary_factor']} ({SLIDING}) differ; shardzoo rotates one "
                      "fraction of each head on every layer")
    return full | dict(rope_local_base_freq=local["rope_theta"])


def per_kind_rope_to_hf(a, default: dict) -> dict:
    full = {"rope_type": "default", **a.rope_scaling_dict, "rope_theta": a.rope_theta}
    local = dict(rope_type="default", rope_theta=a.rope_local_base_freq or (
        a.rope_theta if a.has_sliding_layers else default[SLIDING]["rope_theta"]))
    if a.partial_rotary_factor != 1.0:
        full["partial_rotary_factor"] = local["partial_rotary_factor"] = a.partial_rotary_factor
    return {FULL: full, SLIDING: local}


def from_hf(hf: HFConfig) -> dict:
    hf.unalias({"num_experts": "num_local_experts", "num_mtp_layers": "num_nextn_predict_layers"})
    hf.ignore(*INERT, "num_nextn_predict_layers", "mtp_layer_types", "mtp_mlp_layer_types")
    n = hf.get("num_hidden_layers")
    kinds = hf.get("mlp_layer_types") or ["sparse"] * n
    if not isinstance(kinds, list) or len(kinds) != n or any(k not in MLP_KINDS for k in kinds):
        raise hf.refuse("mlp_layer_types", f"must name {n} layers, each dense or sparse")
    bias = hf.get("attention_bias")
    return sizes(hf) | per_kind_rope(hf, DEFAULT_ROPE) | llama.window_fields(hf, hf.get("sliding_window")) | dict(
        qk_norm="head", attention_bias=bias, attention_out_bias=bias,
        num_local_experts=hf.get("num_local_experts"), num_experts_per_tok=hf.get("num_experts_per_tok"),
        moe_intermediate_size=hf.get("moe_intermediate_size"), norm_topk_prob=hf.get("norm_topk_prob"),
        router_aux_loss_coef=hf.get("router_aux_loss_coef"), mlp_layer_types=tuple(MLP_KINDS[k] for k in kinds))


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    return sizes_to_hf(a) | dict(
        rope_parameters=per_kind_rope_to_hf(a, DEFAULT_ROPE), attention_bias=a.attention_bias,
        sliding_window=a.sliding_window, layer_types=layer_types(a),
        mlp_layer_types=["sparse" if s.mlp == MOE else "dense" for s in a.layer_specs()],
        num_local_experts=m.num_local_experts, num_experts_per_tok=m.num_experts_per_tok,
        moe_intermediate_size=a.expert_size, norm_topk_prob=m.norm_topk_prob,
        router_aux_loss_coef=m.router_aux_loss_coef)


# JetBrains/Mellum2-12B-A2.5B's config.json (as Mellum 2.1's copies state it): 64 experts top-8 on
# every layer, every 4th layer full (YaRN x16 over 8192), the others sliding by 1024 (base 500000, unscaled)
MELLUM2 = dict(vocab_size=98304, hidden_size=2304, intermediate_size=7168, num_hidden_layers=28,
               num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=131072,
               rms_norm_eps=1e-6, qk_norm="head", rope_theta=500000.0, rope_local_base_freq=500000.0,
               rope_scaling=dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=8192, beta_fast=32.0,
                                 beta_slow=1.0, attention_factor=1.2772588722239782),
               sliding_window=1024, layer_types=tuple(FULL if i % 4 == 3 else SLIDING for i in range(28)),
               num_local_experts=64, num_experts_per_tok=8, moe_intermediate_size=896, norm_topk_prob=True,
               router_aux_loss_coef=0.001, router_z_loss_coef=0.0, bos_token_id=0, eos_token_id=28)
MELLUM = Family(
    "mellum", ("mellum",), "MellumForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, qwen3_moe.layer_weights, execution=mixtral.HF_MOE,
    presets={
        "mellum2-12b-a2.5b": MELLUM2,
        # a sliding layer (window 8, its own base) with a dense MLP, then a full MoE layer
        "mellum-tiny": MELLUM2 | llama.TINY | dict(
            head_dim=16, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, sliding_window=8,
            rope_local_base_freq=10000.0, rope_scaling=None, layer_types=(SLIDING, FULL),
            mlp_layer_types=(DENSE, MOE)),
    })
