"""GPT-OSS (openai/gpt-oss-20b, -120b): Llama's layout with attention sinks, q/k/v/o biases,
sliding and full layers alternating (``layer_types``), YaRN, and a sparse MoE in every layer.

Attention: a learned logit per head (``self_attn.sinks``) joins the softmax's denominator
(``attention_sinks``). MoE: the router has a bias; it takes the top-k logits and a softmax over
those k (the same weights as a softmax over every expert renormalised over the k chosen:
``norm_topk_prob``). The experts have biases and a clamped SwiGLU (``swiglu_limit``,
``swiglu_alpha``); HF stores them stacked ``[expert, in, out]``, gate and up interleaved column
by column in ``gate_up_proj``. Published checkpoints keep the expert matrices in MXFP4
(``*_blocks``, ``*_scales``), which import dequantizes (``tensors.dequantize_mxfp4``); export
writes them in float. HF drops no token and has no router z-loss (the family's ``execution``).
"""

from __future__ import annotations

from shardzoo.models.arch import FULL, MOE, SLIDING
from shardzoo.models.hf import llama, mixtral
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    HFError,
    Weight,
    layer_types,
    rope,
    rope_to_hf,
    sizes,
)
from shardzoo.models.moe_arch import NO_MOE

# GptOssConfig's fields and defaults (transformers 5)
SCHEMA = dict(num_hidden_layers=36, num_local_experts=128, vocab_size=201088, hidden_size=2880,
              intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
              sliding_window=128, tie_word_embeddings=False, hidden_act="silu", initializer_range=0.02,
              max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=None, attention_dropout=0.0,
              num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0, router_aux_loss_coef=0.001,
              output_router_logits=False, use_cache=True, layer_types=None, pad_token_id=None,
              bos_token_id=None, eos_token_id=None, attention_bias=True)
FEATURES = llama.ROTARY | {"attention_bias", "attention_out_bias", "sliding_window", "layer_pattern",
                           "attention_sinks", "moe", "router_bias", "expert_bias", "clamped_swiglu"}
# GptOssConfig's rope_parameters when config.json has none
DEFAULT_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096)


def _default_types(n: int) -> tuple[str, ...]:
    """HF's default: even layers sliding, odd ones full."""
    return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(n))


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT)
    bias = hf.get("attention_bias")  # one flag for q/k/v/o
    n = hf.get("num_hidden_layers")
    params = dict(hf.get("rope_parameters", None) or {})
    if not params and "rope_scaling" not in hf:
        params = dict(DEFAULT_ROPE, rope_theta=params.get("rope_theta") or hf.get("rope_theta", None) or 150000.0)
    out = sizes(hf) | rope(hf, params, theta=150000.0)
    out.pop("partial_rotary_factor")
    window = hf.get("sliding_window")
    types = tuple(hf.get("layer_types") or _default_types(n))
    if SLIDING in types and not window:
        raise hf.refuse("sliding_window", f"layer_types has {SLIDING} layers but no window")
    limit = hf.get("swiglu_limit")
    if limit is None:
        raise hf.refuse("swiglu_limit", "GPT-OSS's experts clamp their SwiGLU; a number > 0 is needed")
    return out | dict(
        attention_bias=bias, attention_out_bias=bias, attention_sinks=True,
        sliding_window=window if SLIDING in types else None, layer_types=types,
        num_local_experts=hf.get("num_local_experts"), num_experts_per_tok=hf.get("num_experts_per_tok"),
        norm_topk_prob=True, router_aux_loss_coef=hf.get("router_aux_loss_coef"), router_bias=True,
        expert_bias=True, swiglu_limit=float(limit), swiglu_alpha=float(hf.get("swiglu_alpha")))


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    if not (a.attention_sinks and m.router_bias and m.expert_bias and m.swiglu_limit and m.norm_topk_prob
            and m.num_local_experts and a.attention_bias == a.attention_out_bias):
        raise HFError("GPT-OSS has attention sinks, one bias flag for q/k/v/o, a router with a bias, "
                      "renormalised top-k, experts with biases and a clamped SwiGLU in every layer")
    out = llama.sizes_to_hf(a) | rope_to_hf(a)
    out.pop("partial_rotary_factor", None)
    scaling = out.pop("rope_scaling")
    out["rope_parameters"] = dict(scaling or {"rope_type": "default"}, rope_theta=out.pop("rope_theta"))
    return out | dict(
        attention_bias=a.attention_bias, sliding_window=a.sliding_window, layer_types=layer_types(a),
        num_local_experts=m.num_local_experts, num_experts_per_tok=m.num_experts_per_tok,
        router_aux_loss_coef=m.router_aux_loss_coef, swiglu_limit=m.swiglu_limit, swiglu_alpha=m.swiglu_alpha)


def layer_weights(a, spec) -> list[Weight]:
    """Llama's attention (with biases) and the sinks; the router and the stacked experts."""
    h = llama.LAYER
    out = llama.attention_weights(a) + [Weight(("attn", "sinks"), h + "self_attn.sinks")]
    if spec.mlp != MOE:  # a dense layer only from an override: Llama's MLP names
        return out + llama.mlp_weights(a)
    e, x = a.moe.num_local_experts, h + "mlp."
    stacked = dict(experts=e, stacked_experts=True)
    gate_up = dict(stacked, interleaved=True)
    return out + [
        Weight(("moe", "router", "kernel"), x + "router.weight", "linear"),
        Weight(("moe", "router", "bias"), x + "router.bias", "vec"),
        Weight(("moe", "wi_gate"), x + "experts.gate_up_proj", part=(0, 2), **gate_up),
        Weight(("moe", "wi_up"), x + "experts.gate_up_proj", part=(1, 2), **gate_up),
        Weight(("moe", "wi_gate_bias"), x + "experts.gate_up_proj_bias", part=(0, 2), **gate_up),
        Weight(("moe", "wi_up_bias"), x + "experts.gate_up_proj_bias", part=(1, 2), **gate_up),
        Weight(("moe", "wo"), x + "experts.down_proj", **stacked),
        Weight(("moe", "wo_bias"), x + "experts.down_proj_bias", **stacked)]


# openai/gpt-oss-20b and -120b config.json: 64 heads of 64, 8 kv heads, window 128 on every other
# layer, YaRN x32 from 4096 untruncated, experts 2880 wide top-4, clamped SwiGLU at 7.
BASE = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64,
            num_key_value_heads=8, sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
            rope_theta=150000.0, rope_scaling=DEFAULT_ROPE, attention_bias=True, attention_out_bias=True,
            attention_sinks=True, num_experts_per_tok=4, norm_topk_prob=True, router_aux_loss_coef=0.9,
            router_bias=True, expert_bias=True, swiglu_limit=7.0, router_z_loss_coef=0.0,
            bos_token_id=None, eos_token_id=200002)
GPT_OSS = Family(
    "gpt_oss", ("gpt_oss",), "GptOssForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={
        "gpt-oss-20b": BASE | dict(num_hidden_layers=24, num_local_experts=32, layer_types=_default_types(24)),
        "gpt-oss-120b": BASE | dict(num_hidden_layers=36, num_local_experts=128, layer_types=_default_types(36)),
        # 4 layers: two scanned periods of sliding + full, as the published models scan
        "gpt-oss-tiny": BASE | llama.TINY | dict(num_hidden_layers=4, head_dim=16, sliding_window=8,
                                                 num_local_experts=4, num_experts_per_tok=2,
                                                 layer_types=_default_types(4),
                                                 rope_scaling=dict(DEFAULT_ROPE, original_max_position_embeddings=64)),
    })
