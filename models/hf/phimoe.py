"""Phi-MoE (Phi-3.5-MoE; ``phimoe``): Mixtral's layout with LayerNorms with bias, biases on q/k/v
and o (``attention_bias``), an output-head bias (``lm_head_bias``), and the SparseMixer router
(``router_kind`` sparsemixer, ``models/moe_routing.py``): always the top 2 experts, unrenormalised.

Names: config.json's ``router_jitter_noise`` is the SparseMixer's threshold (``sparsemixer_eps``:
it changes the weights at eval too), ``input_jitter_noise`` the input jitter while training
(shardzoo's ``router_jitter_noise``). Training takes the eval choice of experts (transformers
samples it, with Heun's gradient estimate).

Rotary: longrope multiplies cos and sin by ``short_mscale`` (read as ``attention_factor``; a
``long_mscale`` other than it is refused). transformers 5.25 rotates with the short factors at
every length; shardzoo, past ``original_max_position_embeddings``, with the long ones (as Phi-3 and
the original Phi-MoE code): equal within the original length.
"""

from __future__ import annotations

from shardzoo.models.hf import llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig, Weight
from shardzoo.models.moe_arch import NO_MOE
from shardzoo.models.rope import rope_attention_factor

# PhimoeConfig's fields and defaults (transformers 5.25)
SCHEMA = ({k: v for k, v in mixtral.SCHEMA.items() if k != "head_dim"}
          | dict(vocab_size=32064, hidden_size=4096, intermediate_size=6400, max_position_embeddings=131072,
                 num_key_value_heads=8, rms_norm_eps=1e-5, num_local_experts=16, router_jitter_noise=0.01,
                 input_jitter_noise=0.0, attention_bias=False, lm_head_bias=False))
# transformers' Phi-MoE rotary computes plain and longrope embeddings only (it reads the mscales)
FEATURES = frozenset({"rope", "rope_scaling:longrope", "layernorm", "pre_norms", "gated_mlp", "attention_bias",
                      "attention_out_bias", "lm_head_bias", "sliding_window", "moe", "router_jitter",
                      "sparsemixer_router"})


def from_hf(hf: HFConfig) -> dict:
    out = llama.rotary_fields(hf, theta=1e6)
    scaling = out["rope_scaling"]
    if scaling is not None and scaling.get("rope_type") == "longrope":
        short, long = scaling.pop("short_mscale", None), scaling.pop("long_mscale", None)
        if short != long:
            raise hf.refuse("rope_scaling", f"long_mscale={long!r} differs from short_mscale={short!r}: shardzoo "
                                            "scales cos and sin by one factor at every length")
        out["rope_scaling"] = scaling | dict(attention_factor=short)
    k = hf.get("num_experts_per_tok")
    if k != 2:
        raise hf.refuse("num_experts_per_tok", "Phi-MoE's SparseMixer always picks 2 experts")
    bias = hf.get("attention_bias")
    return out | dict(
        norm_type="layernorm", attention_bias=bias, attention_out_bias=bias, lm_head_bias=hf.get("lm_head_bias"),
        sliding_window=hf.get("sliding_window"), num_local_experts=hf.get("num_local_experts"),
        num_experts_per_tok=k, router_kind="sparsemixer", norm_topk_prob=False,
        sparsemixer_eps=hf.get("router_jitter_noise"), router_jitter_noise=hf.get("input_jitter_noise"),
        router_aux_loss_coef=hf.get("router_aux_loss_coef"))


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    out = llama.rotary_to_hf(a)
    scaling = out["rope_scaling"]
    if scaling is not None and scaling.get("rope_type") == "longrope":
        mscale = scaling.pop("attention_factor", None) or rope_attention_factor(a)
        out["rope_scaling"] = scaling | dict(short_mscale=mscale, long_mscale=mscale)
    return out | dict(
        attention_bias=a.attention_bias, lm_head_bias=a.lm_head_bias, sliding_window=a.sliding_window,
        num_local_experts=m.num_local_experts, num_experts_per_tok=m.num_experts_per_tok,
        router_jitter_noise=m.sparsemixer_eps, input_jitter_noise=m.router_jitter_noise,
        router_aux_loss_coef=m.router_aux_loss_coef)


def global_weights(a) -> list[Weight]:
    """Llama's, the final LayerNorm's bias and the head's."""
    out = llama.global_weights(a) + [Weight(("final_norm", "bias"), "model.norm.bias", "vec")]
    if a.lm_head_bias:
        out.append(Weight(("lm_head_bias",) if a.tie_word_embeddings else ("lm_head", "bias"), "lm_head.bias", "vec"))
    return out


def layer_weights(a, spec) -> list[Weight]:
    """Mixtral's, and the LayerNorms' biases."""
    return mixtral.layer_weights(a, spec) + [
        Weight((norm, "bias"), llama.LAYER + f"{name}.bias", "vec")
        for norm, name in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"))]


# microsoft/Phi-3.5-MoE-instruct/config.json's sizes: 32 layers of 4096, 32 heads (8 kv heads), q/k/v/o
# and head biases; 16 experts 6400 wide, SparseMixer top-2. Its longrope (131072 positions from 4096,
# 64 short and long factors) is not reproduced here: this preset is the model within 4096 positions
# but for the rotary mscale (1.243).
PHI35_MOE = dict(vocab_size=32064, hidden_size=4096, intermediate_size=6400, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096, rms_norm_eps=1e-5,
                 rope_theta=10000.0, norm_type="layernorm", attention_bias=True, attention_out_bias=True,
                 lm_head_bias=True, num_local_experts=16, num_experts_per_tok=2, router_kind="sparsemixer",
                 norm_topk_prob=False, sparsemixer_eps=0.01, router_jitter_noise=0.01, router_aux_loss_coef=0.0,
                 router_z_loss_coef=0.0, bos_token_id=1, eos_token_id=32000)
PHIMOE = Family(
    "phimoe", ("phimoe",), "PhimoeForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights, layer_weights,
    execution=mixtral.HF_MOE,
    presets={"phimoe-3.5": PHI35_MOE,
             "phimoe-tiny": mixtral.MIXTRAL.presets["mixtral-tiny"] | dict(
                 norm_type="layernorm", attention_bias=True, attention_out_bias=True, lm_head_bias=True,
                 router_kind="sparsemixer", norm_topk_prob=False, rope_theta=10000.0)})
