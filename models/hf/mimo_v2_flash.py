"""MiMo-V2-Flash (Xiaomi, ``mimo_v2_flash``): sliding and full layers shaped apart, values of their own
width and scale, attention sinks on the sliding layers, and DeepSeek-V3's router without shared experts.

Attention: q/k heads of ``head_dim`` (rotary on their first ``int(head_dim * partial_rotary_factor)``
features, rotate-half), values of ``v_head_dim`` times ``attention_value_scale`` (models/attention.py
``ValueHeads``); the sliding layers have twice ``num_key_value_heads`` and a learned sink per head
(``self_attn.sinks``, saved as ``attention_sink_bias``), the full layers ``num_key_value_heads`` and
none (models/attention.py ``GlobalAttention``); each kind its own rotary base (``rope_parameters``
per layer type). A window of ``sliding_window`` keys counting the query's own
(``sliding_window_size`` + 1 where config.json has that key, as transformers reads it).

MLP: ``mlp_layer_types`` "dense" (Llama's) or "sparse": DeepSeek-V3's sigmoid router with its
correction bias and groups (``sigmoid_groups``), the weights renormalised with ``norm_topk_prob``,
times ``routed_scaling_factor`` (null: 1), and no shared expert. transformers reads the
multi-token-prediction layers (``model.mtp.*``) of no causal LM, nor the published configs' older
keys (``hybrid_layer_pattern``, ``swa_*``, ``moe_layer_freq``, ``layernorm_epsilon``, ...): its
defaults stand where ``layer_types``, ``mlp_layer_types`` or ``rope_parameters`` are absent, as here.
"""

from __future__ import annotations

from shardzoo.models.arch import DENSE, FULL, MOE, SLIDING
from shardzoo.models.attention import layer_arch
from shardzoo.models.hf import llama, mixtral
from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, layer_types, sizes, sizes_to_hf
from shardzoo.models.moe_arch import NO_MOE

# MiMoV2FlashConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=152576, hidden_size=4096, intermediate_size=16384, num_hidden_layers=48,
              num_attention_heads=64, num_key_value_heads=4, hidden_act="silu", max_position_embeddings=131072,
              initializer_range=0.02, rms_norm_eps=1e-5, use_cache=True, tie_word_embeddings=False,
              rope_parameters=None, attention_bias=False, attention_dropout=0.0, moe_intermediate_size=2048,
              num_experts_per_tok=8, output_router_logits=False, n_routed_experts=256, routed_scaling_factor=1.0,
              n_group=1, topk_group=1, norm_topk_prob=True, bos_token_id=1, eos_token_id=None, pad_token_id=None,
              head_dim=192, v_head_dim=128, sliding_window=129, layer_types=None, mlp_layer_types=None,
              attention_value_scale=0.707)
FEATURES = llama.ROTARY | {"partial_rotary", "attention_bias", "sliding_window", "layer_pattern", "local_rope",
                           "attention_sinks", "global_attention", "value_heads", "moe", "moe_pattern",
                           "expert_width", "routed_scaling", "sigmoid_router"}
