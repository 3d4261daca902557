"""Gemma 4 (text, ``gemma4_text``): Gemma 3's layers with the full-attention layers shaped apart.

Beside Gemma 3 (four norms a block, qk-norm, sliding and full layers, GeGLU, scaled embeddings,
a tied head, soft-capped logits): plain RMSNorms (scaled by the weight, not 1 + weight), values
RMS-normalised per head without a weight (``v_norm``), an attention scale of 1, every layer's
output times its ``layer_scalar`` (a buffer transformers saves), and full-attention layers with a
head size and key/value heads of their own (``per_layer_config``, or ``global_head_dim`` and
``num_global_key_value_heads``) whose keys serve as values with ``attention_k_eq_v``
(models/attention.py ``GlobalAttention``), rotating by proportional RoPE (models/rope.py).

The MoE block (``enable_moe_block``) runs beside every layer's MLP (models/moe.py
``DENSE_AND_MOE_KIND``, its ``scaled_softmax`` router). The small models' per-layer input
embeddings (``hidden_size_per_layer_input``) and KV sharing (``num_kv_shared_layers``, with
``use_double_wide_mlp`` the sharing layers' MLPs twice as wide) are Gemma 3n's (models/per_layer.py:
its layers unrolled). Not implemented, refused naming the field: those beside the MoE block, and
bidirectional attention (``use_bidirectional_attention: all``).
"""

from __future__ import annotations

from shardzoo.models.arch import FULL, SLIDING
from shardzoo.models.attention import is_global
from shardzoo.models.hf import gemma, gemma3n, llama, mixtral
from shardzoo.models.hf.base import INERT, Family, HFConfig, HFError, Weight, layer_types, sizes
from shardzoo.models.moe_arch import DENSE_AND_MOE

SCHEMA = dict(
    vocab_size=262144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
    initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    tie_word_embeddings=True, rope_parameters=None, attention_bias=False, attention_dropout=0.0,
    sliding_window=512, layer_types=None, final_logit_softcapping=None, use_bidirectional_attention=None,
    vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256, attention_k_eq_v=False,
    num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False, num_experts=None,
    top_k_experts=None, moe_intermediate_size=None, per_layer_config=None, global_head_dim=512,
    num_global_key_value_heads=None)
FEATURES = frozenset({"rope", "rope_scaling:proportional", "local_rope", "rmsnorm", "sandwich_norms", "gated_mlp",
                      "qk_norm_head", "v_norm", "scale_embeddings", "attention_bias", "attention_out_bias",
                      "sliding_window", "layer_pattern", "final_softcap", "multipliers", "layer_scalar",
                      "global_attention", "moe", "expert_width", "scaled_router", "moe_beside_dense",
                      "gemma3n_layers", "per_layer_inputs", "kv_sharing"})
_DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                 FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}}


# ------------------------------------------------------------------------------ config.json
def _refuse_missing(hf: HFConfig) -> None:
    """The mechanisms shardzoo's Gemma 4 does not compute, each refused naming its field."""
    if hf.get("enable_moe_block") and (hf.get("hidden_size_per_layer_input") or hf.get("num_kv_shared_layers")):
        raise hf.refuse("enable_moe_block", "the MoE block beside per-layer inputs or KV sharing is not implemented")
    if hf.get("use_bidirectional_attention") == "all":
        raise hf.refuse("use_bidirectional_attention", "bidirectional attention is not implemented")
    hf.ignore("use_bidirectional_attention")  # a text model: "vision" changes only image tokens' masks


def _per_layer(hf: HFConfig) -> dict:
    """Per-layer input embeddings and KV sharing (models/per_layer.py), the flat names of its record."""
    size, shared = hf.get("hidden_size_per_layer_input") or 0, hf.get("num_kv_shared_layers") or 0
    rows = hf.get("vocab_size_per_layer_input") if size else hf.ignore("vocab_size_per_layer_input")
    return dict(hidden_size_per_layer_input=size, vocab_size_per_layer_input=rows, num_kv_shared_layers=shared,
                use_double_wide_mlp=bool(hf.get("use_double_wide_mlp")))


def _rope(hf: HFConfig) -> dict:
    """The global layers' base and proportional rotary; the sliding layers' base (default rotary only)."""
    params = hf.get("rope_parameters") or _DEFAULT_ROPE
    glob, local = dict(params.get(FULL) or _DEFAULT_ROPE[FULL]), dict(params.get(SLIDING) or _DEFAULT_ROPE[SLIDING])
    if local.get("rope_type", "default") != "default":
        raise hf.refuse("rope_parameters", f"rope_type {local['rope_type']!r} of the {SLIDING} layers is not "
                        "supported (default only)")
    kind = glob.pop("rope_type", "default")
    theta = glob.pop("rope_theta", 1000000.0)
    if kind not in ("default", "proportional"):
        raise hf.refuse("rope_parameters", f"rope_type {kind!r} of the {FULL} layers is not supported (default, "
                        "proportional)")
    scaling = None
    if kind == "proportional":
        scaling = {"rope_type": kind} | {k: glob[k] for k in ("partial_rotary_factor", "factor") if k in glob}
    return dict(rope_theta=float(theta), rope_scaling=scaling, rope_local_base_freq=float(local.get("rope_theta", 1e4)))


