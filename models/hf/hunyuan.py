"""HunYuan dense (``hunyuan_v1_dense``) and MoE (``hunyuan_v1_moe``): Llama's layout with an RMSNorm of each query and key
head applied after the rotary embedding (``self_attn.query_layernorm``, ``key_layernorm``;
Qwen3 norms before it). One flag, ``attention_bias``, for q/k/v/o biases.

The published models' rotary scaling, labelled ``dynamic`` with a fixed ``alpha`` (transformers
turns it into its static "ntk_alpha"), only stretches the base: theta * alpha ** (d / (d - 2)).
It imports as plain rotary with that base, which is the same math (and exports so).

HunYuan-MoE: every layer's MLP a MoE of ``num_experts`` experts (``mlp.experts.E.{gate,up,down}_proj``),
the renormalised top-``moe_topk`` of a softmax router (``mlp.gate.wg``), and a shared expert
(``mlp.shared_mlp``) as wide as the experts (``intermediate_size``). Per-layer expert counts
(lists) import where every layer has the same.
"""

from __future__ import annotations

import dataclasses

from shardzoo.models.arch import MOE
from shardzoo.models.hf import llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig, Weight
from shardzoo.models.moe_arch import NO_MOE

# HunYuanDenseV1Config's fields and defaults (transformers 5)
SCHEMA = ({k: v for k, v in llama.SCHEMA.items() if k != "mlp_bias"}
          | dict(vocab_size=290943, rms_norm_eps=1e-5, pad_token_id=0, eod_token_id=3))
FEATURES = llama.ROTARY | {"qk_norm_head", "qk_norm_after_rope", "attention_bias", "attention_out_bias"}
_NAMES = {"self_attn.q_norm.weight": "self_attn.query_layernorm.weight",
          "self_attn.k_norm.weight": "self_attn.key_layernorm.weight"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore("eod_token_id")  # a special token id, not the model's math
    bias = hf.get("attention_bias")  # one flag for q/k/v/o
    fields = llama.rotary_fields(hf)
    scaling = dict(fields["rope_scaling"] or {})
    if scaling.get("rope_type") == "dynamic" and scaling.get("alpha"):  # NTK by a fixed alpha
        dim = fields["head_dim"] or fields["hidden_size"] // fields["num_attention_heads"]
        fields |= dict(rope_theta=fields["rope_theta"] * scaling["alpha"] ** (dim / (dim - 2)), rope_scaling=None)
    return fields | dict(qk_norm="head", qk_norm_after_rope=True, attention_bias=bias, attention_out_bias=bias)


def to_hf(a) -> dict:
    return llama.rotary_to_hf(a) | dict(attention_bias=a.attention_bias)  # head_dim always (None breaks HF)


def layer_weights(a, spec):
    """Llama's layer with HunYuan's names of the q and k norms."""
    out = []
    for w in llama.layer_weights(a, spec):
        suffix = w.name.removeprefix(llama.LAYER)
        out.append(dataclasses.replace(w, name=llama.LAYER + _NAMES[suffix]) if suffix in _NAMES else w)
    return out


HUNYUAN_DENSE = Family(
    "hunyuan_v1_dense", ("hunyuan_v1_dense",), "HunYuanDenseV1ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights,
    presets={"hunyuan-dense-tiny": llama.TINY | dict(qk_norm="head", qk_norm_after_rope=True, rms_norm_eps=1e-5)})


# HunYuanMoEV1Config's fields and defaults (transformers 5.25)
MOE_SCHEMA = SCHEMA | dict(num_experts=1, moe_topk=1, output_router_logits=False, sep_token_id=4, head_dim=None)


def _uniform(hf: HFConfig, key: str) -> int:
    value = hf.get(key)
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise hf.refuse(key, "differs between layers; shardzoo's MoE layers share one value")
        return value[0]
    return value


def moe_from_hf(hf: HFConfig) -> dict:
    hf.ignore("sep_token_id")
    return from_hf(hf) | dict(num_local_experts=_uniform(hf, "num_experts"), num_experts_per_tok=_uniform(
        hf, "moe_topk"), shared_expert_intermediate_size=hf.get("intermediate_size"), norm_topk_prob=True)


def moe_to_hf(a) -> dict:
    m = a.moe or NO_MOE
    return to_hf(a) | dict(num_experts=m.num_local_experts, moe_topk=m.num_experts_per_tok)


def moe_layer_weights(a, spec) -> list[Weight]:
    """HunYuan's attention, the router ``mlp.gate.wg``, the experts and ``mlp.shared_mlp``."""
    if spec.mlp != MOE:
        return layer_weights(a, spec)
    attention = [w for w in layer_weights(a, spec) if w.path[0] != "mlp"]
    x = llama.LAYER + "mlp."
    return attention + mixtral.moe_weights(a, "mlp.", ("gate_proj", "up_proj", "down_proj"), "gate.wg") + [
        Weight(("shared_expert", n, "kernel"), x + f"shared_mlp.{n}_proj.weight", "linear")
        for n in ("gate", "up", "down")]


HUNYUAN_MOE = Family(
    "hunyuan_v1_moe", ("hunyuan_v1_moe",), "HunYuanMoEV1ForCausalLM", MOE_SCHEMA,
    FEATURES | {"moe", "shared_experts"}, moe_from_hf, moe_to_hf, llama.global_weights, moe_layer_weights,
    execution=mixtral.HF_MOE,
    presets={"hunyuan-moe-tiny": HUNYUAN_DENSE.presets["hunyuan-dense-tiny"] | dict(
        num_local_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=128)})
