"""Lara Mini (translated's ``lara_mini``): Qwen3.5's Gated DeltaNet layers beside Qwen3's
attention (qk-norm, no output gate) on sliding layers, which rotate, and full layers, which do
not (NoPE); every norm plain RMSNorm (weight, not 1 + weight); a MoE MLP in every layer: a
float32 softmax router over ``num_experts`` (top-k renormalised when ``norm_topk_prob``) and a
shared expert added in full, without a gate. The layer pattern is ``layer_types`` (transformers'
default: linear, sliding, linear, full, sliding, repeated).

On disk the Gated DeltaNet's input projections are one ``in_proj`` (rows q | k | v | z | b | a)
and its gated norm ``out_norm``; the experts are stacked (``gate_up_proj`` [expert, 2 x width,
hidden], ``down_proj`` [expert, hidden, width]).
"""

from __future__ import annotations

from shardzoo.models.arch import FULL, LINEAR, MOE, SLIDING
from shardzoo.models.hf import llama, mixtral, qwen3_next
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    Weight,
    layer_types,
    rope,
    rope_parameters_to_hf,
    sizes,
    sizes_to_hf,
)
from shardzoo.models.moe_arch import NO_MOE

# LaraMiniConfig's fields and defaults (transformers 5.25; no intermediate_size, listed so that it
# reads as None: every layer is MoE)
SCHEMA = dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=34, num_attention_heads=16, num_key_value_heads=4,
              hidden_act="silu", max_position_embeddings=131072, initializer_range=0.02, rms_norm_eps=1e-6,
              use_cache=True, tie_word_embeddings=True, rope_parameters=None, attention_bias=False,
              attention_dropout=0.0, head_dim=128, linear_conv_kernel_dim=4, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16, moe_intermediate_size=512,
              shared_expert_intermediate_size=512, num_experts_per_tok=4, num_experts=128, norm_topk_prob=True,
              output_router_logits=False, router_aux_loss_coef=0.001, pad_token_id=None, bos_token_id=None,
              eos_token_id=151643, sliding_window=512, layer_types=None, intermediate_size=None)
FEATURES = llama.ROTARY | {"qk_norm_head", "attention_bias", "attention_out_bias", "layer_pattern", "sliding_window",
                           "nope_layers", "moe", "shared_experts", "gated_deltanet"}
PATTERN = (LINEAR, SLIDING, LINEAR, FULL, SLIDING)  # LaraMiniConfig's period


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT, "intermediate_size")
    out = sizes(hf) | rope(hf)
    if out["hidden_act"] != "silu":
        raise hf.refuse("hidden_act", "the Gated DeltaNet's convolution is followed by SiLU; shardzoo reads 'silu'")
    n, window = out["num_hidden_layers"], hf.get("sliding_window")
    types = tuple(hf.get("layer_types") or (PATTERN[i % len(PATTERN)] for i in range(n)))
    if any(t not in (FULL, SLIDING, LINEAR) for t in types):
        raise hf.refuse("layer_types", f"Lara Mini's layers are {LINEAR!r}, {SLIDING!r} or {FULL!r}")
    bias = hf.get("attention_bias")
    width = hf.get("moe_intermediate_size")
    return out | {name: hf.get(name) for name in qwen3_next._LINEAR} | dict(
        intermediate_size=width, qk_norm="head", attention_bias=bias, attention_out_bias=bias, layer_types=types,
        sliding_window=window if SLIDING in types else None, rope_layers=tuple(t != FULL for t in types),
        num_local_experts=hf.get("num_experts"), num_experts_per_tok=hf.get("num_experts_per_tok"),
        moe_intermediate_size=width, norm_topk_prob=hf.get("norm_topk_prob"),
        router_aux_loss_coef=hf.get("router_aux_loss_coef"),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size"), mlp_layer_types=(MOE,) * n)


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    flat = a.linear_attention.flat() if a.linear_attention else SCHEMA
    linear = {n: flat[n] for n in qwen3_next._LINEAR}  # Qwen3-Next's five; OLMo hybrid's options are not Lara's
    out = sizes_to_hf(a) | linear | dict(
        rope_parameters=rope_parameters_to_hf(a, partial=a.partial_rotary_factor != 1.0),
        attention_bias=a.attention_bias, layer_types=layer_types(a), sliding_window=a.sliding_window,
        num_experts=m.num_local_experts, num_experts_per_tok=m.num_experts_per_tok, moe_intermediate_size=a.expert_size,
        shared_expert_intermediate_size=m.shared_expert_intermediate_size, norm_topk_prob=m.norm_topk_prob,
        router_aux_loss_coef=m.router_aux_loss_coef)
    del out["intermediate_size"]  # LaraMiniConfig has none
    return out


def layer_weights(a, spec) -> list[Weight]:
    """The norms; the Gated DeltaNet (``in_proj`` fused, ``out_norm``) or Qwen3's attention; the
    router, stacked experts and shared expert."""
    h, x = llama.LAYER, llama.LAYER + "mlp."
    out = [Weight(("attn_norm", "scale"), h + "input_layernorm.weight"),
           Weight(("mlp_norm", "scale"), h + "post_attention_layernorm.weight")]
    if spec.mixer == LINEAR:
        la = a.linear_attention
        keys, values = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
        widths = (keys, keys, values, values, la.num_value_heads, la.num_value_heads)
        out += [Weight(("linear_attn", n, "kernel"), h + "linear_attn.in_proj.weight", "linear", part=(j, 6),
                       widths=widths) for j, n in enumerate("qkvzba")]
        out += [w if w.name != h + "linear_attn.norm.weight" else Weight(w.path, h + "linear_attn.out_norm.weight")
                for w in qwen3_next.linear_attention_weights(a) if "in_proj" not in w.name]
    else:
        out += [w for w in llama.attention_weights(a) if w.path[0] == "attn"]
    stacked = dict(op="linear", experts=a.moe.num_local_experts, stacked_experts=True)
    out += [Weight(("moe", "router", "kernel"), x + "gate.weight", "linear"),
            Weight(("moe", "wi_gate"), x + "experts.gate_up_proj", part=(0, 2), **stacked),
            Weight(("moe", "wi_up"), x + "experts.gate_up_proj", part=(1, 2), **stacked),
            Weight(("moe", "wo"), x + "experts.down_proj", **stacked)]
    if a.moe.shared_expert_intermediate_size:
        out += [Weight(("shared_expert", n, "kernel"), x + f"shared_expert.{n}_proj.weight", "linear")
                for n in ("gate", "up", "down")]
    return out


LARA_MINI = Family(
    "lara_mini", ("lara_mini",), "LaraMiniForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={
        # linear, sliding (window 8, rotary), full (NoPE) layers; 4 experts top-2 and a shared one
        "lara-mini-tiny": llama.TINY | qwen3_next._GDN | dict(
            num_hidden_layers=3, head_dim=16, intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, layer_types=(LINEAR, SLIDING, FULL), sliding_window=8,
            rope_layers=(True, True, False), qk_norm="head", num_local_experts=4, num_experts_per_tok=2,
            shared_expert_intermediate_size=32, norm_topk_prob=True, router_aux_loss_coef=0.001,
            router_z_loss_coef=0.0, tie_word_embeddings=True),
    })
