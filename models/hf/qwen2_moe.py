"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (q/k/v biases) with MoE layers that add a gated
shared expert to the routed ones.

A MoE layer sums its top-k routed experts (``moe_intermediate_size`` wide; softmax router,
renormalised when ``norm_topk_prob``) and a dense gated MLP every token goes through
(``shared_expert``, ``shared_expert_intermediate_size`` wide), scaled per token by
``sigmoid(shared_expert_gate(x))``, a projection of the hidden state to one number (the
``shared_experts`` and ``shared_expert_gate`` features). Layer i is MoE unless it is in
``mlp_only_layers``, and where ``(i + 1) % decoder_sparse_step`` is 0, as Qwen3-MoE; the others
are dense MLPs of ``intermediate_size``. The window: HF's ``layer_types`` (older configs without
one: every other layer below ``max_window_layers``, from layer 0, with ``use_sliding_window``,
as ``Qwen2MoeConfig`` derives it). HF drops no token and has no router z-loss (the family's
``execution``, as Mixtral's).
"""

from __future__ import annotations

from shardzoo.models.arch import DENSE, FULL, MOE, SLIDING
from shardzoo.models.hf import llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig, Weight, layer_types
from shardzoo.models.moe_arch import NO_MOE

# Qwen2MoeConfig's fields and defaults (transformers 5)
SCHEMA = (llama.QWEN2_SCHEMA
          | dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=32768,
                 decoder_sparse_step=1, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                 num_experts_per_tok=4, num_experts=60, norm_topk_prob=False, output_router_logits=False,
                 router_aux_loss_coef=0.001, mlp_only_layers=None, qkv_bias=True))
FEATURES = llama.ROTARY | {"attention_bias", "sliding_window", "layer_pattern", "moe", "moe_pattern",
                           "expert_width", "shared_experts", "shared_expert_gate"}


def window(hf: HFConfig) -> dict:
    size, use = hf.get("sliding_window"), hf.get("use_sliding_window")
    size = size if use else None  # transformers sets it to 0 when off
    start = hf.get("max_window_layers")
    if size and hf.get("layer_types", None) is None:
        n = hf.get("num_hidden_layers")
        types = tuple(SLIDING if (i + 1) % 2 and i < start else FULL for i in range(n))
        return dict(sliding_window=size, layer_types=types if SLIDING in types else None)
    return llama.window_fields(hf, size or None)


def from_hf(hf: HFConfig) -> dict:
    n, step = hf.get("num_hidden_layers"), hf.get("decoder_sparse_step")
    dense = set(hf.get("mlp_only_layers") or ())
    experts = hf.get("num_experts", None) or hf.get("num_local_experts", None) or 0
    if experts and not hf.get("shared_expert_intermediate_size"):
        raise hf.refuse("shared_expert_intermediate_size", "a Qwen2-MoE layer without a shared expert still "
                                                           "has its gate; shardzoo reads only shared experts > 0")
    return llama.rotary_fields(hf) | window(hf) | dict(
        attention_bias=hf.get("qkv_bias"), num_local_experts=experts,
        num_experts_per_tok=hf.get("num_experts_per_tok"), moe_intermediate_size=hf.get("moe_intermediate_size"),
        norm_topk_prob=hf.get("norm_topk_prob"), router_aux_loss_coef=hf.get("router_aux_loss_coef"),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size"), shared_expert_gate=True,
        mlp_layer_types=tuple(MOE if experts and (i + 1) % step == 0 and i not in dense else DENSE
                              for i in range(n)))


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    kinds = a.layer_specs()
    out = llama.rotary_to_hf(a) | llama.qwen2_window_to_hf(a) | dict(
        qkv_bias=a.attention_bias, num_experts=m.num_local_experts, num_experts_per_tok=m.num_experts_per_tok,
        moe_intermediate_size=a.expert_size, shared_expert_intermediate_size=m.shared_expert_intermediate_size,
        decoder_sparse_step=1, mlp_only_layers=[i for i, s in enumerate(kinds) if s.mlp == DENSE],
        norm_topk_prob=m.norm_topk_prob, router_aux_loss_coef=m.router_aux_loss_coef)
    del out["head_dim"]  # Qwen2MoeConfig has none: hidden_size // num_attention_heads
    sliding = [i for i, t in enumerate(layer_types(a)) if t == SLIDING]
    if sliding:  # layer_types says which; this bound derives the same from every other layer
        out["max_window_layers"] = sliding[-1] + 1
    return out


def layer_weights(a, spec) -> list[Weight]:
    """Qwen2's dense layers; a MoE layer's router ``mlp.gate``, experts ``mlp.experts.E.*``,
    ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate`` (a (1, hidden) linear)."""
    if spec.mlp != MOE:
        return llama.layer_weights(a, spec)
    x = llama.LAYER + "mlp."
    shared = [Weight(("shared_expert", n, "kernel"), x + f"shared_expert.{n}_proj.weight", "linear")
              for n in ("gate", "up", "down")]
    shared.append(Weight(("shared_expert_gate", "kernel"), x + "shared_expert_gate.weight", "linear"))
    return (llama.attention_weights(a) + mixtral.moe_weights(a, "mlp.", ("gate_proj", "up_proj", "down_proj"))
            + shared)


# Qwen/Qwen1.5-MoE-A2.7B/config.json: 60 experts top-4 (1408 wide) and a shared expert 5632 wide
# in every layer, q/k/v biases, not renormalised, no sliding window.
BASE = dict(vocab_size=151936, rope_theta=1000000.0, attention_bias=True, num_local_experts=60,
            num_experts_per_tok=4, norm_topk_prob=False, router_aux_loss_coef=0.001, router_z_loss_coef=0.0,
            shared_expert_gate=True, bos_token_id=151643, eos_token_id=151643)
QWEN2_MOE = Family(
    "qwen2_moe", ("qwen2_moe",), "Qwen2MoeForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={
        "qwen1.5-moe-a2.7b": BASE | dict(hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                                         shared_expert_intermediate_size=5632, num_hidden_layers=24,
                                         num_attention_heads=16, max_position_embeddings=8192),
        # one dense layer (layer 0, as mlp_only_layers says) and one MoE layer with its shared expert
        "qwen2-moe-tiny": BASE | llama.TINY | dict(num_local_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                   norm_topk_prob=True, mlp_layer_types=("dense", "moe"),
                                                   bos_token_id=None, eos_token_id=None),
    })
