"""Flint (RecursiveSI, ``flint``): Qwen3-MoE's layer (qk-norm of each head, ``attention_bias``
for q/k/v/o; MoE unless in ``mlp_only_layers`` or off the ``decoder_sparse_step``) with
GPT-OSS's attention sinks (``self_attn.sinks``, saved as ``softmax_offset``), sliding and full
layers by ``layer_types`` where only the sliding ones rotate (the full ones NoPE), a router of
sigmoid scores, top-k without a correction bias, renormalised with ``norm_topk_prob`` (the
``sigmoid`` router), and an ungated shared expert always added (``mlp.shared_expert``).
"""

from __future__ import annotations

from shardzoo.models.arch import DENSE, FULL, MOE, SLIDING
from shardzoo.models.hf import llama, mixtral, qwen2_moe
from shardzoo.models.hf.base import Family, HFConfig, HFError, Weight, layer_types
from shardzoo.models.moe_arch import NO_MOE

# FlintConfig's fields and defaults (transformers 5.25)
SCHEMA = ({k: v for k, v in qwen2_moe.SCHEMA.items() if k not in ("qkv_bias", "use_sliding_window",
                                                                   "max_window_layers")}
          | dict(vocab_size=150144, intermediate_size=6144, num_hidden_layers=49, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, attention_bias=False, max_position_embeddings=262144,
                 sliding_window=513, moe_intermediate_size=512, shared_expert_intermediate_size=1024,
                 num_experts_per_tok=6, num_experts=256, norm_topk_prob=True, router_aux_loss_coef=0.0005,
                 mlp_only_layers=None, layer_types=None, rms_norm_eps=1e-6))
FEATURES = llama.ROTARY | {"attention_bias", "attention_out_bias", "qk_norm_head", "attention_sinks",
                           "sliding_window", "layer_pattern", "nope_layers", "moe", "moe_pattern", "expert_width",
                           "shared_experts", "sigmoid_topk_router"}


def _types(hf: HFConfig) -> tuple[str, ...]:
    """``layer_types``, else transformers' default: full on the first two layers, every fourth
    from layer 1, and the last; sliding elsewhere."""
    n, types = hf.get("num_hidden_layers"), hf.get("layer_types")
    if types is None:
        types = [FULL if i < 2 or i % 4 == 1 or i == n - 1 else SLIDING for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in (FULL, SLIDING) for t in types):
        raise hf.refuse("layer_types", f"must list {FULL!r} or {SLIDING!r} for each of the {n} layers")
    return tuple(types)


def from_hf(hf: HFConfig) -> dict:
    n, step, bias = hf.get("num_hidden_layers"), hf.get("decoder_sparse_step"), hf.get("attention_bias")
    dense = hf.get("mlp_only_layers")
    dense = set((0, 1) if dense is None else dense)  # transformers' default: [0, 1]
    types, window = _types(hf), hf.get("sliding_window")
    if SLIDING in types and not window:
        raise hf.refuse("sliding_window", f"layer_types has {SLIDING} layers but no window")
    experts = hf.get("num_experts")
    if not experts:
        raise hf.refuse("num_experts", "Flint's sparse layers have routed experts: an integer > 0 is needed")
    return llama.rotary_fields(hf) | dict(
        qk_norm="head", attention_bias=bias, attention_out_bias=bias, attention_sinks=True,
        sliding_window=window if SLIDING in types else None, layer_types=types if SLIDING in types else None,
        rope_layers=tuple(t == SLIDING for t in types), num_local_experts=experts,
        num_experts_per_tok=hf.get("num_experts_per_tok"), moe_intermediate_size=hf.get("moe_intermediate_size"),
        norm_topk_prob=hf.get("norm_topk_prob"), router_aux_loss_coef=hf.get("router_aux_loss_coef"),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size"), router_kind="sigmoid",
        mlp_layer_types=tuple(MOE if (i + 1) % step == 0 and i not in dense else DENSE for i in range(n)))


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    types = layer_types(a)
    rotates = tuple(a.rope_layers or (True,) * a.num_hidden_layers)
    if not (a.attention_sinks and m.router_kind == "sigmoid" and m.shared_expert_intermediate_size
            and a.attention_bias == a.attention_out_bias and rotates == tuple(t == SLIDING for t in types)):
        raise HFError("Flint has attention sinks, one bias flag for q/k/v/o, rotary embeddings on its sliding "
                      "layers only, a sigmoid top-k router (router_kind sigmoid) and a shared expert")
    kinds = a.layer_specs()
    return llama.rotary_to_hf(a) | dict(
        attention_bias=a.attention_bias, sliding_window=a.sliding_window, layer_types=types,
        num_experts=m.num_local_experts, num_experts_per_tok=m.num_experts_per_tok,
        moe_intermediate_size=a.expert_size, shared_expert_intermediate_size=m.shared_expert_intermediate_size,
        decoder_sparse_step=1, mlp_only_layers=[i for i, s in enumerate(kinds) if s.mlp == DENSE],
        norm_topk_prob=m.norm_topk_prob, router_aux_loss_coef=m.router_aux_loss_coef)


def layer_weights(a, spec) -> list[Weight]:
    """Qwen3's layer and the sinks; a MoE layer's router ``mlp.gate``, experts ``mlp.experts.E.*``
    and ``mlp.shared_expert.*``."""
    out = llama.attention_weights(a) + [Weight(("attn", "sinks"), llama.LAYER + "self_attn.softmax_offset")]
    if spec.mlp != MOE:
        return out + llama.mlp_weights(a)
    x = llama.LAYER + "mlp."
    return out + mixtral.moe_weights(a, "mlp.", ("gate_proj", "up_proj", "down_proj")) + [
        Weight(("shared_expert", n, "kernel"), x + f"shared_expert.{n}_proj.weight", "linear")
        for n in ("gate", "up", "down")]


# two dense layers (full, sliding) then two MoE layers (sliding, full), scanned from the third
_TINY_TYPES = (FULL, SLIDING, SLIDING, FULL)
FLINT = Family(
    "flint", ("flint",), "FlintForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={"flint-tiny": llama.TINY | dict(
        num_hidden_layers=4, head_dim=16, qk_norm="head", attention_sinks=True, sliding_window=8,
        layer_types=_TINY_TYPES, rope_layers=tuple(t == SLIDING for t in _TINY_TYPES), num_local_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, router_kind="sigmoid",
        router_aux_loss_coef=0.0005, router_z_loss_coef=0.0, rms_norm_eps=1e-6,
        mlp_layer_types=(DENSE, DENSE, MOE, MOE))})
