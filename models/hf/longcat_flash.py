"""LongCat-Flash: DeepSeek's latent attention in layers of two halves around a shortcut MoE
with zero-computation experts.

A config.json layer (``num_layers`` of them; transformers' ``num_hidden_layers`` is twice that)
is the ``shortcut_moe`` block form (``models/blocks.py``): two pre-norm halves, each latent
attention then a dense SwiGLU MLP ``ffn_hidden_size`` wide (``self_attn.j``, ``mlps.j``,
``input_layernorm.j``, ``post_attention_layernorm.j``), and the MoE of the first half's normed
MLP input added after the second. The attention always has a query latent; its queries are
times sqrt(hidden_size / q_lora_rank) and its normed kv latent times sqrt(hidden_size /
kv_lora_rank) (the latent record's ``lora_scaling``; transformers applies both whatever
``mla_scale_q_lora`` and ``mla_scale_kv_lora`` say), rotary on interleaved pairs.
The router (``mlp.router.classifier``) scores ``n_routed_experts`` + ``zero_expert_num``
experts with a softmax; the top ``moe_topk`` of the probabilities plus ``e_score_correction_bias``
(a buffer) are chosen, weighted by their probabilities times ``routed_scaling_factor``, never
renormalised (``softmax_bias``); a zero-computation expert returns its input times its weight
(``zero_expert_num``, ``models/moe_routing.py``). transformers builds no multi-token-prediction
layer (``model.mtp.*`` tensors are not read).
"""

from __future__ import annotations

import dataclasses

from shardzoo.models.hf import deepseek_v2, llama, mixtral
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    HFError,
    Weight,
    renamed,
    rope,
    special_tokens,
)

# LongcatFlashConfig's fields and defaults (transformers 5; router_bias read with getattr)
SCHEMA = dict(vocab_size=131072, hidden_size=6144, num_layers=28, num_attention_heads=64, num_key_value_heads=None,
              hidden_act="silu", max_position_embeddings=131072, initializer_range=0.02, rms_norm_eps=1e-5,
              use_cache=True, pad_token_id=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              rope_parameters=None, attention_bias=False, attention_dropout=0.0, ffn_hidden_size=12288,
              q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, head_dim=64,
              v_head_dim=128, qk_head_dim=None, moe_topk=12, n_routed_experts=512, output_router_logits=False,
              zero_expert_num=256, expert_ffn_hidden_size=2048, routed_scaling_factor=6.0, router_bias=False,
              num_hidden_layers=None)
FEATURES = llama.ROTARY | {"latent_attention", "latent_lora_scaling", "rope_interleaved", "moe", "expert_width",
                           "routed_scaling", "biased_softmax_router", "zero_experts", "shortcut_moe"}
# transformers' attribute_map: config.json files may spell these by their generic names
ALIASES = {"num_local_experts": "n_routed_experts", "num_experts_per_tok": "moe_topk",
           "intermediate_size": "ffn_hidden_size", "moe_intermediate_size": "expert_ffn_hidden_size"}


def from_hf(hf: HFConfig) -> dict:
    hf.unalias(ALIASES)
    hf.require("hidden_size", "num_layers", "num_attention_heads", "kv_lora_rank", "q_lora_rank")
    hf.ignore(*INERT)
    layers, heads = hf.get("num_layers"), hf.get("num_attention_heads")
    if hf.get("num_hidden_layers") not in (None, 2 * layers):
        raise hf.refuse("num_hidden_layers", f"transformers' LongCat-Flash has 2 x num_layers={layers} sub-layers")
    if hf.get("num_key_value_heads") not in (None, heads):
        raise hf.refuse("num_key_value_heads", f"latent attention expands keys and values for every query head "
                                               f"(num_attention_heads={heads})")
    nope, rot = hf.get("qk_nope_head_dim"), hf.get("qk_rope_head_dim")
    if hf.get("qk_head_dim") not in (None, nope + rot):
        raise hf.refuse("qk_head_dim", f"a query/key head is qk_nope_head_dim + qk_rope_head_dim = {nope + rot} wide")
    if hf.get("head_dim") not in (None, rot):  # the rotary embedding's width
        raise hf.refuse("head_dim", f"transformers' rotary embedding turns head_dim features: qk_rope_head_dim={rot}")
    if hf.get("router_bias"):
        raise hf.refuse("router_bias", "transformers' LongCat-Flash router holds a bias it never adds; shardzoo "
                                       "reads routers without one only")
    if not hf.get("n_routed_experts"):
        raise hf.refuse("n_routed_experts", "shardzoo reads LongCat-Flash with routed experts only")
    out = rope(hf, theta=10000000.0)
    out.pop("partial_rotary_factor")
    return out | special_tokens(hf) | dict(
        vocab_size=hf.get("vocab_size"), hidden_size=hf.get("hidden_size"), intermediate_size=hf.get("ffn_hidden_size"),
        num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=hf.get("max_position_embeddings"),
        rms_norm_eps=hf.get("rms_norm_eps"), initializer_range=hf.get("initializer_range"),
        hidden_act=hf.get("hidden_act"), tie_word_embeddings=hf.get("tie_word_embeddings"),
        attention_bias=hf.get("attention_bias"), kv_lora_rank=hf.get("kv_lora_rank"),
        q_lora_rank=hf.get("q_lora_rank"), qk_nope_head_dim=nope, qk_rope_head_dim=rot,
        v_head_dim=hf.get("v_head_dim"), lora_scaling=True, rope_interleaved=True, block_form="shortcut_moe",
        num_local_experts=hf.get("n_routed_experts"), num_experts_per_tok=hf.get("moe_topk"),
        moe_intermediate_size=hf.get("expert_ffn_hidden_size"), zero_expert_num=hf.get("zero_expert_num") or 0,
        routed_scaling_factor=hf.get("routed_scaling_factor"),
        router_kind="softmax_bias", norm_topk_prob=False, router_aux_loss_coef=0.0)