def _global_shape(hf: HFConfig, types: list[str]) -> dict:
    """The full layers' head size and key/value heads: ``per_layer_config`` (what transformers
    writes), else ``global_head_dim`` and, with ``attention_k_eq_v``, ``num_global_key_value_heads``."""
    k_eq_v = bool(hf.get("attention_k_eq_v"))
    per_layer, head_dim, kv = hf.get("per_layer_config"), hf.get("global_head_dim"), hf.get("num_global_key_value_heads")
    if per_layer is not None:
        if not isinstance(per_layer, dict) or not all(str(i).isdigit() and isinstance(o, dict)
                                                      for i, o in per_layer.items()):
            raise hf.refuse("per_layer_config", "shardzoo reads a mapping of layer indices to their settings")
        overrides = {int(i): dict(o) for i, o in per_layer.items()}
        shapes = {tuple(sorted(o.items())) for o in overrides.values()}
        if set(overrides) != {i for i, t in enumerate(types) if t == FULL} or len(shapes) != 1 \
                or not set(next(iter(overrides.values()))) <= {"head_dim", "num_key_value_heads"}:
            raise hf.refuse("per_layer_config", f"shardzoo reads one head_dim (and num_key_value_heads) for every "
                            f"{FULL} layer and none for the others")
        one = next(iter(overrides.values()))
        head_dim, kv = one.get("head_dim", hf.get("head_dim")), one.get("num_key_value_heads")
    return dict(global_head_dim=head_dim, num_global_key_value_heads=kv if k_eq_v else None,
                global_attention_k_eq_v=k_eq_v)


def _moe(hf: HFConfig, n: int) -> dict:
    """The MoE block beside every layer's MLP (``enable_moe_block``): its experts and their router."""
    if not hf.get("enable_moe_block"):
        hf.ignore("num_experts", "top_k_experts", "moe_intermediate_size")
        return {}
    return dict(mlp_layer_types=(DENSE_AND_MOE,) * n, num_local_experts=hf.get("num_experts"),
                num_experts_per_tok=hf.get("top_k_experts"), moe_intermediate_size=hf.get("moe_intermediate_size"),
                router_kind="scaled_softmax", norm_topk_prob=True, router_aux_loss_coef=0.0)  # transformers adds none


def gemma4_from_hf(hf: HFConfig) -> dict:
    _refuse_missing(hf)
    hf.ignore(*INERT)
    n = hf.get("num_hidden_layers")
    types = list(hf.get("layer_types") or [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)])
    if types and types[-1] != FULL:
        types[-1] = FULL  # as transformers forces it
    bias = hf.get("attention_bias")
    fields = sizes(hf) | dict(num_key_value_heads=hf.get("num_key_value_heads"), head_dim=hf.get("head_dim"),
                              hidden_act=hf.get("hidden_activation"), norm_type="rmsnorm", norm_position="both",
                              qk_norm="head", v_norm=True, layer_scalar=True, scale_embeddings=True,
                              attention_multiplier=1.0, attention_bias=bias, attention_out_bias=bias,
                              final_logit_softcapping=hf.get("final_logit_softcapping"))
    window = hf.get("sliding_window")
    pattern = dict(sliding_window=window, layer_types=tuple(types)) if SLIDING in types else \
        dict(sliding_window=None, layer_types=None)
    if FULL not in types:
        raise HFError(f"{hf.where}: layer_types has no {FULL} layer")
    return fields | pattern | _rope(hf) | _global_shape(hf, types) | _moe(hf, n) | _per_layer(hf)


def gemma4_to_hf(a) -> dict:
    out = llama.rotary_to_hf(a)
    for key in ("hidden_act", "rope_theta", "rope_scaling"):
        out.pop(key, None)
    g = a.global_attention
    types = layer_types(a)
    glob = {"rope_type": "default"} | {k: list(v) if isinstance(v, tuple) else v
                                        for k, v in a.rope_scaling_dict.items()} | {"rope_theta": a.rope_theta}
    local = {"rope_type": "default", "rope_theta": a.rope_local_base_freq or a.rope_theta}
    shape = {"head_dim": (g and g.head_dim) or a.head_size}
    if g and g.k_eq_v and g.num_key_value_heads:
        shape["num_key_value_heads"] = g.num_key_value_heads
    return out | dict(
        hidden_activation=a.hidden_act, attention_bias=a.attention_bias, sliding_window=a.sliding_window,
        layer_types=types, final_logit_softcapping=a.final_logit_softcapping,
        rope_parameters={FULL: glob, SLIDING: local}, attention_k_eq_v=bool(g and g.k_eq_v),
        per_layer_config={str(i): shape for i, t in enumerate(types) if t == FULL},
        pad_token_id=None, **_moe_to_hf(a), **_per_layer_to_hf(a))


