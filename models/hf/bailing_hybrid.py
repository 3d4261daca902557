"""Ling 3 hybrid (``bailing_hybrid``): Kimi delta attention layers beside multi-head latent
attention with a gate per head, DeepSeek-V3's MoE.

Layers by ``layer_types`` (transformers' default: the last of every ``layer_group_size`` attends,
the others "linear_attention"). A linear layer is KDA (``models/kimi_delta.py``) of
``num_attention_heads`` heads of ``head_dim`` (transformers' ``linear_num_heads``,
``linear_head_dim``) with Ling's full-rank decay and output-gate projections (``f_proj``,
``g_proj``) and, with ``kda_safe_gate``, the bounded log decay ``kda_lower_bound * sigmoid(...)``.
An attention layer is DeepSeek-V3's latent attention (interleaved rotary) whose output is gated per
head by ``sigmoid(g_proj(x))`` (``attn_head_gate``). MLPs by ``mlp_layer_types`` (dense for the
first ``first_k_dense_replace``, then sparse): DeepSeek-V3's router (sigmoid scores, correction
bias, groups, scaled weights) with a shared expert of ``num_shared_experts`` x the experts' width.
The experts' SwiGLU clipping (``expert_swiglu_limit_list``) is refused unless every limit is 0.
The multi-token-prediction layers are not the causal LM's (``num_nextn_predict_layers``).
"""

from __future__ import annotations

from shardzoo.models.arch import DENSE, FULL, MOE
from shardzoo.models.hf import deepseek_v2, llama, mixtral
from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, renamed, rope, special_tokens
from shardzoo.models.kimi_delta import KIMI, KimiDelta
from shardzoo.models.moe_arch import NO_MOE

HF_LINEAR = "linear_attention"
# BailingHybridConfig's fields and transformers' defaults (inclusionAI/Ling-3.0-Flash), as config.json
# spells them (its attribute_map's names)
SCHEMA = dict(vocab_size=157184, hidden_size=2560, intermediate_size=6144, moe_intermediate_size=768,
              num_hidden_layers=42, num_attention_heads=32, num_key_value_heads=32, num_shared_experts=1,
              output_router_logits=False, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=None,
              qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, num_expert_group=8, topk_group=4,
              num_experts_per_token=8, first_k_dense_replace=2, moe_renormalize=True, hidden_act="silu",
              model_max_length=262144, initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
              pad_token_id=156892, bos_token_id=None, eos_token_id=156895, pretraining_tp=1,
              tie_word_embeddings=False, rope_parameters=None, attention_bias=False, attention_dropout=0.0,
              num_nextn_predict_layers=1, num_experts=512, rope_theta=6000000.0, head_dim=128,
              short_conv_kernel_size=4, layer_group_size=6, kda_safe_gate=True, kda_lower_bound=-5.0,
              layer_types=None, mlp_layer_types=None, expert_swiglu_limit_list=None,
              share_expert_swiglu_limit_list=None, mtp_loss_scaling_factor=0.0, linear_head_dim=None,
              linear_num_heads=None, linear_conv_kernel_dim=None, qk_head_dim=None)
ALIASES = dict(max_position_embeddings="model_max_length", norm_topk_prob="moe_renormalize",
               n_group="num_expert_group", num_local_experts="num_experts", num_experts_per_tok="num_experts_per_token",
               n_shared_experts="num_shared_experts", num_mtp_layers="num_nextn_predict_layers",
               swiglu_limits="expert_swiglu_limit_list", swiglu_limits_shared="share_expert_swiglu_limit_list")
FEATURES = llama.ROTARY | {"latent_attention", "rope_interleaved", "moe", "moe_pattern", "expert_width",
                           "shared_experts", "routed_scaling", "sigmoid_router", "layer_pattern", "kimi_delta",
                           "kda_full_rank_gate", "kda_gate_lower_bound", "attention_head_gate"}


def _kda(hf: HFConfig) -> KimiDelta:
    """transformers' linear_* (written beside the fields they come from), else those fields."""
    hf.ignore("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim")
    raw = hf.raw
    return KimiDelta(num_heads=raw.get("linear_num_heads") or hf.get("num_attention_heads"),
                     head_dim=raw.get("linear_head_dim") or hf.get("head_dim"),
                     conv_kernel=raw.get("linear_conv_kernel_dim") or hf.get("short_conv_kernel_size"),
                     full_rank_gate=True, gate_lower_bound=hf.get("kda_lower_bound") if hf.get("kda_safe_gate") else None)


