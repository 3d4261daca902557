"""GPT-NeoX (EleutherAI: GPT-NeoX-20B, Pythia): with ``use_parallel_residual`` attention and MLP
side by side, each from its own LayerNorm (block form ``parallel_two_norms``: x + attn(ln1 x) +
mlp(ln2 x)), else the sequential block of the same two norms; q|k|v fused per head in
``query_key_value`` (each head's q, k and v in turn), rotary embeddings on the first ``rotary_pct``
of each head (0.25 when config.json names none; base ``rotary_emb_base``), one
``attention_bias`` flag for q/k/v and the output ``dense``, a plain biased GELU MLP, a final
LayerNorm and an untied head ``embed_out``.
"""

from __future__ import annotations

from shardzoo.models.hf import llama, phi
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    Weight,
    rope,
    rope_parameters_to_hf,
    sizes,
    sizes_to_hf,
)

PREFIX = "gpt_neox."
# GPTNeoXConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=50432, hidden_size=6144, num_hidden_layers=44, num_attention_heads=64,
              intermediate_size=24576, hidden_act="gelu", attention_dropout=0.0, hidden_dropout=0.0,
              classifier_dropout=0.1, max_position_embeddings=2048, initializer_range=0.02, layer_norm_eps=1e-5,
              use_cache=True, bos_token_id=0, eos_token_id=2, pad_token_id=None, tie_word_embeddings=False,
              use_parallel_residual=True, rope_parameters=None, attention_bias=True, is_decoder=False)
FEATURES = (llama.ROTARY - {"rmsnorm", "gated_mlp"}) | {
    "layernorm", "partial_rotary", "parallel_two_norms", "plain_mlp", "attention_bias", "attention_out_bias",
    "mlp_bias"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT, "classifier_dropout", "is_decoder")
    bias = hf.get("attention_bias")
    # config.json before transformers 5 names the rotary base and fraction rotary_emb_base and rotary_pct
    legacy = dict(theta=hf.get("rotary_emb_base", None) or 10000.0, rotary=hf.get("rotary_pct", None) or 0.25)
    parallel = hf.get("use_parallel_residual")
    return sizes(hf, "layer_norm_eps") | rope(hf, **legacy) | dict(
        norm_type="layernorm", mlp_type="plain", block_form="parallel_two_norms" if parallel else "sequential",
        attention_bias=bias, attention_out_bias=bias, mlp_bias=True)


def to_hf(a) -> dict:
    # GPTNeoXConfig reads rope_parameters (or rotary_pct and rotary_emb_base), no top-level partial_rotary_factor
    out = sizes_to_hf(a) | dict(
        rope_parameters=rope_parameters_to_hf(a, partial=True), layer_norm_eps=a.rms_norm_eps,
        attention_bias=a.attention_bias, use_parallel_residual=a.block_form == "parallel_two_norms")
    for key in ("rms_norm_eps", "head_dim", "num_key_value_heads"):
        del out[key]
    return out


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), PREFIX + "embed_in.weight")]
    out += phi._both(("final_norm",), PREFIX + "final_layer_norm")
    return out if a.tie_word_embeddings else out + [Weight(("lm_head", "kernel"), "embed_out.weight", "linear")]


def layer_weights(a, spec) -> list[Weight]:
    h, heads = PREFIX + "layers.{i}.", a.num_attention_heads
    out = phi._both(("attn_norm",), h + "input_layernorm") + phi._both(("mlp_norm",), h + "post_attention_layernorm")
    for j, n in enumerate("qkv"):
        out.append(Weight(("attn", n, "kernel"), h + "attention.query_key_value.weight", "linear", part=(j, 3),
                          groups=heads))
        if a.attention_bias:
            out.append(Weight(("attn", n, "bias"), h + "attention.query_key_value.bias", "vec", part=(j, 3),
                              groups=heads))
    out.append(Weight(("attn", "o", "kernel"), h + "attention.dense.weight", "linear", n_in=2))
    if a.attention_out_bias:
        out.append(Weight(("attn", "o", "bias"), h + "attention.dense.bias", "vec"))
    for leaf, name in (("up", "dense_h_to_4h"), ("down", "dense_4h_to_h")):
        out += [Weight(("mlp", leaf, "kernel"), h + f"mlp.{name}.weight", "linear"),
                Weight(("mlp", leaf, "bias"), h + f"mlp.{name}.bias", "vec")]
    return out


BASE = dict(norm_type="layernorm", mlp_type="plain", block_form="parallel_two_norms", hidden_act="gelu",
            rms_norm_eps=1e-5, partial_rotary_factor=0.25, attention_bias=True, attention_out_bias=True,
            mlp_bias=True, bos_token_id=0, eos_token_id=0)


def _pythia(hidden: int, layers: int, heads: int) -> dict:
    """EleutherAI/pythia-*/config.json: a vocabulary of 50304 (the tokenizer's 50277 padded), 2048 positions."""
    return BASE | dict(vocab_size=50304, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, max_position_embeddings=2048)


GPT_NEOX = Family(
    "gpt_neox", ("gpt_neox",), "GPTNeoXForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights,
    layer_weights,
    presets={
        "pythia-70m": _pythia(512, 6, 8),
        "pythia-160m": _pythia(768, 12, 12),
        "pythia-410m": _pythia(1024, 24, 16),
        "pythia-1b": _pythia(2048, 16, 8),
        "pythia-1.4b": _pythia(2048, 24, 16),
        "pythia-2.8b": _pythia(2560, 32, 32),
        "pythia-6.9b": _pythia(4096, 32, 32) | dict(vocab_size=50432),
        "pythia-12b": _pythia(5120, 36, 40) | dict(vocab_size=50688),
        # EleutherAI/gpt-neox-20b/config.json
        "gpt-neox-20b": BASE | dict(vocab_size=50432, hidden_size=6144, intermediate_size=24576, num_hidden_layers=44,
                                    num_attention_heads=64, max_position_embeddings=2048, hidden_act="gelu_fast",
                                    eos_token_id=2),
        "gpt-neox-tiny": BASE | dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=256, partial_rotary_factor=0.5,
                                     bos_token_id=None, eos_token_id=None),
    })