def to_hf(a) -> dict:
    m = a.moe
    fixed = dict(block_form="shortcut_moe", lora_scaling=True, rope_interleaved=True, router_kind="softmax_bias",
                 norm_topk_prob=False)
    have = dict(block_form=a.block_form, lora_scaling=bool(a.latent and a.latent.lora_scaling),
                rope_interleaved=a.rope_interleaved, router_kind=m and m.router_kind, norm_topk_prob=m and m.norm_topk_prob)
    if have != fixed:  # what transformers' LongCat-Flash always computes
        raise HFError(f"LongCat-Flash's config.json describes {fixed} only; this model has {have}")
    out = deepseek_v2.latent_to_hf(a)
    for key in ("intermediate_size", "num_hidden_layers"):
        out.pop(key)
    out.update(num_layers=a.num_hidden_layers, ffn_hidden_size=a.intermediate_size, n_routed_experts=m.num_local_experts,
               moe_topk=m.num_experts_per_tok, expert_ffn_hidden_size=a.expert_size, zero_expert_num=m.zero_expert_num,
               routed_scaling_factor=m.routed_scaling_factor, qk_head_dim=a.qk_head_size,
               head_dim=a.latent.qk_rope_head_dim)
    return out


# --------------------------------------------------------------------------------- weights
def _half(a, j: int) -> list[Weight]:
    """Half ``j`` of a layer: its norms, latent attention and dense MLP (``self_attn.j``, ``mlps.j``)."""
    names = (("self_attn.", f"self_attn.{j}."), ("input_layernorm.", f"input_layernorm.{j}."),
             ("post_attention_layernorm.", f"post_attention_layernorm.{j}."))
    weights = renamed(deepseek_v2.latent_attention_weights(a), names) + llama.mlp_weights(a, f"mlps.{j}.")
    return [dataclasses.replace(w, path=(f"half_{j}", *w.path)) for w in weights]


def layer_weights(a, spec) -> list[Weight]:
    """Both halves; the MoE's router (``mlp.router.classifier``, its correction bias) and experts
    (every layer's shortcut is a MoE: ``to_hf`` exports no other)."""
    experts = mixtral.moe_weights(a, "mlp.", ("gate_proj", "up_proj", "down_proj"), router="router.classifier")
    return _half(a, 0) + _half(a, 1) + experts + [Weight(("moe", "router_bias"), llama.LAYER + "mlp.router.e_score_correction_bias")]


# meituan-longcat/LongCat-Flash-Chat/config.json (as mirrored at mlx-community/LongCat-Flash-Chat-bf16): 28
# layers (56 halves), 512 experts 2048 wide and 256 zero-computation ones, top-12, weights x 6
CHAT = dict(vocab_size=131072, hidden_size=6144, intermediate_size=12288, num_hidden_layers=28, num_attention_heads=64,
            max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=10000000.0, kv_lora_rank=512,
            q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, lora_scaling=True,
            rope_interleaved=True, block_form="shortcut_moe", num_local_experts=512, num_experts_per_tok=12,
            moe_intermediate_size=2048, zero_expert_num=256, router_kind="softmax_bias", norm_topk_prob=False,
            routed_scaling_factor=6.0, router_aux_loss_coef=0.0, bos_token_id=1, eos_token_id=2,
            router_z_loss_coef=0.0)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, lora_scaling=True, rope_interleaved=True, block_form="shortcut_moe", rope_theta=10000000.0,
            num_local_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, zero_expert_num=4,
            router_kind="softmax_bias", norm_topk_prob=False, routed_scaling_factor=6.0, router_aux_loss_coef=0.0,
            rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, router_z_loss_coef=0.0)
LONGCAT_FLASH = Family(
    "longcat_flash", ("longcat_flash",), "LongcatFlashForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={"longcat-flash-chat": CHAT, "longcat-flash-tiny": TINY})
