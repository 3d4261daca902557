"""Llama (2, 3, 3.1, 3.2; rope_scaling llama3), Mistral and Qwen2 (2.5): one layout, three configs.

The three families share their tensors (``model.layers.{i}.self_attn.q_proj`` ...) and most of
config.json; they differ in biases (Llama: one flag for q/k/v/o, and ``mlp_bias``; Qwen2: q/k/v
only; Mistral: none) and in the window (Mistral: every layer; Qwen2: the layers from
``max_window_layers`` on, behind ``use_sliding_window``, or its ``layer_types``). The other
rotary families build on the helpers here.
"""

from __future__ import annotations

from shardzoo.models.arch import FULL, SLIDING
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    Weight,
    layer_types,
    rope,
    rope_to_hf,
    sizes,
    sizes_to_hf,
)

# config.json fields and transformers' defaults (LlamaConfig; the others add or drop some).
SCHEMA = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
              max_position_embeddings=2048, initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
              pad_token_id=None, bos_token_id=1, eos_token_id=2, pretraining_tp=1,
              tie_word_embeddings=False, rope_parameters=None, attention_bias=False,
              attention_dropout=0.0, mlp_bias=False)
# What every family of rotary embeddings, RMSNorm before attention and MLP, and gated MLPs uses.
# transformers 5 computes every rope_scaling type (ROPE_INIT_FUNCTIONS) for every such family.
ROTARY = frozenset({"rope", "rope_scaling:linear", "rope_scaling:llama3", "rope_scaling:yarn",
                    "rope_scaling:longrope", "rope_scaling:dynamic", "rmsnorm", "pre_norms", "gated_mlp"})
LLAMA_FEATURES = ROTARY | {"attention_bias", "attention_out_bias", "mlp_bias"}


# ------------------------------------------------------------------------------ config.json
def rotary_fields(hf: HFConfig, theta: float = 10000.0) -> dict:
    """Architecture fields every rotary family reads the same way (no biases, no window);
    ``theta``: the family's default rotary base."""
    hf.ignore(*INERT)
    out = sizes(hf) | rope(hf, theta=theta)
    out.pop("partial_rotary_factor")  # only the families that rotate part of each head read it
    return out


def rotary_to_hf(a) -> dict:
    """The config.json keys every rotary family writes the same way."""
    out = sizes_to_hf(a) | rope_to_hf(a)
    out.pop("partial_rotary_factor", None)
    return out


def window_fields(hf: HFConfig, window: int | None) -> dict:
    """``sliding_window`` and ``layer_types``: HF's ``layer_types`` where it has one, else every
    layer sliding when ``window`` is set."""
    types = hf.get("layer_types", None)
    if window is None or (types is not None and SLIDING not in types):
        return dict(sliding_window=None, layer_types=None)
    return dict(sliding_window=window, layer_types=tuple(types) if types else None)


def llama_from_hf(hf: HFConfig) -> dict:
    bias = hf.get("attention_bias")  # one flag for q/k/v and o biases
    return rotary_fields(hf) | dict(attention_bias=bias, attention_out_bias=bias, mlp_bias=hf.get("mlp_bias"))


def llama_to_hf(a) -> dict:
    return rotary_to_hf(a) | dict(attention_bias=a.attention_bias, mlp_bias=a.mlp_bias)


def mistral_from_hf(hf: HFConfig) -> dict:
    return rotary_fields(hf) | dict(sliding_window=hf.get("sliding_window"))


def mistral_to_hf(a) -> dict:
    return rotary_to_hf(a) | dict(sliding_window=a.sliding_window)


def qwen2_window(hf: HFConfig) -> dict:
    """Qwen2/Qwen3's window: ``sliding_window`` only with ``use_sliding_window``, on the layers
    ``layer_types`` names, else on the layers from ``max_window_layers`` on (transformers 5)."""
    window, use, start = hf.get("sliding_window"), hf.get("use_sliding_window"), hf.get("max_window_layers")
    window = window if use else None  # transformers drops the window when it is off
    if window is not None and hf.get("layer_types", None) is None:
        n = hf.get("num_hidden_layers")
        types = tuple(SLIDING if i >= start else FULL for i in range(n))
        return dict(sliding_window=window, layer_types=types if SLIDING in types else None)
    return window_fields(hf, window)


def qwen2_window_to_hf(a) -> dict:
    types = layer_types(a)
    sliding = [i for i, t in enumerate(types) if t == SLIDING]
    return dict(use_sliding_window=bool(sliding), sliding_window=a.sliding_window,
                max_window_layers=sliding[0] if sliding else a.num_hidden_layers, layer_types=types)


def qwen2_from_hf(hf: HFConfig) -> dict:
    return rotary_fields(hf) | qwen2_window(hf) | dict(attention_bias=True)  # q/k/v biases, no o bias


def qwen2_to_hf(a) -> dict:
    return rotary_to_hf(a) | qwen2_window_to_hf(a)


