"""GPT-NeoX-Japanese (ABEJA): GPT-NeoX's tensors in sequential pre-LN blocks without biases, but an
output bias on the last layer's attention alone (``attention.dense_bias``: attention_out_bias_layers);
q|k|v fused per head in ``query_key_value``, rotary on the first ``partial_rotary_factor`` of each
head (legacy ``rotary_pct``, 1 by default; base ``rotary_emb_base``), a plain MLP
``intermediate_multiple_size`` x hidden wide, a final LayerNorm and the head ``embed_out`` (tied by default).
"""

from __future__ import annotations

from shardzoo.models.hf import llama, phi
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    HFError,
    Weight,
    rope,
    rope_parameters_to_hf,
    special_tokens,
)

PREFIX = "gpt_neox_japanese."
# GPTNeoXJapaneseConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=32000, hidden_size=2560, num_hidden_layers=32, num_attention_heads=32,
              intermediate_multiple_size=4, hidden_act="gelu", max_position_embeddings=2048, initializer_range=0.02,
              layer_norm_eps=1e-5, use_cache=True, bos_token_id=31996, eos_token_id=31999, rope_parameters=None,
              attention_dropout=0.1, hidden_dropout=0.0, is_decoder=False, pad_token_id=None, tie_word_embeddings=True)
FEATURES = (llama.ROTARY - {"rmsnorm", "gated_mlp"}) | {"layernorm", "partial_rotary", "plain_mlp",
                                                        "attention_out_bias_layers"}


def _last_only(n: int) -> tuple[bool, ...]:
    return tuple(i == n - 1 for i in range(n))


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT, "is_decoder")
    hf.require("hidden_size", "num_hidden_layers", "num_attention_heads")
    d, n = hf.get("hidden_size"), hf.get("num_hidden_layers")
    # config.json before transformers 5 names the rotary base and fraction rotary_emb_base and rotary_pct
    legacy = dict(theta=hf.get("rotary_emb_base", None) or 10000.0, rotary=hf.get("rotary_pct", None) or 1.0)
    return rope(hf, **legacy) | special_tokens(hf) | dict(
        vocab_size=hf.get("vocab_size"), hidden_size=d, num_hidden_layers=n,
        num_attention_heads=hf.get("num_attention_heads"),
        intermediate_size=int(d * hf.get("intermediate_multiple_size")), hidden_act=hf.get("hidden_act"),
        max_position_embeddings=hf.get("max_position_embeddings"), rms_norm_eps=hf.get("layer_norm_eps"),
        initializer_range=hf.get("initializer_range"), tie_word_embeddings=hf.get("tie_word_embeddings"),
        norm_type="layernorm", mlp_type="plain", attention_out_bias_layers=_last_only(n))


def to_hf(a) -> dict:
    biased = a.attention_out_bias_layers or (a.attention_out_bias,) * a.num_hidden_layers
    if biased != _last_only(a.num_hidden_layers):
        raise HFError(f"gpt_neox_japanese has an attention output bias on its last layer only; "
                      f"attention_out_bias_layers={list(biased)}")
    if a.intermediate_size % a.hidden_size:
        raise HFError(f"gpt_neox_japanese's MLP is a whole multiple of hidden_size={a.hidden_size} wide; "
                      f"intermediate_size={a.intermediate_size}")
    return dict(hidden_size=a.hidden_size, num_hidden_layers=a.num_hidden_layers,
                num_attention_heads=a.num_attention_heads, intermediate_multiple_size=a.intermediate_size // a.hidden_size,
                hidden_act=a.hidden_act, max_position_embeddings=a.max_position_embeddings,
                layer_norm_eps=a.rms_norm_eps, rope_parameters=rope_parameters_to_hf(a, partial=True))


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), PREFIX + "embed_in.weight")]
    out += phi._both(("final_norm",), PREFIX + "final_layer_norm")
    return out if a.tie_word_embeddings else out + [Weight(("lm_head", "kernel"), "embed_out.weight", "linear")]


def layer_weights(a, spec) -> list[Weight]:
    h = PREFIX + "layers.{i}."
    out = phi._both(("attn_norm",), h + "input_layernorm") + phi._both(("mlp_norm",), h + "post_attention_layernorm")
    out += [Weight(("attn", n, "kernel"), h + "attention.query_key_value.weight", "linear", part=(j, 3),
                   groups=a.num_attention_heads) for j, n in enumerate("qkv")]
    out.append(Weight(("attn", "o", "kernel"), h + "attention.dense.weight", "linear", n_in=2))
    if spec.out_bias:
        out.append(Weight(("attn", "o", "bias"), h + "attention.dense_bias", "vec"))
    return out + [Weight(("mlp", "up", "kernel"), h + "mlp.dense_h_to_4h.weight", "linear"),
                  Weight(("mlp", "down", "kernel"), h + "mlp.dense_4h_to_h.weight", "linear")]


GPT_NEOX_JAPANESE = Family(
    "gpt_neox_japanese", ("gpt_neox_japanese",), "GPTNeoXJapaneseForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    global_weights, layer_weights,
    presets={
        # abeja/gpt-neox-japanese-2.7b: GPTNeoXJapaneseConfig's defaults (its docstring: "a similar configuration to
        # that of the GPTNeoXJapanese abeja/gpt-neox-japanese-2.7b architecture")
        "gpt-neox-japanese-2.7b": dict(
            vocab_size=32000, hidden_size=2560, num_hidden_layers=32, num_attention_heads=32, intermediate_size=10240,
            hidden_act="gelu", max_position_embeddings=2048, rms_norm_eps=1e-5, norm_type="layernorm",
            mlp_type="plain", tie_word_embeddings=True, bos_token_id=31996, eos_token_id=31999,
            attention_out_bias_layers=_last_only(32)),
    })
