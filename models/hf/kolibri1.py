"""Kolibri 1 (Aleph Alpha, ``kolibri1``): EXAONE 4's attention (qk-norm of each head; sliding
layers by ``layer_types``, the full ones without rotary embeddings when there is a window) in
GLM-4's sandwich norms, and a MoE MLP in every layer: 384 experts of ``moe_intermediate_size``
(the model has no dense width), a shared expert (``shared_expert_intermediate_size``), and a
router that picks the top-k of its float32 logits plus a correction bias (``expert_bias``, a
buffer) and weighs them by the sigmoid of their logits, renormalised when ``norm_topk_prob``
(``router_kind`` "logit_bias"). HF drops no token and adds no load-balancing loss.

On disk (transformers' conversion mapping, reverted on save) the norms after attention and
MLP are ``post_attn_norm`` and ``post_ffn_norm``, the correction bias ``moe.router.expert_bias``.
"""

from __future__ import annotations

from shardzoo.models.arch import FULL, MOE, SLIDING
from shardzoo.models.hf import llama, mixtral
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    Weight,
    layer_types,
    rope,
    sizes,
    sizes_to_hf,
)
from shardzoo.models.moe_arch import NO_MOE

# Kolibri1Config's fields and defaults (transformers 5.25; num_experts is its attribute_map's
# name of num_local_experts); no intermediate_size (listed so that it reads as None): every layer is MoE
SCHEMA = dict(vocab_size=128000, hidden_size=2560, num_hidden_layers=50, num_attention_heads=48,
              num_key_value_heads=4, hidden_act="silu", max_position_embeddings=262144, initializer_range=0.02,
              rms_norm_eps=1e-6, use_cache=True, tie_word_embeddings=False, rope_parameters=None,
              sliding_window=513, attention_dropout=0.0, moe_intermediate_size=512, num_experts_per_tok=6,
              num_local_experts=384, norm_topk_prob=False, output_router_logits=False, pad_token_id=None,
              bos_token_id=None, eos_token_id=None, head_dim=128, shared_expert_intermediate_size=512,
              layer_types=None, intermediate_size=None)
FEATURES = (llama.ROTARY - {"pre_norms"}) | {
    "sandwich_norms", "qk_norm_head", "sliding_window", "layer_pattern", "nope_layers", "moe", "shared_experts",
    "biased_logit_router"}


def _default_types(n: int) -> list[str]:
    """Kolibri1Config's pattern: every 5th layer full, the others sliding."""
    return [FULL if (i + 1) % 5 == 0 else SLIDING for i in range(n)]


def from_hf(hf: HFConfig) -> dict:
    hf.unalias({"num_experts": "num_local_experts"})
    hf.ignore(*INERT)
    hf.ignore("intermediate_size")  # not Kolibri1Config's: no layer has a dense MLP
    out = sizes(hf) | dict(intermediate_size=hf.get("moe_intermediate_size"))
    window, n = hf.get("sliding_window"), hf.get("num_hidden_layers")
    types = tuple(hf.get("layer_types") or _default_types(n))
    rotary = rope(hf)
    rotary.pop("partial_rotary_factor")
    return out | rotary | dict(
        sliding_window=window, layer_types=types if window is not None else None,
        rope_layers=None if window is None else tuple(t != FULL for t in types), norm_position="both",
        qk_norm="head", num_local_experts=hf.get("num_local_experts"),
        num_experts_per_tok=hf.get("num_experts_per_tok"), moe_intermediate_size=hf.get("moe_intermediate_size"),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size"),
        norm_topk_prob=hf.get("norm_topk_prob"), router_kind="logit_bias", router_aux_loss_coef=0.0,
        mlp_layer_types=(MOE,) * n)


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    out = sizes_to_hf(a) | dict(
        rope_parameters={"rope_type": "default", **a.rope_scaling_dict, "rope_theta": a.rope_theta},
        sliding_window=a.sliding_window, layer_types=layer_types(a), num_local_experts=m.num_local_experts,
        num_experts_per_tok=m.num_experts_per_tok, moe_intermediate_size=a.expert_size,
        shared_expert_intermediate_size=m.shared_expert_intermediate_size, norm_topk_prob=m.norm_topk_prob)
    del out["intermediate_size"]  # Kolibri1Config has none
    return out


def layer_weights(a, spec) -> list[Weight]:
    """GLM-4's four norms (its post-norms under Kolibri's names), qk-norm, the router ``mlp.gate``
    and its correction bias, the experts ``mlp.experts.E.*`` and ``mlp.shared_experts.*``."""
    h = llama.LAYER
    norms = (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"),
             ("post_attn_norm", "post_attn_norm"), ("post_mlp_norm", "post_ffn_norm"))
    out = [Weight((norm, "scale"), h + f"{name}.weight") for norm, name in norms]
    out += [w for w in llama.attention_weights(a) if w.path[0] == "attn"]
    out += mixtral.moe_weights(a, "mlp.", ("gate_proj", "up_proj", "down_proj"))
    if a.moe.shared_expert_intermediate_size:
        out += [Weight(("shared_expert", n, "kernel"), h + f"mlp.shared_experts.{n}_proj.weight", "linear")
                for n in ("gate", "up", "down")]
    return out + [Weight(("moe", "router_bias"), h + "moe.router.expert_bias")]


KOLIBRI1 = Family(
    "kolibri1", ("kolibri1",), "Kolibri1ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={
        # Aleph-Alpha/Kolibri-1 (Kolibri1Config's defaults, as copies of its config.json state them):
        # 50 layers, every 5th full (NoPE) and the others sliding by 513; 384 experts top-6 and a shared one
        "kolibri1": dict(vocab_size=128000, hidden_size=2560, intermediate_size=512, num_hidden_layers=50,
                         num_attention_heads=48, num_key_value_heads=4, head_dim=128, max_position_embeddings=262144,
                         rms_norm_eps=1e-6, norm_position="both", qk_norm="head", sliding_window=513,
                         layer_types=tuple(_default_types(50)), rope_layers=tuple(t != FULL for t in _default_types(50)),
                         num_local_experts=384, num_experts_per_tok=6, shared_expert_intermediate_size=512,
                         norm_topk_prob=False, router_kind="logit_bias", router_aux_loss_coef=0.0,
                         router_z_loss_coef=0.0, bos_token_id=None, eos_token_id=None),
        # a sliding layer (window 8) then a full one without rotary; 4 experts top-2 and a shared one
        "kolibri1-tiny": llama.TINY | dict(
            intermediate_size=32, head_dim=16, norm_position="both", qk_norm="head", sliding_window=8,
            layer_types=(SLIDING, FULL), rope_layers=(True, False), num_local_experts=4, num_experts_per_tok=2,
            shared_expert_intermediate_size=32, router_kind="logit_bias", router_aux_loss_coef=0.0,
            router_z_loss_coef=0.0),
    })
