"""Qwen3.5 (``qwen3_5_text``, ``qwen3_5_moe_text``): Qwen3-Next's layers (models/hf/qwen3_next.py:
Gated DeltaNet beside output-gated attention, zero-centred norms, qk-norm, partial rotary) with the
Gated DeltaNet's input projections apart (``in_proj_qkv`` q | k | v whole, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``) rather than interleaved per key head. The dense model has a SwiGLU
MLP in every layer; the MoE one Qwen3-Next's MoE (softmax top-k, always renormalised, a shared
expert under its sigmoid gate) in every layer. Its rotary embedding is multimodal (``mrope_section``
in ``rope_parameters``); on text every section has the same positions, so it is plain rotary.
A multimodal ``qwen3_5``/``qwen3_5_moe`` checkpoint reads as its text model (models/hf/multimodal.py).
"""

from __future__ import annotations

from shardzoo.models.arch import FULL, LINEAR
from shardzoo.models.hf import mixtral, qwen3_next
from shardzoo.models.hf.base import Family, HFConfig, Weight
from shardzoo.models.moe_arch import NO_MOE

_NOT_TEXT = ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "num_experts", "num_experts_per_tok",
             "moe_intermediate_size", "shared_expert_intermediate_size", "router_aux_loss_coef",
             "output_router_logits")
# Qwen3_5TextConfig's fields and defaults (transformers 5.25): Qwen3NextConfig's but the MoE ones
SCHEMA = {k: v for k, v in qwen3_next.SCHEMA.items() if k not in _NOT_TEXT} | dict(
    vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_key_value_heads=4)
# Qwen3_5MoeTextConfig's: Qwen3NextConfig's without a dense width or a dense-layer pattern
MOE_SCHEMA = ({k: v for k, v in qwen3_next.SCHEMA.items()
               if k not in ("intermediate_size", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")}
              | dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_experts_per_tok=8, num_experts=256,
                     intermediate_size=None))  # (read for the dense width it lacks)
_MOE_ONLY = ("moe", "expert_width", "shared_experts", "shared_expert_gate", "moe_pattern")
FEATURES = qwen3_next.FEATURES - set(_MOE_ONLY)
MOE_FEATURES = qwen3_next.FEATURES - {"moe_pattern"}


def from_hf(hf: HFConfig) -> dict:
    return qwen3_next.hybrid_fields(hf)


def to_hf(a) -> dict:
    return qwen3_next.hybrid_to_hf(a)


def moe_from_hf(hf: HFConfig) -> dict:
    width = hf.get("moe_intermediate_size")
    if not hf.get("shared_expert_intermediate_size"):
        raise hf.refuse("shared_expert_intermediate_size", "a Qwen3.5 MoE layer without a shared expert still has "
                                                           "its gate; shardzoo reads only shared experts > 0")
    return qwen3_next.hybrid_fields(hf) | dict(
        intermediate_size=width, num_local_experts=hf.get("num_experts"),
        num_experts_per_tok=hf.get("num_experts_per_tok"), moe_intermediate_size=width, norm_topk_prob=True,
        router_aux_loss_coef=hf.get("router_aux_loss_coef"), shared_expert_gate=True,
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size"))


def moe_to_hf(a) -> dict:
    m = a.moe or NO_MOE
    out = qwen3_next.hybrid_to_hf(a) | dict(
        num_experts=m.num_local_experts, num_experts_per_tok=m.num_experts_per_tok, moe_intermediate_size=a.expert_size,
        shared_expert_intermediate_size=m.shared_expert_intermediate_size, router_aux_loss_coef=m.router_aux_loss_coef)
    del out["intermediate_size"]  # no dense layer: the width is the experts'
    return out


def layer_weights(a, spec) -> list[Weight]:
    """Qwen3-Next's, the Gated DeltaNet's projections under their own names."""
    out = qwen3_next.layer_weights(a, spec)
    if spec.mixer != LINEAR:
        return out
    x = qwen3_next.llama.LAYER + "linear_attn."
    la = a.linear_attention
    keys, values = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
    out = [w for w in out if "in_proj_" not in w.name]
    out += [Weight(("linear_attn", n, "kernel"), x + "in_proj_qkv.weight", "linear", part=(j, 3),
                   widths=(keys, keys, values)) for j, n in enumerate("qkv")]
    return out + [Weight(("linear_attn", n, "kernel"), x + f"in_proj_{n}.weight", "linear") for n in "zba"]


# Qwen/Qwen3.5-35B-A3B/config.json's text_config (Qwen3_5MoeTextConfig's defaults are this model's):
# 40 layers, 3 Gated DeltaNet to 1 attention, 256 experts top-8 and a shared one, 512 wide
QWEN3_5_35B = qwen3_next.BASE | qwen3_next._GDN | dict(
    vocab_size=248320, hidden_size=2048, intermediate_size=512, num_hidden_layers=40, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, max_position_embeddings=262144, rms_norm_eps=1e-6, rope_theta=10000000.0,
    layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 10, num_local_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, bos_token_id=None, eos_token_id=248044)
_TINY = {k: v for k, v in qwen3_next.QWEN3_NEXT.presets["qwen3-next-tiny"].items() if k != "mlp_layer_types"}
QWEN3_5 = Family(
    "qwen3_5_text", ("qwen3_5_text",), "Qwen3_5ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    qwen3_next.llama.global_weights, layer_weights,
    presets={"qwen3.5-tiny": {k: v for k, v in _TINY.items() if k not in (
        "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")}})
QWEN3_5_MOE = Family(
    "qwen3_5_moe_text", ("qwen3_5_moe_text",), "Qwen3_5MoeForCausalLM", MOE_SCHEMA, MOE_FEATURES, moe_from_hf, moe_to_hf,
    qwen3_next.llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={"qwen3.5-35b-a3b": QWEN3_5_35B, "qwen3.5-moe-tiny": _TINY | dict(intermediate_size=32)})