# --------------------------------------------------------------------------------- weights
LAYER = "model.layers.{i}."


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), "model.embed_tokens.weight"),
           Weight(("final_norm", "scale"), "model.norm.weight")]
    if not a.tie_word_embeddings:
        out.append(Weight(("lm_head", "kernel"), "lm_head.weight", "linear"))
    return out


def attention_weights(a) -> list[Weight]:
    """The two norms and the attention of a layer (biases, norm placement and qk-norm as the
    architecture has them: OLMo 2's post-norms, Qwen3's and OLMo 2's q_norm and k_norm)."""
    h = LAYER
    if a.norm_position == "pre":
        norms = (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"))
    else:
        norms = (("post_attn_norm", "post_attention_layernorm"),
                 ("post_mlp_norm", "post_feedforward_layernorm"))
    out = [Weight((norm, "scale"), h + f"{name}.weight") for norm, name in norms]
    if a.qk_norm not in ("none", "l2"):  # flat in HF; (heads, head_dim) here for a whole-projection norm
        out += [Weight(("attn", f"{n}_norm", "scale"), h + f"self_attn.{n}_norm.weight", "vec")
                for n in "qk"]
    out.append(Weight(("attn", "o", "kernel"), h + "self_attn.o_proj.weight", "linear", n_in=2))
    for n in "qkv":
        out.append(Weight(("attn", n, "kernel"), h + f"self_attn.{n}_proj.weight", "linear"))
        if a.attention_bias:
            out.append(Weight(("attn", n, "bias"), h + f"self_attn.{n}_proj.bias", "vec"))
    if a.attention_out_bias:
        out.append(Weight(("attn", "o", "bias"), h + "self_attn.o_proj.bias", "vec"))
    return out


def mlp_weights(a, prefix: str = "mlp.") -> list[Weight]:
    out = []
    for n in ("gate", "up", "down") if a.mlp_type == "gated" else ("up", "down"):  # plain: Arcee
        out.append(Weight(("mlp", n, "kernel"), LAYER + f"{prefix}{n}_proj.weight", "linear"))
        if a.mlp_bias:
            out.append(Weight(("mlp", n, "bias"), LAYER + f"{prefix}{n}_proj.bias", "vec"))
    return out


def layer_weights(a, spec) -> list[Weight]:
    """A dense layer of the Llama layout."""
    return attention_weights(a) + mlp_weights(a)


# --------------------------------------------------------------------------------- presets
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=None)  # vocab 512 fits the byte tokenizer's 259 ids
_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=128000,
               eos_token_id=128001, num_key_value_heads=8)
_LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)
_QWEN2 = dict(attention_bias=True, tie_word_embeddings=True, rope_theta=1000000.0,
              bos_token_id=151643, eos_token_id=151643)

LLAMA = Family(
    "llama", ("llama",), "LlamaForCausalLM", SCHEMA, LLAMA_FEATURES, llama_from_hf, llama_to_hf,
    global_weights, layer_weights,
    presets={
        "llama2-7b": dict(max_position_embeddings=4096, rms_norm_eps=1e-5),
        "llama3-8b": dict(intermediate_size=14336, max_position_embeddings=8192, **_LLAMA3),
        "llama3.1-8b": dict(intermediate_size=14336, max_position_embeddings=131072, **_LLAMA3,
                            rope_scaling=_LLAMA31_ROPE),
        "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
                            max_position_embeddings=131072, tie_word_embeddings=True, **_LLAMA3,
                            rope_scaling=dict(_LLAMA31_ROPE, factor=32.0)),
        "llama-tiny": TINY,
    })
MISTRAL = Family(
    "mistral", ("mistral",), "MistralForCausalLM",
    {k: v for k, v in SCHEMA.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp")}
    | dict(vocab_size=32000, intermediate_size=14336, max_position_embeddings=131072,
           num_key_value_heads=8, sliding_window=4096),
    ROTARY | {"sliding_window"}, mistral_from_hf, mistral_to_hf, global_weights, layer_weights,
    presets={
        "mistral-7b": dict(intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=32768,
                           rms_norm_eps=1e-5, sliding_window=4096),
        "mistral-tiny": TINY | dict(sliding_window=8),
    })
QWEN2_SCHEMA = ({k: v for k, v in SCHEMA.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp",
                                                                "head_dim")}
                | dict(vocab_size=151936, intermediate_size=22016, max_position_embeddings=32768,
                       bos_token_id=None, eos_token_id=None, use_sliding_window=False, sliding_window=4096,
                       max_window_layers=28, layer_types=None))
QWEN2 = Family(
    "qwen2", ("qwen2",), "Qwen2ForCausalLM", QWEN2_SCHEMA,
    ROTARY | {"attention_bias", "sliding_window", "layer_pattern"}, qwen2_from_hf, qwen2_to_hf,
    global_weights, layer_weights,
    presets={
        "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                             **_QWEN2),
        "qwen2-tiny": TINY | _QWEN2 | dict(num_key_value_heads=1, bos_token_id=None, eos_token_id=None),  # MQA
    })