def from_hf(hf: HFConfig) -> dict:
    hf.unalias(ALIASES)
    hf.require("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank")
    hf.ignore(*INERT, "num_nextn_predict_layers", "mtp_loss_scaling_factor", "qk_head_dim", "rope_theta")
    n, heads = hf.get("num_hidden_layers"), hf.get("num_attention_heads")
    for key, ok, why in (
            ("hidden_act", hf.get("hidden_act") == "silu", "KDA's convolution and the MLPs use it; shardzoo reads 'silu'"),
            ("attention_bias", not hf.get("attention_bias"), "shardzoo's latent attention has no biases"),
            ("num_key_value_heads", hf.get("num_key_value_heads") in (None, heads),
             f"latent attention expands keys and values for every query head (num_attention_heads={heads})")):
        if not ok:
            raise hf.refuse(key, why)
    for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        if any(hf.get(key) or ()):
            raise hf.refuse(key, "the experts' SwiGLU clipping is not implemented; shardzoo reads limits of 0")
    group = hf.get("layer_group_size")
    types = hf.get("layer_types") or [FULL if (i + 1) % group == 0 else HF_LINEAR for i in range(n)]
    if any(t not in (FULL, HF_LINEAR) for t in types):
        raise hf.refuse("layer_types", f"Ling's layers are {FULL!r} or {HF_LINEAR!r}")
    first = hf.get("first_k_dense_replace")
    mlps = hf.get("mlp_layer_types") or ["dense" if i < first else "sparse" for i in range(n)]
    if any(m not in ("dense", "sparse") for m in mlps):
        raise hf.refuse("mlp_layer_types", "Ling's MLPs are 'dense' or 'sparse'")
    experts, width = hf.get("num_experts"), hf.get("moe_intermediate_size")
    out = rope(hf, theta=SCHEMA["rope_theta"])
    out.pop("partial_rotary_factor")
    hf.ignore("head_dim")
    return out | special_tokens(hf) | dict(
        vocab_size=hf.get("vocab_size"), hidden_size=hf.get("hidden_size"), num_hidden_layers=n,
        intermediate_size=hf.get("intermediate_size"), num_attention_heads=heads,
        max_position_embeddings=hf.get("model_max_length"), rms_norm_eps=hf.get("rms_norm_eps"),
        initializer_range=hf.get("initializer_range"), tie_word_embeddings=hf.get("tie_word_embeddings"),
        kv_lora_rank=hf.get("kv_lora_rank"), q_lora_rank=hf.get("q_lora_rank"),
        qk_nope_head_dim=hf.get("qk_nope_head_dim"), qk_rope_head_dim=hf.get("qk_rope_head_dim"),
        v_head_dim=hf.get("v_head_dim"), rope_interleaved=True, attn_head_gate=True,
        layer_types=tuple(KIMI if t == HF_LINEAR else FULL for t in types), kimi_delta=_kda(hf),
        mlp_layer_types=tuple(MOE if m == "sparse" else DENSE for m in mlps), num_local_experts=experts,
        num_experts_per_tok=hf.get("num_experts_per_token"), moe_intermediate_size=width,
        shared_expert_intermediate_size=(hf.get("num_shared_experts") or 0) * width, router_kind="sigmoid_groups",
        n_group=hf.get("num_expert_group") or 1, topk_group=hf.get("topk_group") or 1,
        norm_topk_prob=hf.get("moe_renormalize"), routed_scaling_factor=hf.get("routed_scaling_factor"),
        router_aux_loss_coef=0.0)


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    kda = a.kimi_delta or KimiDelta()
    specs = a.layer_specs()
    kinds = [s.mlp for s in specs]
    out = deepseek_v2.latent_to_hf(a)
    del out["max_position_embeddings"]  # config.json's model_max_length
    return out | dict(
        model_max_length=a.max_position_embeddings, head_dim=kda.head_dim, linear_head_dim=kda.head_dim,
        linear_num_heads=kda.num_heads, short_conv_kernel_size=kda.conv_kernel,
        kda_safe_gate=kda.gate_lower_bound is not None, kda_lower_bound=kda.gate_lower_bound or SCHEMA["kda_lower_bound"],
        layer_types=[HF_LINEAR if s.mixer == KIMI else FULL for s in specs],
        mlp_layer_types=["sparse" if kind == MOE else "dense" for kind in kinds],
        first_k_dense_replace=kinds.index(MOE) if MOE in kinds else len(kinds),
        num_experts=m.num_local_experts, num_experts_per_token=m.num_experts_per_tok,
        moe_intermediate_size=a.expert_size, num_shared_experts=m.shared_expert_intermediate_size // a.expert_size,
        num_expert_group=m.n_group, topk_group=m.topk_group, moe_renormalize=m.norm_topk_prob,
        routed_scaling_factor=m.routed_scaling_factor, rope_theta=a.rope_theta,
        # transformers' default padding id (156892) is past a smaller vocabulary, which its embedding refuses
        pad_token_id=SCHEMA["pad_token_id"] if a.vocab_size > SCHEMA["pad_token_id"] else None)


