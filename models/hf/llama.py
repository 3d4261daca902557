"""Llama (2, 3, 3.1, 3.2; rope_scaling llama3), Mistral and Qwen2 (2.5): one layout, three flags.

The three families share their tensors (``model.layers.{i}.self_attn.q_proj`` ...) and most of
config.json; they differ in biases (Llama: one flag for q/k/v/o, and ``mlp_bias``; Qwen2: q/k/v
only; Mistral: none) and in the sliding window (Mistral; Qwen2 behind ``use_sliding_window``).
``mixtral.py`` builds on the helpers here.
"""

from __future__ import annotations

from shardzoo.models.hf.base import (
    GEMMA_ONLY_OFF,
    Family,
    HFError,
    Weight,
    mismatches,
    partial_rotary_factor,
    rope,
    sliding_window,
    special_tokens,
)
from shardzoo.models.transformer import TransformerConfig

NO_BIAS = dict(attention_bias=False, attention_out_bias=False, mlp_bias=False)


# ------------------------------------------------------------------------------ config.json
def rotary_fields(hf: dict, where: str, window: bool = True) -> dict:
    """TransformerConfig fields every rotary family reads the same way (no biases)."""
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in hf]
    if missing:
        raise HFError(f"{where}: no {', '.join(missing)}")
    theta, scaling = rope(hf, where)
    heads, kv_heads, head_dim = (hf["num_attention_heads"], hf.get("num_key_value_heads"),
                                 hf.get("head_dim"))
    # Defaults that transformers spells out are read as defaults: one config, one spelling.
    kv_heads = None if kv_heads == heads else kv_heads
    head_dim = None if head_dim == hf["hidden_size"] // heads else head_dim
    return dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=hf.get("max_position_embeddings", 2048), rope_theta=theta,
        rope_scaling=scaling, partial_rotary_factor=partial_rotary_factor(hf),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        sliding_window=sliding_window(hf, where, window),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        hidden_act=hf.get("hidden_act", "silu"),
        initializer_range=hf.get("initializer_range", 0.02), **NO_BIAS, **special_tokens(hf),
    )


def rotary_to_hf(c) -> dict:
    """The config.json keys every rotary family writes the same way (legacy rope keys:
    transformers 4 and 5 read them)."""
    out = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
               num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
               num_key_value_heads=c.kv_heads, head_dim=c.head_size,
               max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
               rope_scaling=c.rope_scaling_dict or None, rms_norm_eps=c.rms_norm_eps,
               hidden_act=c.hidden_act, sliding_window=c.sliding_window)
    if c.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = c.partial_rotary_factor
    return out


def rotary_obstacles(c, experts: bool = False, **features) -> list[str]:
    """Rotary positions, RMSNorm, gated MLPs, and experts only where the family has them;
    ``features`` the family's norm placement and qk-norm (default: pre-norms, no qk-norm)."""
    need = dict(position_embedding="rope", norm_type="rmsnorm", mlp_type="gated",
                norm_position="pre", qk_norm="none", **GEMMA_ONLY_OFF)
    bad = mismatches(c, need | features)
    if bool(c.num_local_experts) != experts:
        bad.append(f"num_local_experts={c.num_local_experts}")
    return bad


# --------------------------------------------------------------------------------- weights
LAYER = "model.layers.{i}."


def global_weights(c) -> list[Weight]:
    out = [Weight(("embed", "embedding"), "model.embed_tokens.weight"),
           Weight(("final_norm", "scale"), "model.norm.weight")]
    if not c.tie_word_embeddings:
        out.append(Weight(("lm_head", "kernel"), "lm_head.weight", "linear"))
    return out


