"""DeepSeek-V2 (and V2-Lite): multi-head latent attention, and MoE layers of routed experts
beside ungated shared ones, after ``first_k_dense_replace`` dense layers.

Attention (the ``latent_attention`` feature): the query from x (``q_proj``) or from a
``q_lora_rank`` latent (``q_a_proj``, RMSNorm, ``q_b_proj``); ``kv_a_proj_with_mqa`` gives a
``kv_lora_rank`` latent and one ``qk_rope_head_dim`` rotary key for all heads (one tensor here
split in two leaves, ``kv_a`` and ``k_rope``); the latent, RMSNorm'd, expands per head into the
keys' ``qk_nope_head_dim`` features and the values (``kv_b_proj``). V2 rotates interleaved pairs
(complex multiplication: ``rope_interleave``). The latents' norms use RMSNorm's eps 1e-6, as
transformers builds them.

A MoE layer (layer i >= ``first_k_dense_replace``): a softmax router, top-k greedy or within
the ``topk_group`` best of ``n_group`` groups (``topk_method`` ``group_limited_greedy``: the
``softmax_groups`` router), weights times ``routed_scaling_factor`` and never renormalised
(transformers' DeepseekV2 reads no ``norm_topk_prob``), plus ``n_shared_experts`` shared experts
as one MLP ``n_shared_experts * moe_intermediate_size`` wide (``shared_experts``, no gate).
transformers 5 has no ``moe_layer_freq`` (the original code's; 1 in the published configs) and
ignores it, as shardzoo does. HF drops no token and has no z-loss (Mixtral's ``execution``);
the load-balancing loss takes the original config's ``aux_loss_alpha`` (0.001 when absent).
YaRN (``rope_scaling`` type yarn, the published configs' 160k context): the generic rotary
part (frequencies over ``qk_rope_head_dim``, cos/sin times ``attention_factor``) and, as every
latent-attention model, the softmax scale times ``mscale(factor, mscale_all_dim)**2``
(``TransformerArch.attention_scale``).
"""

from __future__ import annotations

from shardzoo.models.arch import DENSE, MOE
from shardzoo.models.hf import llama, mixtral
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    HFError,
    Weight,
    rope,
    rope_to_hf,
    special_tokens,
)
from shardzoo.models.moe_arch import NO_MOE

# DeepseekV2Config's fields and defaults (transformers 5)
SCHEMA = dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
              initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, pad_token_id=None, bos_token_id=1,
              eos_token_id=2, pretraining_tp=1, tie_word_embeddings=False, rope_parameters=None,
              attention_bias=False, attention_dropout=0.0, mlp_bias=False, head_dim=None,
              first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=1536, n_group=None, n_routed_experts=64,
              output_router_logits=False, n_shared_experts=2, qk_nope_head_dim=128, qk_rope_head_dim=64,
              routed_scaling_factor=1.0, topk_group=None, topk_method="greedy", norm_topk_prob=False,
              v_head_dim=128, num_experts_per_tok=None, moe_intermediate_size=1407)
FEATURES = llama.ROTARY | {"latent_attention", "rope_interleaved", "moe", "moe_pattern", "expert_width",
                           "shared_experts", "routed_scaling", "group_limited_router"}
METHODS = {"greedy": "softmax", "group_limited_greedy": "softmax_groups"}