_ROTARY = 0.334  # transformers' partial_rotary_factor where a layer type's rope_parameters has none
_DEFAULT_ROPE = {FULL: {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": _ROTARY},
                 SLIDING: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": _ROTARY}}
_MLP = {"dense": DENSE, "sparse": MOE}


def _default_types(n: int) -> list[str]:
    """transformers' default: full on the first layer and every sixth, sliding elsewhere."""
    return [FULL if i == 0 or (i + 1) % 6 == 0 else SLIDING for i in range(n)]


def _patterns(hf: HFConfig, n: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    types = hf.get("layer_types") or _default_types(n)
    if not isinstance(types, list) or len(types) != n or any(t not in (FULL, SLIDING) for t in types):
        raise hf.refuse("layer_types", f"must list {FULL!r} or {SLIDING!r} for each of the {n} layers")
    mlps = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)
    if not isinstance(mlps, list) or len(mlps) != n or any(m not in _MLP for m in mlps):
        raise hf.refuse("mlp_layer_types", f"must list 'dense' or 'sparse' for each of the {n} layers")
    return tuple(types), tuple(_MLP[m] for m in mlps)


def _rope(hf: HFConfig, types: tuple[str, ...]) -> dict:
    """Each layer type's base (default rotary only), one rotated fraction for both."""
    params = hf.get("rope_parameters") or _DEFAULT_ROPE
    kinds = sorted(set(types))
    if not isinstance(params, dict) or any(not isinstance(params.get(k), dict) for k in kinds):
        raise hf.refuse("rope_parameters", f"shardzoo reads one mapping for each layer type ({', '.join(kinds)})")
    if any(params[k].get("rope_type", "default") != "default" for k in kinds):
        raise hf.refuse("rope_parameters", "only default rotary (rope_type 'default') is supported")
    factors = {params[k].get("partial_rotary_factor", _ROTARY) for k in kinds}
    if len(factors) != 1:
        raise hf.refuse("rope_parameters", "shardzoo rotates one partial_rotary_factor on every layer type")
    theta = {k: float(params[k]["rope_theta"]) for k in kinds}
    return dict(rope_theta=theta.get(FULL, theta.get(SLIDING)), partial_rotary_factor=float(factors.pop()),
                rope_local_base_freq=theta[SLIDING] if len(kinds) == 2 else None)


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT)
    hf.unalias({"num_local_experts": "n_routed_experts"})
    n, kv = hf.get("num_hidden_layers"), hf.get("num_key_value_heads")
    types, mlps = _patterns(hf, n)
    sliding, full = SLIDING in types, FULL in types
    size = hf.get("sliding_window_size", None)
    if size is not None:
        hf.ignore("sliding_window")  # transformers' window is then this one
    window = size + 1 if size is not None else hf.get("sliding_window")
    if sliding and not window:
        raise hf.refuse("sliding_window", f"layer_types has {SLIDING} layers but no window")
    head_dim, v_head_dim, scale = hf.get("head_dim"), hf.get("v_head_dim"), hf.get("attention_value_scale")
    scaling = hf.get("routed_scaling_factor")
    out = sizes(hf) | _rope(hf, types) | dict(
        num_key_value_heads=2 * kv if sliding else kv, head_dim=head_dim, attention_bias=hf.get("attention_bias"),
        attention_sinks=sliding, sliding_window=window if sliding else None, layer_types=types,
        value_head_dim=None if v_head_dim == head_dim else v_head_dim,
        attention_value_scale=1.0 if scale is None else float(scale), mlp_layer_types=mlps,
        num_local_experts=hf.get("n_routed_experts"), num_experts_per_tok=hf.get("num_experts_per_tok"),
        moe_intermediate_size=hf.get("moe_intermediate_size"), router_kind="sigmoid_groups",
        n_group=hf.get("n_group"), topk_group=hf.get("topk_group"), norm_topk_prob=hf.get("norm_topk_prob"),
        routed_scaling_factor=1.0 if scaling is None else float(scaling), router_aux_loss_coef=0.0)
    if sliding and full:  # the full layers: half the kv heads, no sinks
        out |= dict(num_global_key_value_heads=kv, global_attention_sinks=False)
    return out


def to_hf(a) -> dict:
    """config.json of ``a``; what transformers cannot build (kv heads not halved on the full layers,
    sinks elsewhere than on the sliding ones) reads back apart, which export refuses."""
    types, g, m = layer_types(a), a.global_attention, a.moe or NO_MOE
    kv = (g and g.num_key_value_heads) or a.kv_heads if FULL in types else a.kv_heads // 2
    rope = {"rope_type": "default", "partial_rotary_factor": a.partial_rotary_factor}
    out = sizes_to_hf(a) | dict(
        num_key_value_heads=kv, v_head_dim=a.v_head_size,
        attention_value_scale=a.value_heads.scale if a.value_heads else 1.0, attention_bias=a.attention_bias,
        tie_word_embeddings=a.tie_word_embeddings, sliding_window=a.sliding_window or SCHEMA["sliding_window"],
        layer_types=types, mlp_layer_types=["dense" if s.mlp == DENSE else "sparse" for s in a.layer_specs()],
        rope_parameters={FULL: rope | {"rope_theta": a.rope_theta},
                         SLIDING: rope | {"rope_theta": a.rope_local_base_freq or a.rope_theta}})
    if a.moe:
        out |= dict(n_routed_experts=m.num_local_experts, num_experts_per_tok=m.num_experts_per_tok,
                    moe_intermediate_size=a.expert_size, n_group=m.n_group, topk_group=m.topk_group,
                    norm_topk_prob=m.norm_topk_prob, routed_scaling_factor=m.routed_scaling_factor)
    return out


def layer_weights(a, spec) -> list[Weight]:
    """Llama's attention with a sliding layer's sinks; a dense layer's MLP, or the router ``mlp.gate``
    (its ``e_score_correction_bias``) and experts ``mlp.experts.E.*``."""
    h = llama.LAYER
    out = llama.attention_weights(a)
    if layer_arch(a, spec).attention_sinks:
        out.append(Weight(("attn", "sinks"), h + "self_attn.attention_sink_bias"))
    if spec.mlp != MOE:
        return out + llama.mlp_weights(a)
    return out + mixtral.moe_weights(a, "mlp.", ("gate_proj", "up_proj", "down_proj")) + [
        Weight(("moe", "router_bias"), h + "mlp.gate.e_score_correction_bias")]


# XiaomiMiMo/MiMo-V2-Flash's config.json: 48 layers, the first and every sixth full (4 kv heads), the
# others sliding over 128 keys and the query (8 kv heads, sinks); q/k heads of 192 rotating a third,
# values of 128 times 0.707; the first layer dense, then 256 experts 2048 wide, top-8 (one group).
# Its bos/eos are transformers' defaults (its tokenizer's are not in config.json).
FLASH = dict(
    vocab_size=152576, hidden_size=4096, intermediate_size=16384, num_hidden_layers=48, num_attention_heads=64,
    num_key_value_heads=8, num_global_key_value_heads=4, global_attention_sinks=False, attention_sinks=True,
    head_dim=192, value_head_dim=128, attention_value_scale=0.707, partial_rotary_factor=0.334,
    rope_theta=5000000.0, rope_local_base_freq=10000.0, sliding_window=129, layer_types=tuple(_default_types(48)),
    max_position_embeddings=262144, rms_norm_eps=1e-5, num_local_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=2048, router_kind="sigmoid_groups", n_group=1, topk_group=1, norm_topk_prob=True,
    routed_scaling_factor=1.0, router_aux_loss_coef=0.0, router_z_loss_coef=0.0,
    mlp_layer_types=(DENSE,) + (MOE,) * 47, bos_token_id=1, eos_token_id=None)
MIMO_V2_FLASH = Family(
    "mimo_v2_flash", ("mimo_v2_flash",), "MiMoV2FlashForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE, presets={"mimo-v2-flash": FLASH})