def attention_weights(c) -> list[Weight]:
    """The two norms and the attention of a layer (biases, norm placement and qk-norm as the
    config has them: OLMo 2's post-norms, Qwen3's and OLMo 2's q_norm and k_norm)."""
    h = LAYER
    if c.norm_position == "pre":
        norms = (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"))
    else:
        norms = (("post_attn_norm", "post_attention_layernorm"),
                 ("post_mlp_norm", "post_feedforward_layernorm"))
    out = [Weight((norm, "scale"), h + f"{name}.weight") for norm, name in norms]
    if c.qk_norm != "none":  # flat in HF; (heads, head_dim) here for a whole-projection norm
        out += [Weight(("attn", f"{n}_norm", "scale"), h + f"self_attn.{n}_norm.weight", "vec")
                for n in "qk"]
    out.append(Weight(("attn", "o", "kernel"), h + "self_attn.o_proj.weight", "linear", n_in=2))
    for n in "qkv":
        out.append(Weight(("attn", n, "kernel"), h + f"self_attn.{n}_proj.weight", "linear"))
        if c.attention_bias:
            out.append(Weight(("attn", n, "bias"), h + f"self_attn.{n}_proj.bias", "vec"))
    if c.attention_out_bias:
        out.append(Weight(("attn", "o", "bias"), h + "self_attn.o_proj.bias", "vec"))
    return out


def weights(c):
    """(global, dense layer, MoE layer) weights of the three dense families."""
    layer = attention_weights(c)
    for n in ("gate", "up", "down"):
        layer.append(Weight(("mlp", n, "kernel"), LAYER + f"mlp.{n}_proj.weight", "linear"))
        if c.mlp_bias:
            layer.append(Weight(("mlp", n, "bias"), LAYER + f"mlp.{n}_proj.bias", "vec"))
    return global_weights(c), layer, []


# -------------------------------------------------------------------------------- families
def llama_from_hf(hf: dict, where: str) -> dict:
    bias = hf.get("attention_bias", False)  # one flag for q/k/v and o biases
    return rotary_fields(hf, where) | dict(attention_bias=bias, attention_out_bias=bias,
                                           mlp_bias=hf.get("mlp_bias", False))


def llama_to_hf(c) -> dict:
    return rotary_to_hf(c) | dict(attention_bias=c.attention_bias, mlp_bias=c.mlp_bias)


def one_attention_bias(c) -> list[str]:
    """HF's ``attention_bias`` covers q, k, v and o alike: shardzoo's two flags must agree."""
    if c.attention_out_bias == c.attention_bias:
        return []
    return [f"attention_out_bias={c.attention_out_bias!r} with attention_bias={c.attention_bias!r}"]


def llama_obstacles(c) -> list[str]:
    return rotary_obstacles(c) + mismatches(c, dict(sliding_window=None)) + one_attention_bias(c)


def mistral_from_hf(hf: dict, where: str) -> dict:
    return rotary_fields(hf, where)


def mistral_to_hf(c) -> dict:
    return rotary_to_hf(c)


def mistral_obstacles(c) -> list[str]:
    return rotary_obstacles(c) + mismatches(c, NO_BIAS)


def qwen2_from_hf(hf: dict, where: str) -> dict:
    fields = rotary_fields(hf, where, window=hf.get("use_sliding_window", False))
    return fields | dict(attention_bias=True)  # q/k/v biases, no o bias


def qwen2_to_hf(c) -> dict:
    return rotary_to_hf(c) | dict(use_sliding_window=bool(c.sliding_window), max_window_layers=0)


def qwen2_obstacles(c) -> list[str]:
    return rotary_obstacles(c) + mismatches(c, NO_BIAS | dict(attention_bias=True))


LLAMA = Family("llama", ("llama",), "LlamaForCausalLM", TransformerConfig,
               llama_from_hf, llama_to_hf, llama_obstacles, weights)
MISTRAL = Family("mistral", ("mistral",), "MistralForCausalLM", TransformerConfig,
                 mistral_from_hf, mistral_to_hf, mistral_obstacles, weights)
QWEN2 = Family("qwen2", ("qwen2",), "Qwen2ForCausalLM", TransformerConfig,
               qwen2_from_hf, qwen2_to_hf, qwen2_obstacles, weights)