def latent_fields(hf: HFConfig) -> dict:
    """Sizes, rotary and latent attention as both DeepSeek versions read them."""
    hf.require("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank")
    hf.ignore(*INERT)
    heads = hf.get("num_attention_heads")
    if hf.get("num_key_value_heads") not in (None, heads):
        raise hf.refuse("num_key_value_heads", f"latent attention expands keys and values for every query head "
                                               f"(num_attention_heads={heads})")
    if "head_dim" in hf.family.schema:
        hf.ignore("head_dim")  # transformers derives it: qk_rope_head_dim
    out = rope(hf)
    out.pop("partial_rotary_factor")
    return out | special_tokens(hf) | dict(
        vocab_size=hf.get("vocab_size"), hidden_size=hf.get("hidden_size"),
        intermediate_size=hf.get("intermediate_size"), num_hidden_layers=hf.get("num_hidden_layers"),
        num_attention_heads=heads, max_position_embeddings=hf.get("max_position_embeddings"),
        rms_norm_eps=hf.get("rms_norm_eps"), initializer_range=hf.get("initializer_range"),
        hidden_act=hf.get("hidden_act"), tie_word_embeddings=hf.get("tie_word_embeddings"),
        kv_lora_rank=hf.get("kv_lora_rank"), q_lora_rank=hf.get("q_lora_rank"),
        qk_nope_head_dim=hf.get("qk_nope_head_dim"), qk_rope_head_dim=hf.get("qk_rope_head_dim"),
        v_head_dim=hf.get("v_head_dim"))


def latent_to_hf(a) -> dict:
    if a.latent is None:  # an ordinary attention (a family choosing how to export says: not this one)
        raise HFError("DeepSeek's config.json describes latent attention only; this model has none")
    return rope_to_hf(a) | dict(
        hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, num_hidden_layers=a.num_hidden_layers,
        num_attention_heads=a.num_attention_heads, num_key_value_heads=a.num_attention_heads,
        max_position_embeddings=a.max_position_embeddings, rms_norm_eps=a.rms_norm_eps, hidden_act=a.hidden_act,
        **latent_flat(a))


def latent_flat(a) -> dict:
    """The latent record's config.json fields, LongCat-Flash's ``lora_scaling`` left to its family
    (its feature: any other family's export refuses it)."""
    return {k: v for k, v in a.latent.flat().items() if k != "lora_scaling"}


def moe_fields(hf: HFConfig) -> dict:
    """Experts, shared experts and the dense prefix, as both versions spell them."""
    n, first = hf.get("num_hidden_layers"), hf.get("first_k_dense_replace") or 0
    experts, width = hf.get("n_routed_experts"), hf.get("moe_intermediate_size")
    if not experts:
        raise hf.refuse("n_routed_experts", "shardzoo reads DeepSeek models with routed experts only")
    return dict(num_local_experts=experts, num_experts_per_tok=hf.get("num_experts_per_tok"),
                moe_intermediate_size=width, routed_scaling_factor=hf.get("routed_scaling_factor"),
                shared_expert_intermediate_size=(hf.get("n_shared_experts") or 0) * width,
                n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                mlp_layer_types=tuple(DENSE if i < first else MOE for i in range(n)))


def moe_to_hf(a) -> dict:
    m = a.moe or NO_MOE
    kinds = [s.mlp for s in a.layer_specs()]
    first = kinds.index(MOE) if MOE in kinds else len(kinds)
    return dict(n_routed_experts=m.num_local_experts, num_experts_per_tok=m.num_experts_per_tok,
                moe_intermediate_size=a.expert_size, routed_scaling_factor=m.routed_scaling_factor,
                n_shared_experts=m.shared_expert_intermediate_size // a.expert_size, first_k_dense_replace=first,
                n_group=m.n_group, topk_group=m.topk_group)


def from_hf(hf: HFConfig) -> dict:
    method = hf.get("topk_method")
    if method not in METHODS:
        raise hf.refuse("topk_method", f"transformers' DeepseekV2 routes by {' or '.join(METHODS)} only")
    hf.ignore("norm_topk_prob")  # transformers' DeepseekV2 never renormalises
    return latent_fields(hf) | moe_fields(hf) | dict(
        rope_interleaved=True, router_kind=METHODS[method], norm_topk_prob=False,
        router_aux_loss_coef=hf.get("aux_loss_alpha", 0.001))


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    method = {v: k for k, v in METHODS.items()}.get(m.router_kind, m.router_kind)
    out = latent_to_hf(a) | moe_to_hf(a) | dict(topk_method=method, norm_topk_prob=m.norm_topk_prob)
    if m.router_kind == "softmax":  # greedy: transformers' defaults, None
        out.update(n_group=None, topk_group=None)
    if m.router_aux_loss_coef != 0.001:  # the original code's field; absent means 0.001
        out["aux_loss_alpha"] = m.router_aux_loss_coef
    return out


