"""Granite and Granite-MoE: Llama's layout (Mixtral's MoE) with four multipliers.

``embedding_multiplier`` scales the embeddings, ``residual_multiplier`` each block's output
before it is added to the residual stream, ``attention_multiplier`` is the attention scale
(in place of 1/sqrt(head_dim)), and the logits are divided by ``logits_scaling``. Granite-MoE
stores every layer's experts in two stacked tensors (``input_linear``: gate | up rows,
``output_linear``) and its router as ``router.layer``; it routes as Mixtral does (softmax over
the top-k logits equals the renormalised top-k of the softmax).
"""

from __future__ import annotations

from shardzoo.models.arch import MOE
from shardzoo.models.hf import llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig, Weight
from shardzoo.models.moe_arch import NO_MOE

MULTIPLIERS = dict(embedding_multiplier=1.0, residual_multiplier=1.0, attention_multiplier=1.0,
                   logits_scaling=1.0)
SCHEMA = {k: v for k, v in llama.SCHEMA.items() if k != "pretraining_tp"} | MULTIPLIERS
MOE_SCHEMA = ({k: v for k, v in SCHEMA.items() if k != "mlp_bias"}
              | dict(num_local_experts=8, num_experts_per_tok=2, output_router_logits=False,
                     router_aux_loss_coef=0.001))


def from_hf(hf: HFConfig) -> dict:
    return llama.llama_from_hf(hf) | {k: hf.get(k) for k in MULTIPLIERS}


def to_hf(a) -> dict:
    return llama.llama_to_hf(a) | dict(
        embedding_multiplier=a.embedding_multiplier, residual_multiplier=a.residual_multiplier,
        attention_multiplier=a.attention_scale, logits_scaling=a.logits_scaling)


def moe_from_hf(hf: HFConfig) -> dict:
    bias = hf.get("attention_bias")
    return llama.rotary_fields(hf) | {k: hf.get(k) for k in MULTIPLIERS} | dict(
        attention_bias=bias, attention_out_bias=bias, num_local_experts=hf.get("num_local_experts"),
        num_experts_per_tok=hf.get("num_experts_per_tok"), router_aux_loss_coef=hf.get("router_aux_loss_coef"),
        norm_topk_prob=True)


def moe_to_hf(a) -> dict:
    m = a.moe or NO_MOE
    out = to_hf(a) | dict(num_local_experts=m.num_local_experts, num_experts_per_tok=m.num_experts_per_tok,
                          router_aux_loss_coef=m.router_aux_loss_coef)
    del out["mlp_bias"]
    return out


def moe_layer_weights(a, spec) -> list[Weight]:
    """Every layer MoE: the experts stacked ``[expert, out, in]`` in two tensors."""
    if spec.mlp != MOE:
        return llama.layer_weights(a, spec)
    e, x = a.moe.num_local_experts, llama.LAYER + "block_sparse_moe."
    experts = dict(op="linear", experts=e, stacked_experts=True)
    return llama.attention_weights(a) + [
        Weight(("moe", "router", "kernel"), x + "router.layer.weight", "linear"),
        Weight(("moe", "wi_gate"), x + "input_linear.weight", part=(0, 2), **experts),
        Weight(("moe", "wi_up"), x + "input_linear.weight", part=(1, 2), **experts),
        Weight(("moe", "wo"), x + "output_linear.weight", **experts)]


# ibm-granite/granite-3.3-8b-instruct/config.json
GRANITE_33_8B = dict(vocab_size=49159, hidden_size=4096, intermediate_size=12800, num_hidden_layers=40,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                     rms_norm_eps=1e-5, rope_theta=10000000.0, tie_word_embeddings=True,
                     embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                     logits_scaling=16.0, bos_token_id=0, eos_token_id=0)
# multipliers far from 1, so a family that drops one gives other numbers
TINY = llama.TINY | dict(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.3,
                         logits_scaling=2.5)
GRANITE = Family(
    "granite", ("granite",), "GraniteForCausalLM", SCHEMA, llama.LLAMA_FEATURES | {"multipliers"},
    from_hf, to_hf, llama.global_weights, llama.layer_weights,
    presets={"granite-3.3-8b": GRANITE_33_8B, "granite-tiny": TINY})
GRANITE_MOE = Family(
    "granitemoe", ("granitemoe",), "GraniteMoeForCausalLM", MOE_SCHEMA,
    llama.ROTARY | {"attention_bias", "attention_out_bias", "multipliers", "moe"},
    moe_from_hf, moe_to_hf, llama.global_weights, moe_layer_weights, execution=mixtral.HF_MOE,
    presets={"granite-moe-tiny": TINY | dict(num_local_experts=4, num_experts_per_tok=2,
                                             router_z_loss_coef=0.0)})