# --------------------------------------------------------------------------------- weights
def global_weights(a) -> list[Weight]:
    return renamed(llama.global_weights(a), (("model.embed_tokens.", "model.word_embeddings."),))


def kda_weights(a) -> list[Weight]:
    """A KDA layer's tensors under ``attention.``: q, k, v, b, f, g projections, the three
    convolutions, A_log, dt_bias (flat), the gated norm, ``dense`` (the output)."""
    x = llama.LAYER + "attention."
    out = [Weight(("linear_attn", n, "kernel"), x + f"{n}_proj.weight", "linear") for n in "qkvbfg"]
    out += [Weight(("linear_attn", f"conv_{n}"), x + f"{n}_conv1d.weight", "depthwise") for n in "qkv"]
    return out + [Weight(("linear_attn", "A_log"), x + "A_log"), Weight(("linear_attn", "dt_bias"), x + "dt_bias", "vec"),
                  Weight(("linear_attn", "norm"), x + "o_norm.weight"),
                  Weight(("linear_attn", "out", "kernel"), x + "dense.weight", "linear", n_in=2)]


def layer_weights(a, spec) -> list[Weight]:
    if spec.mixer == KIMI:
        out = [Weight(("attn_norm", "scale"), llama.LAYER + "input_layernorm.weight"),
               Weight(("mlp_norm", "scale"), llama.LAYER + "post_attention_layernorm.weight")] + kda_weights(a)
    else:
        out = renamed(deepseek_v2.latent_attention_weights(a), (("self_attn.o_proj", "attention.dense"),
                                                                ("self_attn.", "attention.")))
        out.append(Weight(("attn", "head_gate", "kernel"), llama.LAYER + "attention.g_proj.weight", "linear"))
    if spec.mlp != MOE:
        return out + llama.mlp_weights(a)
    out += mixtral.moe_weights(a, "mlp.", ("gate_proj", "up_proj", "down_proj"))
    out += [Weight(("shared_expert", n, "kernel"), llama.LAYER + f"mlp.shared_experts.{n}_proj.weight", "linear")
            for n in ("gate", "up", "down")]
    return out + [Weight(("moe", "router_bias"), llama.LAYER + "mlp.gate.expert_bias")]


# --------------------------------------------------------------------------------- presets
# BailingHybridConfig's defaults (transformers: inclusionAI/Ling-3.0-Flash): 42 layers, 5 KDA : 1 MLA,
# 2 dense then 512 experts top-8 in 8 groups (4 kept) and one shared, 768 wide
FLASH = dict(
    vocab_size=157184, hidden_size=2560, intermediate_size=6144, num_hidden_layers=42, num_attention_heads=32,
    max_position_embeddings=262144, rms_norm_eps=1e-6, rope_theta=6000000.0, kv_lora_rank=512, q_lora_rank=None,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_interleaved=True, attn_head_gate=True,
    layer_types=tuple(FULL if (i + 1) % 6 == 0 else KIMI for i in range(42)),
    kimi_delta=KimiDelta(32, 128, 4, full_rank_gate=True, gate_lower_bound=-5.0),
    mlp_layer_types=(DENSE,) * 2 + (MOE,) * 40, num_local_experts=512, num_experts_per_tok=8,
    moe_intermediate_size=768, shared_expert_intermediate_size=768, router_kind="sigmoid_groups", n_group=8,
    topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, router_aux_loss_coef=0.0, router_z_loss_coef=0.0,
    bos_token_id=None, eos_token_id=156895)
BAILING_HYBRID = Family(
    "bailing_hybrid", ("bailing_hybrid",), "BailingHybridForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    global_weights, layer_weights, execution=mixtral.HF_MOE, presets={"ling-3.0-flash": FLASH})