# --------------------------------------------------------------------------------- weights
def latent_attention_weights(a) -> list[Weight]:
    """A layer's two norms and its latent attention (``kv_a_proj_with_mqa`` split in two leaves)."""
    h = llama.LAYER + "self_attn."
    out = [Weight(("attn_norm", "scale"), llama.LAYER + "input_layernorm.weight"),
           Weight(("mlp_norm", "scale"), llama.LAYER + "post_attention_layernorm.weight")]
    if a.latent.q_lora_rank:
        out += [Weight(("attn", "q_a", "kernel"), h + "q_a_proj.weight", "linear"),
                Weight(("attn", "q_a_norm", "scale"), h + "q_a_layernorm.weight"),
                Weight(("attn", "q_b", "kernel"), h + "q_b_proj.weight", "linear")]
    else:
        out.append(Weight(("attn", "q", "kernel"), h + "q_proj.weight", "linear"))
    widths = (a.latent.kv_lora_rank, a.latent.qk_rope_head_dim)
    return out + [
        Weight(("attn", "kv_a", "kernel"), h + "kv_a_proj_with_mqa.weight", "linear", part=(0, 2), widths=widths),
        Weight(("attn", "k_rope", "kernel"), h + "kv_a_proj_with_mqa.weight", "linear", part=(1, 2), widths=widths),
        Weight(("attn", "kv_a_norm", "scale"), h + "kv_a_layernorm.weight"),
        Weight(("attn", "kv_b", "kernel"), h + "kv_b_proj.weight", "linear"),
        Weight(("attn", "o", "kernel"), h + "o_proj.weight", "linear", n_in=2)]


def layer_weights(a, spec) -> list[Weight]:
    """Dense layers: Llama's MLP names; MoE layers: ``mlp.gate``, ``mlp.experts.E.*`` and
    ``mlp.shared_experts.*`` (and V3's ``mlp.gate.e_score_correction_bias``)."""
    if spec.mlp != MOE:
        return latent_attention_weights(a) + llama.mlp_weights(a)
    out = latent_attention_weights(a) + mixtral.moe_weights(a, "mlp.", ("gate_proj", "up_proj", "down_proj"))
    if a.moe.shared_expert_intermediate_size:
        out += [Weight(("shared_expert", n, "kernel"), llama.LAYER + f"mlp.shared_experts.{n}_proj.weight", "linear")
                for n in ("gate", "up", "down")]
    if a.moe.router_kind == "sigmoid_groups":
        out.append(Weight(("moe", "router_bias"), llama.LAYER + "mlp.gate.e_score_correction_bias"))
    return out


# deepseek-ai/DeepSeek-V2-Lite/config.json: 27 layers, the first dense, 64 experts top-6 and 2 shared, 1408
# wide; no query latent.
LITE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
            num_attention_heads=16, max_position_embeddings=163840, rms_norm_eps=1e-6,
            rope_scaling=dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                              beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707),
            kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            rope_interleaved=True, num_local_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
            shared_expert_intermediate_size=2 * 1408, norm_topk_prob=False, router_aux_loss_coef=0.001,
            mlp_layer_types=("dense",) + ("moe",) * 26, bos_token_id=100000, eos_token_id=100001,
            router_z_loss_coef=0.0)
# a dense layer, then two MoE layers (scanned), group-limited routing, a query latent
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=256, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, rope_interleaved=True, num_local_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=64, router_kind="softmax_groups", n_group=4,
            topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.0, router_aux_loss_coef=0.001,
            mlp_layer_types=("dense", "moe", "moe"), bos_token_id=None, eos_token_id=None, router_z_loss_coef=0.0)
DEEPSEEK_V2 = Family(
    "deepseek_v2", ("deepseek_v2",), "DeepseekV2ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={"deepseek-v2-lite": LITE, "deepseek-v2-tiny": TINY})