def _per_layer_to_hf(a) -> dict:
    p = a.per_layer
    if p is None:
        return dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0)
    return dict(hidden_size_per_layer_input=p.input_size, vocab_size_per_layer_input=p.vocab_size or a.vocab_size,
                num_kv_shared_layers=p.kv_shared_layers, use_double_wide_mlp=p.double_wide_mlp)


def _moe_to_hf(a) -> dict:
    m = a.moe
    if m is None:
        return dict(enable_moe_block=False)
    return dict(enable_moe_block=True, num_experts=m.num_local_experts, top_k_experts=m.num_experts_per_tok,
                moe_intermediate_size=a.expert_size)


# --------------------------------------------------------------------------------- weights
def layer_weights(a, spec) -> list[Weight]:
    """Gemma 3's tensors, and the layer scalar; a full layer whose keys serve as values has no v_proj."""
    out = gemma.layer_weights(a, spec) + [Weight(("layer_scalar", "scale"), llama.LAYER + "layer_scalar", "vec")]
    out = gemma3n.per_layer_weights(a, spec, out)
    g = a.global_attention
    if g and g.k_eq_v and is_global(spec):
        out = [w for w in out if w.path[:2] != ("attn", "v")]
    if spec.mlp != DENSE_AND_MOE:
        return out
    h, stacked = llama.LAYER, dict(experts=a.moe.num_local_experts, stacked_experts=True)
    return out + [
        Weight(("post_mlp_norm_1", "scale"), h + "post_feedforward_layernorm_1.weight"),
        Weight(("moe_norm", "scale"), h + "pre_feedforward_layernorm_2.weight"),
        Weight(("post_moe_norm", "scale"), h + "post_feedforward_layernorm_2.weight"),
        Weight(("moe", "router", "kernel"), h + "router.proj.weight", "linear"),
        Weight(("moe", "router_scale"), h + "router.scale", "vec"),
        Weight(("moe", "per_expert_scale"), h + "router.per_expert_scale", "vec"),
        Weight(("moe", "wi_gate"), h + "experts.gate_up_proj", "linear", part=(0, 2), **stacked),
        Weight(("moe", "wi_up"), h + "experts.gate_up_proj", "linear", part=(1, 2), **stacked),
        Weight(("moe", "wo"), h + "experts.down_proj", "linear", **stacked)]


# --------------------------------------------------------------------------------- presets
def _every(p: int, n: int) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % p == 0 else SLIDING for i in range(n))


def _gemma4(n: int, **kw) -> dict:
    return dict(vocab_size=262144, head_dim=256, hidden_act="gelu_pytorch_tanh", norm_type="rmsnorm",
                norm_position="both", qk_norm="head", v_norm=True, layer_scalar=True, scale_embeddings=True,
                attention_multiplier=1.0, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
                final_logit_softcapping=30.0, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25},
                num_hidden_layers=n, layer_types=_every(6, n)) | kw


GEMMA4 = Family(
    "gemma4_text", ("gemma4_text",), "Gemma4ForCausalLM", SCHEMA, FEATURES, gemma4_from_hf, gemma4_to_hf,
    gemma3n.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={
        # google/gemma-4-31B's text model: keys as values on the global layers, no per-layer inputs
        "gemma-4-31b": _gemma4(60, hidden_size=5376, intermediate_size=21504, num_attention_heads=32,
                               num_key_value_heads=16, sliding_window=1024, max_position_embeddings=262144,
                               global_head_dim=512, num_global_key_value_heads=4, global_attention_k_eq_v=True),
        # google/gemma-4-26B-A4B's text model: the MoE block (128 experts 704 wide, top-8) beside every MLP
        "gemma-4-26b-a4b": _gemma4(30, hidden_size=2816, intermediate_size=2112, num_attention_heads=16,
                                   num_key_value_heads=8, sliding_window=1024, max_position_embeddings=262144,
                                   global_head_dim=512, num_global_key_value_heads=2, global_attention_k_eq_v=True,
                                   mlp_layer_types=(DENSE_AND_MOE,) * 30, num_local_experts=128,
                                   num_experts_per_tok=8, moe_intermediate_size=704, router_kind="scaled_softmax",
                                   router_aux_loss_coef=0.0),
        # a window shorter than a test's text; the global layers' own heads, keys as values
        "gemma4-tiny": _gemma4(6, **(llama.TINY | dict(num_hidden_layers=6, head_dim=16, sliding_window=8,
                                                       global_head_dim=32, num_global_key_value_heads=1,
                                                       global_attention_k_eq_v=True))),
    })
