"""AFMoE (Arcee's Trinity): norms before and after attention and MLP (Gemma 2's sandwich), GQA
with an RMSNorm of each query and key head and its output times the sigmoid of ``gate_proj``
(Qwen3-Next's output gate, its own tensor here), sliding and full layers by ``layer_types`` (by
default every ``global_attn_every_n_layers``-th full) with rotary embeddings on the sliding
layers only, embeddings times sqrt(hidden_size) when ``mup_enabled``; dense SwiGLU MLPs in the
first ``num_dense_layers`` layers, then MoE: sigmoid scores whose choice adds ``expert_bias``
(DeepSeek-V3's router, one group), renormalised, times ``route_scale``, beside
``num_shared_experts`` shared experts. ``attention_bias`` is refused (its gate has none).
"""

from __future__ import annotations

from shardzoo.models.arch import DENSE, FULL, MOE, SLIDING
from shardzoo.models.hf import glm4_moe, llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig, Weight, layer_types, renamed
from shardzoo.models.moe_arch import NO_MOE

# AfmoeConfig's fields and defaults (transformers 5.25)
SCHEMA = {k: v for k, v in llama.SCHEMA.items() if k not in ("pretraining_tp", "mlp_bias")} | dict(
    vocab_size=200192, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=1408, num_hidden_layers=32,
    num_dense_layers=1, num_attention_heads=16, num_key_value_heads=16, head_dim=128, max_position_embeddings=16384,
    rms_norm_eps=1e-5, num_experts=64, num_experts_per_tok=6, num_shared_experts=2, route_scale=1.0,
    output_router_logits=False, global_attn_every_n_layers=4, sliding_window=1024, mup_enabled=False,
    eos_token_id=None, bos_token_id=None, layer_types=None)
FEATURES = (llama.ROTARY - {"pre_norms"}) | {
    "sandwich_norms", "qk_norm_head", "attention_output_gate", "sliding_window", "layer_pattern", "nope_layers",
    "scale_embeddings", "moe", "moe_pattern", "expert_width", "shared_experts", "routed_scaling", "sigmoid_router"}


def from_hf(hf: HFConfig) -> dict:
    if hf.get("attention_bias"):
        raise hf.refuse("attention_bias", "AFMoE's output gate has no bias; shardzoo reads attention without biases")
    out = llama.rotary_fields(hf)
    n, every = out["num_hidden_layers"], hf.get("global_attn_every_n_layers")
    types = hf.get("layer_types") or [SLIDING if (i + 1) % every else FULL for i in range(n)]
    dense, width = hf.get("num_dense_layers"), hf.get("moe_intermediate_size")
    return out | dict(
        norm_position="both", qk_norm="head", attn_output_gate=True, sliding_window=hf.get("sliding_window"),
        layer_types=tuple(types), rope_layers=tuple(t == SLIDING for t in types),
        scale_embeddings=bool(hf.get("mup_enabled")), num_local_experts=hf.get("num_experts"),
        num_experts_per_tok=hf.get("num_experts_per_tok"), moe_intermediate_size=width,
        shared_expert_intermediate_size=hf.get("num_shared_experts") * width,
        routed_scaling_factor=hf.get("route_scale"), router_kind="sigmoid_groups", norm_topk_prob=True,
        router_aux_loss_coef=0.0, mlp_layer_types=tuple(DENSE if i < dense else MOE for i in range(n)))


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    kinds = [s.mlp for s in a.layer_specs()]
    return llama.rotary_to_hf(a) | dict(
        layer_types=layer_types(a), sliding_window=a.sliding_window, mup_enabled=a.scale_embeddings,
        num_dense_layers=kinds.index(MOE) if MOE in kinds else len(kinds), num_experts=m.num_local_experts,
        num_experts_per_tok=m.num_experts_per_tok, moe_intermediate_size=a.expert_size,
        num_shared_experts=m.shared_expert_intermediate_size // a.expert_size, route_scale=m.routed_scaling_factor)


# GLM-4.5's MoE tensors (models/hf/glm4_moe.py) -> AFMoE's
_NAMES = (("mlp.gate.e_score_correction_bias", "mlp.expert_bias"), ("mlp.gate.weight", "mlp.router.gate.weight"))


def layer_weights(a, spec) -> list[Weight]:
    h = llama.LAYER
    out = [Weight((slot, "scale"), h + f"{name}.weight") for slot, name in (
        ("attn_norm", "input_layernorm"), ("post_attn_norm", "post_attention_layernorm"),
        ("mlp_norm", "pre_mlp_layernorm"), ("post_mlp_norm", "post_mlp_layernorm"))]
    out += [w for w in llama.attention_weights(a) if w.path[0] == "attn"]
    out.append(Weight(("attn", "gate", "kernel"), h + "self_attn.gate_proj.weight", "linear"))
    if spec.mlp != MOE:
        return out + llama.mlp_weights(a)
    return out + renamed([w for w in glm4_moe.layer_weights(a, spec) if w.path[0] in ("moe", "shared_expert")],
                         _NAMES)


AFMOE = Family(
    "afmoe", ("afmoe",), "AfmoeForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, llama.global_weights, layer_weights,
    execution=mixtral.HF_MOE,
    presets={"afmoe-tiny": llama.TINY | dict(
        num_hidden_layers=4, head_dim=16, norm_position="both", qk_norm="head", attn_output_gate=True,
        sliding_window=8, layer_types=(SLIDING, SLIDING, SLIDING, FULL), rope_layers=(True, True, True, False),
        num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        router_kind="sigmoid_groups", router_aux_loss_coef=0.0, mlp_layer_types=(DENSE, MOE, MOE, MOE))})
